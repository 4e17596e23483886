"""WSGI entry point for gunicorn; a configuration error ends the process with one sentence.

The URL configuration is imported here, while a worker boots, not by its first request: it
pulls in every app's views and the API's schemas, about 0.5 s of CPU that the first request
of every gunicorn worker process used to wait for (bench/gateway.py saw it as one request of
a run taking 0.4-0.7 s longer, whenever the measured connection landed on a process the
warm-up had not used)."""

import os
import sys

from django.core.exceptions import ImproperlyConfigured

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

try:
    from django.core.wsgi import get_wsgi_application

    application = get_wsgi_application()
except ImproperlyConfigured as exc:
    sys.stderr.write(f"Atrium cannot start: {exc}\n")
    sys.exit(2)

from django.urls import get_resolver  # noqa: E402 - after the settings are configured

get_resolver().url_patterns  # noqa: B018 - imports the URL configuration now

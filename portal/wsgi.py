"""WSGI entry point for gunicorn; a configuration error ends the process with one sentence."""

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

"""The WSGI entry point loads the whole URL configuration when a worker boots, so no worker's
first request pays for importing every view and the API's schemas."""

from __future__ import annotations

import subprocess
import sys

from django.conf import settings


def test_importing_the_wsgi_application_loads_the_url_configuration():
    code = ("import sys; import portal.wsgi; "
            "print(all(m in sys.modules for m in ('portal.urls', 'api.v1', 'serving.gateway', 'metering.views')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=settings.BASE_DIR, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


def test_without_the_wsgi_entry_point_django_setup_alone_does_not():
    """What the entry point adds: django.setup() by itself leaves the URLs to the first request."""
    code = "import sys, django; django.setup(); print('api.v1' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=settings.BASE_DIR, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"

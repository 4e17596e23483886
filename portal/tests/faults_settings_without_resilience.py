"""Atrium's settings without portal.resilience: used only to show that the PostgreSQL fault
test in test_faults.py can fail (ATRIUM_FAULTS_SETTINGS=portal.tests.faults_settings_without_resilience).
Never used by the application."""

from portal.settings import *  # noqa: F403

MIDDLEWARE = [m for m in MIDDLEWARE if not m.startswith("portal.resilience")]  # noqa: F405

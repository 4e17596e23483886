"""Atrium's Django project: settings, URLs, sign-in, audit and what every app shares."""

__version__ = "0.1.0"

"""RQ entry points of metering: small functions that call metering.services."""

from __future__ import annotations

import datetime as dt

from django.utils import timezone


def accrue_usage(days_back: int = 2) -> int:
    """Re-accrue the last days (idempotent upserts), so late-closed bindings are caught."""
    from metering import services

    now = timezone.now()
    return services.accrue(until=now, since=now - dt.timedelta(days=days_back))

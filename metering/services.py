"""Metering operations: accruing card time from bindings into the hourly ledger.

Accrual cuts every binding interval exactly at UTC hour boundaries and upserts one row per
(binding, hour) with the milli-card-seconds inside that hour. The row is recomputed from the
binding, never incremented, so running accrual twice, or again after a crash half-way, gives
the same ledger. A binding still open is accrued up to `until` and continued later.
"""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from metering.models import UsageRecord
from scheduling.models import Binding

HOUR = dt.timedelta(hours=1)


def hour_floor(t: dt.datetime) -> dt.datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def split_by_hour(start: dt.datetime, end: dt.datetime):
    """Yield (hour start, seconds inside that hour) for the interval [start, end)."""
    hour = hour_floor(start)
    while hour < end:
        lo, hi = max(start, hour), min(end, hour + HOUR)
        if hi > lo:
            yield hour, (hi - lo).total_seconds()
        hour += HOUR


def accrue(until: dt.datetime | None = None, since: dt.datetime | None = None, batch: int = 2000) -> int:
    """Upsert ledger rows for every binding overlapping [since, until); returns rows written."""
    until = until or timezone.now()
    bindings = Binding.objects.filter(start__lt=until).select_related("accelerator__node", "accelerator")
    if since is not None:
        # whole hours only: a row always holds its binding's full share of that hour
        since = hour_floor(since)
        bindings = bindings.filter(Q(end__isnull=True) | Q(end__gt=since))
    written = 0
    rows: list[UsageRecord] = []
    for b in bindings.iterator(chunk_size=batch):
        start = max(b.start, since) if since else b.start
        end = min(b.end or until, until)
        for hour, seconds in split_by_hour(start, end):
            rows.append(UsageRecord(
                hour=hour, tenant_id=b.tenant_id, project_id=b.project_id,
                accelerator_model_id=b.accelerator.model_id, pool_id=b.accelerator.node.pool_id,
                job_id=b.job_id, binding=b, milli_card_seconds=round(seconds * b.share_milli),
            ))
        if len(rows) >= batch:
            written += _upsert(rows)
            rows = []
    written += _upsert(rows)
    return written


def _upsert(rows: list[UsageRecord]) -> int:
    if not rows:
        return 0
    with transaction.atomic():
        UsageRecord.objects.bulk_create(
            rows, update_conflicts=True, unique_fields=["binding", "hour"], update_fields=["milli_card_seconds"],
        )
    return len(rows)

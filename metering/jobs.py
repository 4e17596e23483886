"""RQ entry points of metering: small functions that call metering.services.

Every job recomputes from its source (bindings -> ledger -> rollups) and writes by upsert,
so it can run twice or die half-way and the result is the same. Job ids are fixed per piece
of work, so enqueueing from a restarted loop never piles up duplicates.
"""

from __future__ import annotations

import datetime as dt
import logging

import django_rq
from django.utils import timezone
from redis.exceptions import RedisError
from rq import Callback, Retry

log = logging.getLogger(__name__)

ACTIVE = ("queued", "started", "deferred", "scheduled")


def _enqueue_unique(queue_name: str, func, job_id: str, *args, retry: Retry | None = None,
                    on_failure: Callback | None = None, skip: tuple[str, ...] = ACTIVE, result_ttl: int = 300,
                    failure_ttl: int = 24 * 3600, **kwargs) -> bool:
    """Enqueue `func` under `job_id` unless a job of that id is in a `skip` status (by default
    queued or running); a job of that id in any other status is replaced."""
    queue = django_rq.get_queue(queue_name)
    existing = queue.fetch_job(job_id)
    if existing is not None and existing.get_status(refresh=False) in skip:
        return False
    if existing is not None:
        existing.delete()
    queue.enqueue(func, job_id=job_id, result_ttl=result_ttl, failure_ttl=failure_ttl, args=args, kwargs=kwargs,
                  retry=retry, on_failure=on_failure)
    return True


def accrue_usage(days_back: int = 2) -> int:
    """Re-accrue the last days (idempotent upserts), so late-closed bindings are caught."""
    from metering import services

    now = timezone.now()
    return services.accrue(until=now, since=now - dt.timedelta(days=days_back))


def rollup_usage(since: str | None = None, until: str | None = None, days_back: int = 2) -> dict:
    """Accrue the ledger and recompute daily and monthly rollups of [since, until] (ISO dates)."""
    from metering import services

    today = timezone.now().date()
    first = dt.date.fromisoformat(since) if since else today - dt.timedelta(days=days_back)
    last = dt.date.fromisoformat(until) if until else today
    return services.rollup(first, last)


def close_month(month: str) -> dict:
    """Monthly close: recompute every day of the month and its monthly rollup (ISO first day)."""
    from metering import services

    first = dt.date.fromisoformat(month)
    return services.rollup(first, services.next_month(first) - dt.timedelta(days=1))


def check_budgets() -> int:
    from metering import services

    return len(services.check_budgets())


def build_report(report_id: int) -> int:
    from metering import services

    return services.build_report(report_id).lines


# A build whose worker dies (SIGKILL, a lost node) is found by RQ's maintenance once its
# heartbeat expires and run again, as is one that raised; a build is a whole rebuild, so a
# retry is safe. When the retries are spent the report says so instead of "running" forever.
REPORT_RETRIES = 2


def report_build_failed(job, connection, exc_type, exc_value, tb) -> None:
    """RQ's failure callback of a report build (also called for a build whose worker died)."""
    from metering import services

    if job.retries_left:
        return  # RQ runs it again
    services.report_build_lost(job.args[0], f"{getattr(exc_type, '__name__', 'error')}: {exc_value}"[:2000])


def enqueue_report(report_id: int) -> bool:
    """Queue a report build; when Redis is away the report stays queued and can be retried."""
    try:
        return _enqueue_unique("reports", build_report, f"atrium-report-{report_id}", report_id,
                               retry=Retry(max=REPORT_RETRIES), on_failure=Callback(report_build_failed))
    except RedisError as exc:
        log.warning("report %s not enqueued (Redis unreachable: %s)", report_id, exc)
        return False


CLOSE_DAYS = 3  # the previous month is closed on the first periodic call of the month's first 3 days


def enqueue_periodic(now: dt.datetime | None = None) -> list[str]:
    """Enqueue the periodic metering work (idempotent: fixed job ids). Call every few minutes;
    every worker also calls it when it starts (metering.worker).

    Rollups (with accrual) and budget checks every call; the monthly close of the previous
    month once, on the first call in the first CLOSE_DAYS days of a month (so a scheduler loop
    that was down on the 1st still closes it), and again on a later call of those days if it
    failed. The check and the enqueue are not atomic: two callers at the same instant may both
    enqueue a job; every one of these jobs is an idempotent recompute, so that costs time only.
    """
    from metering import services

    now = now or timezone.now()
    done = []
    if _enqueue_unique("metering", rollup_usage, "atrium-metering-rollup"):
        done.append("rollup")
    if _enqueue_unique("metering", check_budgets, "atrium-metering-budgets"):
        done.append("budgets")
    today = now.astimezone(dt.UTC).date()
    if today.day <= CLOSE_DAYS:
        previous = services.month_start(today.replace(day=1) - dt.timedelta(days=1))
        # one close per month: a finished close is kept past the close days, so later calls skip
        # it; one that failed (or was stopped) is tried again by the next call
        kept = (CLOSE_DAYS + 1) * 24 * 3600
        if _enqueue_unique("metering", close_month, f"atrium-metering-close-{previous:%Y-%m}", previous.isoformat(),
                           skip=(*ACTIVE, "finished"), result_ttl=kept, failure_ttl=kept):
            done.append("close")
    return done

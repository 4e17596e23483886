"""RQ entry points of the scheduler: the scheduling cycle and the simulated cluster's tick.

Small functions that call the cycle runner and backends. Enqueueing never fails a user's
request: when Redis is away the submission is stored and the periodic loop picks it up once
Redis returns. A cycle enqueued while another waits in the queue is not enqueued twice.
"""

from __future__ import annotations

import contextlib
import logging
import time

import django_rq
from django.conf import settings
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
LAST_CYCLE_KEY = "atrium:scheduling-cycle:last-end"  # when the last cycle ended (epoch seconds)

CYCLE_JOB_ID = "atrium-scheduling-cycle"


def enqueue_cycle() -> bool:
    try:
        queue = django_rq.get_queue("scheduling")
        existing = queue.fetch_job(CYCLE_JOB_ID)
        if existing is not None and existing.get_status(refresh=False) in ("queued", "started", "deferred", "scheduled"):
            return False
        queue.enqueue(run_scheduling_cycle, job_id=CYCLE_JOB_ID, result_ttl=60, failure_ttl=3600)
        return True
    except RedisError as exc:
        log.warning("scheduling cycle not enqueued (Redis unreachable: %s); the periodic loop will run it", exc)
        return False


def run_scheduling_cycle() -> dict:
    from scheduling.cycle import run_cycle

    pace_cycle()
    try:
        return run_cycle().as_dict()
    finally:
        with contextlib.suppress(RedisError):  # no pacing until Redis is back; the cycle itself is done
            django_rq.get_connection("scheduling").set(LAST_CYCLE_KEY, repr(time.time()), ex=3600)


def pace_cycle() -> float:
    """Wait until ATRIUM_CYCLE_MIN_INTERVAL seconds have passed since the last cycle ended;
    returns the seconds waited. While this job waits it counts as started, so submissions in
    the meantime do not enqueue another cycle: they are read by this one."""
    interval = float(getattr(settings, "ATRIUM_CYCLE_MIN_INTERVAL", 0) or 0)
    if interval <= 0:
        return 0.0
    try:
        last = django_rq.get_connection("scheduling").get(LAST_CYCLE_KEY)
        wait = float(last) + interval - time.time() if last else 0.0
    except (RedisError, ValueError):
        return 0.0
    wait = min(wait, interval)  # a clock step back never stalls the scheduler
    if wait > 0:
        time.sleep(wait)
    return max(wait, 0.0)


def tick_cluster() -> dict:
    """Advance the cluster backend: start admitted jobs, finish those whose time is up."""
    from scheduling.backends import get_backend

    return get_backend().tick()

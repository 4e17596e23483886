"""RQ entry points of the scheduler: the scheduling cycle and the simulated cluster's tick.

Small functions that call the cycle runner and backends. Enqueueing never fails a user's
request: when Redis is away the submission is stored and the periodic loop picks it up once
Redis returns. A cycle enqueued while another waits in the queue is not enqueued twice.
"""

from __future__ import annotations

import logging

import django_rq
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

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

    return run_cycle().as_dict()


def tick_cluster() -> dict:
    """Advance the cluster backend: start admitted jobs, finish those whose time is up."""
    from scheduling.backends import get_backend

    return get_backend().tick()

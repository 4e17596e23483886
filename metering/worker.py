"""The RQ worker classes Atrium runs (settings.RQ["WORKER_CLASS"], `make run`'s SimpleWorker).

At start-up a worker schedules the periodic metering work (metering.jobs.enqueue_periodic:
fixed job ids, so a job still queued or running is not enqueued again; workers starting at the
very same instant may both enqueue one, and every one is an idempotent recompute). The
scheduler loop goes on enqueueing it every five minutes; a worker that starts while the loop
is down still gets rollups, budget checks and the month close going. A burst worker (tests,
one-off drains) only works off what is queued.
"""

from __future__ import annotations

import logging

import rq
from redis.exceptions import RedisError

log = logging.getLogger("atrium.worker")


class _SchedulesPeriodicWork:
    def work(self, *args, **kwargs):
        if not kwargs.get("burst", args[0] if args else False):
            from metering import jobs

            try:
                jobs.enqueue_periodic()
            except RedisError as exc:  # the worker's own loop reports Redis; it will be enqueued later
                log.warning("periodic metering work not scheduled at start-up: %s", exc)
        return super().work(*args, **kwargs)


class Worker(_SchedulesPeriodicWork, rq.Worker):
    """rq.Worker (a fork per job) that schedules the periodic work when it starts."""


class SimpleWorker(_SchedulesPeriodicWork, rq.SimpleWorker):
    """rq.SimpleWorker (jobs in the worker's own process) that schedules the periodic work."""

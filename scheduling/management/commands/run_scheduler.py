"""The periodic loop: every ATRIUM_SCHEDULER_PERIOD seconds it enqueues a scheduling cycle,
a cluster tick and (less often) metering accrual as RQ jobs.

Idempotent: the RQ job ids are fixed, so a loop restarted, or two loops, never pile up
duplicate work. When Redis is unreachable it says so once and keeps trying; it never exits
on a transient error.
"""

from __future__ import annotations

import signal
import time

import django_rq
from django.conf import settings
from django.core.management.base import BaseCommand
from redis.exceptions import RedisError

from scheduling import jobs as scheduling_jobs


def enqueue_unique(queue_name: str, func, job_id: str) -> None:
    queue = django_rq.get_queue(queue_name)
    existing = queue.fetch_job(job_id)
    if existing is not None and existing.get_status(refresh=False) in ("queued", "started", "deferred", "scheduled"):
        return
    queue.enqueue(func, job_id=job_id, result_ttl=60, failure_ttl=3600)


class Command(BaseCommand):
    help = "Run the periodic scheduler loop (cycles, cluster ticks, metering accrual)."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="enqueue one round and exit")

    def handle(self, *args, once: bool, **opts):
        from metering import jobs as metering_jobs

        period = settings.ATRIUM_SCHEDULER_PERIOD
        stopping = False

        def stop(*_):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        redis_down = False
        rounds = 0
        self.stdout.write(f"Scheduler loop: every {period}s (Ctrl-C to stop).")
        while not stopping:
            try:
                scheduling_jobs.enqueue_cycle()
                if settings.ATRIUM_CLUSTER_BACKEND == "kubernetes":
                    from scheduling.k8s_jobs import enqueue_kubernetes_work

                    # sync, health and reconcile replace the simulated tick (never both)
                    enqueue_kubernetes_work(inventory=rounds % 6 == 0)
                else:
                    enqueue_unique("scheduling", scheduling_jobs.tick_cluster, "atrium-cluster-tick")
                if rounds % max(1, 300 // period) == 0:
                    # rollups (with accrual), budget checks and, on the 1st, the month close
                    metering_jobs.enqueue_periodic()
                if redis_down:
                    self.stdout.write("Redis is back; background work resumes.")
                redis_down = False
            except RedisError as exc:
                if not redis_down:
                    self.stderr.write(f"Redis unreachable ({exc}); retrying every {period}s.")
                redis_down = True
            rounds += 1
            if once:
                break
            for _ in range(period * 10):
                if stopping:
                    break
                time.sleep(0.1)

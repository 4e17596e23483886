"""Periodic metering work is enqueued idempotently (fixed job ids) and runs for real on RQ.

django-rq enqueues after commit; the test transaction never commits, so the on-commit
callbacks are run explicitly (as a committed request would run them)."""

from __future__ import annotations

import pytest
import rq
from django.conf import settings
from django.db.models import Sum
from rq.job import JobStatus

from metering import jobs
from metering.models import Alarm, UsageRecord
from metering.tests.conftest import run_burst, t


@pytest.mark.django_db
def test_periodic_work_is_enqueued_once_and_the_month_close_once_per_month(
        rq_queues, django_capture_on_commit_callbacks):
    def periodic(now):
        with django_capture_on_commit_callbacks(execute=True):
            return jobs.enqueue_periodic(now)

    assert periodic(t(2025, 3, 15, 10)) == ["rollup", "budgets"]
    assert periodic(t(2025, 3, 15, 10, 5)) == []  # still queued: not twice
    assert rq_queues[0].count == 2
    assert periodic(t(2025, 4, 1, 0, 5)) == ["close"]
    assert periodic(t(2025, 4, 1, 0, 10)) == []
    close = rq_queues[0].fetch_job("atrium-metering-close-2025-03")
    assert close.args == ("2025-03-01",)
    close.set_status(JobStatus.FAILED)  # a close that failed is tried again on a later call
    assert periodic(t(2025, 4, 2, 9)) == ["close"]
    rq_queues[0].fetch_job("atrium-metering-close-2025-03").set_status(JobStatus.FINISHED)
    assert periodic(t(2025, 4, 3, 9)) == []  # one that finished is not: once per month
    # a loop that was down on the 1st closes the month on the 2nd or 3rd, not later
    assert periodic(t(2025, 5, 3, 23, 55)) == ["close"]
    assert rq_queues[0].fetch_job("atrium-metering-close-2025-04").args == ("2025-04-01",)
    assert periodic(t(2025, 6, 4, 0, 5)) == []
    assert rq_queues[0].fetch_job("atrium-metering-close-2025-05") is None


@pytest.mark.django_db(transaction=True)
def test_a_starting_worker_schedules_the_periodic_work_and_a_burst_worker_does_not(rq_queues):
    from metering.worker import SimpleWorker, Worker

    assert settings.RQ["WORKER_CLASS"] == "metering.worker.Worker" and issubclass(Worker, rq.Worker)
    queue = rq_queues[0]
    SimpleWorker(rq_queues, connection=queue.connection).work(burst=True)
    assert queue.count == 0 and not queue.finished_job_registry.get_job_ids()
    # a worker that starts for good schedules the periodic work (fixed ids, so never twice) and runs it
    SimpleWorker(rq_queues, connection=queue.connection).work(max_idle_time=1)
    finished = set(queue.finished_job_registry.get_job_ids())
    assert {"atrium-metering-rollup", "atrium-metering-budgets"} <= finished, finished


@pytest.mark.django_db
def test_rollup_and_budget_jobs_run_on_a_real_worker(org, bind, prices, rq_queues, django_capture_on_commit_callbacks):
    from metering import services

    bind("alpha", t(2025, 3, 3, 0), t(2025, 3, 3, 9))
    services.set_budget(org.admin, tenant=org.tenants["alpha"], unit="card_hours", amount=1)
    with django_capture_on_commit_callbacks(execute=True):
        rq_queues[0].enqueue(jobs.rollup_usage, "2025-03-01", "2025-03-05")
    run_burst(rq_queues)
    assert UsageRecord.objects.aggregate(s=Sum("milli_card_seconds"))["s"] == 9 * 3_600_000
    services.check_budgets(t(2025, 3, 10))
    assert Alarm.objects.filter(tenant=org.tenants["alpha"]).count() == 2  # 80 % and 100 %, once each

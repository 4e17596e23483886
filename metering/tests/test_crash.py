"""A real RQ worker process killed with SIGKILL in the middle of a rollup; the retry must
leave the ledger and the rollups equal to the exact sum of the bindings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import django_rq
import pytest
from django.conf import settings
from django.db import connection
from django.db.models import Sum

from metering import jobs, services
from metering.models import Granularity, UsageRecord, UsageRollup
from metering.tests.conftest import run_burst, t
from scheduling.models import Binding

ROOT = Path(settings.BASE_DIR)

# The worker process: the real settings, the test database, a small batch so the rollup takes
# seconds (the batch size is a setting, not a patch of our code), a SimpleWorker so SIGKILL
# hits the process running the job.
WORKER = """
import django, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django.setup()
from django.conf import settings
settings.ATRIUM_METERING_BATCH = 10
import django_rq
from rq import SimpleWorker
queue = django_rq.get_queue("metering")
SimpleWorker([queue], connection=queue.connection).work(burst=True)
"""


@pytest.mark.django_db(transaction=True)
def test_worker_killed_mid_rollup_then_retried_counts_every_card_second_once(org, bind, prices, rq_queues):
    cards = list(org.nodes[0].accelerators.all()) + list(org.nodes[1].accelerators.all())
    for i in range(240):  # ~12,000 ledger rows, 1,200 transactions of 10 in the worker
        start = t(2025, 1, 30, 0, 0) + (i % 24) * services.HOUR / 7 + services.DAY * (i % 2)
        bind("alpha" if i % 3 else "beta", start, start + services.HOUR * (40 + i % 17) + services.HOUR / 13,
             card=cards[i % len(cards)], share_milli=(250, 500, 1000)[i % 3])
    until = t(2025, 2, 5)
    expected = sum(services.binding_mcs(b, until) for b in Binding.objects.all())
    expected_rows = sum(len(list(services.split_by_hour(b.start, b.end))) for b in Binding.objects.all())

    rq_queues[0].enqueue(jobs.rollup_usage, "2025-01-29", "2025-02-04", job_timeout=600)
    db = settings.DATABASES["default"]
    env = {**os.environ, "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{connection.settings_dict['NAME']}"}
    worker = subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, env=env)
    seen = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and worker.poll() is None:
        seen = UsageRecord.objects.count()
        if expected_rows * 0.2 < seen < expected_rows * 0.8:
            break
        time.sleep(0.02)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    assert worker.returncode == -signal.SIGKILL
    partial = UsageRecord.objects.count()
    assert 0 < partial < expected_rows, "the kill must land half-way"

    # the retry: the same job enqueued again (the killed one stays 'started' until RQ reaps it)
    django_rq.get_queue("metering").enqueue(jobs.rollup_usage, "2025-01-29", "2025-02-04")
    run_burst(rq_queues)
    assert UsageRecord.objects.count() == expected_rows
    assert UsageRecord.objects.aggregate(s=Sum("milli_card_seconds"))["s"] == expected
    for granularity in (Granularity.DAY, Granularity.MONTH):
        total = UsageRollup.objects.filter(granularity=granularity).aggregate(s=Sum("milli_card_seconds"))["s"]
        assert total == expected, granularity

"""A real RQ worker process killed with SIGKILL in the middle of a report build: while it computes
the lines, and between writing two of the report's files. RQ notices the dead job and retries
it; the retried report must equal a clean build of the same report (lines, totals, every
file's content), its lines must sum to its totals, and there must be one report row and one
file of each format on disk: no orphan from the killed attempt.

The worker is slowed, never patched: a PostgreSQL trigger makes each write to the report row
(the progress updates) take a quarter of a second, or a storage class with a slow disk makes
each saved file take seconds. Both are outside our code, like the batch-size setting of
test_crash.py. The kill waits for a state (progress half-way, a first file on disk), never
for a time.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import os
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from openpyxl import load_workbook
from rq.registry import FailedJobRegistry, StartedJobRegistry

from metering import jobs, services
from metering.models import Report, ReportGrouping, ReportMode, ReportStatus
from metering.tests.conftest import run_burst, t
from portal.models import AuditEvent

ROOT = Path(settings.BASE_DIR)
START, END = dt.date(2024, 1, 1), dt.date(2026, 1, 1)  # 24 months: 24 progress steps

# The worker process: the real settings, the test database and MEDIA_ROOT from the environment,
# optionally a slow disk under the default storage, and a SimpleWorker so SIGKILL hits the
# process running the job.
WORKER = """
import os, time
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django.setup()
from django.core.files.storage import FileSystemStorage, default_storage


class SlowDisk(FileSystemStorage):
    def _save(self, name, content):
        saved = super()._save(name, content)
        time.sleep(float(os.environ["SLOW_DISK_SECONDS"]))
        return saved


if os.environ.get("SLOW_DISK_SECONDS"):
    default_storage._wrapped = SlowDisk()
import django_rq
from rq import SimpleWorker
queue = django_rq.get_queue("reports")
SimpleWorker([queue], connection=queue.connection).work(burst=True)
"""

SLOW_REPORT_WRITES = """
CREATE OR REPLACE FUNCTION atrium_test_slow_report() RETURNS trigger AS $$
BEGIN PERFORM pg_sleep(0.25); RETURN NEW; END $$ LANGUAGE plpgsql;
CREATE TRIGGER atrium_test_slow_report BEFORE UPDATE ON metering_report
FOR EACH ROW EXECUTE FUNCTION atrium_test_slow_report();
"""
FAST_REPORT_WRITES = """
DROP TRIGGER IF EXISTS atrium_test_slow_report ON metering_report;
DROP FUNCTION IF EXISTS atrium_test_slow_report();
"""


@pytest.fixture
def media(settings, tmp_path):
    settings.MEDIA_ROOT = str(tmp_path)
    return tmp_path


@pytest.fixture
def usage(org, bind, prices):
    """Two years of bindings of both tenants on H100 and L4, rolled up into the ledger."""
    h100 = list(org.nodes[0].accelerators.order_by("pk"))
    l4 = org.nodes[2].accelerators.order_by("pk").first()
    for i in range(96):
        start = t(2024, 1, 3, 7) + services.DAY * (i * 7.5) + services.HOUR * (i % 11)
        bind("alpha" if i % 3 else "beta", start, start + services.HOUR * (20 + i % 29) + services.HOUR / 7,
             card=l4 if i % 5 == 0 else h100[i % len(h100)], share_milli=(1000, 500, 250)[i % 3])
    services.rollup(START, END, now=t(2026, 1, 2))


def _request(org) -> Report:
    return services.request_report(org.finance, period_start=START, period_end=END, grouping=ReportGrouping.PROJECT,
                                   mode=ReportMode.CHARGEBACK, enqueue=False)


def _contents(report: Report) -> dict:
    """The three files' contents; FOCUS rows without x_ReportId, which names the report itself."""
    report.refresh_from_db()
    focus = list(csv.DictReader(io.StringIO(report.focus_file.open("rb").read().decode())))
    assert {row.pop("x_ReportId") for row in focus} == {str(report.pk)}
    return {
        "csv": report.csv_file.open("rb").read().decode(),
        "xlsx": [list(r) for r in load_workbook(report.xlsx_file.open("rb")).active.iter_rows(values_only=True)],
        "focus": focus,
    }


def _files_on_disk(media: Path, report: Report) -> list[str]:
    return sorted(p.name for p in (media / "reports").glob(f"report-{report.pk}-*"))


def _worker(media: Path, slow_disk: float | None) -> subprocess.Popen:
    db = settings.DATABASES["default"]
    env = {**os.environ, "MEDIA_ROOT": str(media),
           "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{connection.settings_dict['NAME']}"}
    if slow_disk:
        env["SLOW_DISK_SECONDS"] = str(slow_disk)
    return subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, env=env)


def _wait_for(condition, worker: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and worker.poll() is None:
        if condition():
            return
        time.sleep(0.02)
    worker.kill()
    pytest.fail(f"the worker never reached {what} (exit {worker.poll()})")


def _no_statement_of(pid_before: set[int]) -> bool:
    """The killed worker's last statement may still run on the server; wait until it has ended."""
    with connection.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND state = 'active' "
                    "AND pid <> pg_backend_pid()")
        return not ({row[0] for row in cur.fetchall()} - pid_before)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kill_while", ["computing lines", "writing files"])
def test_a_report_whose_worker_is_killed_is_retried_and_equals_a_clean_build(org, usage, media, rq_queues,
                                                                            kill_while):
    # a clean build of the same report, in this process, is what the retried one must equal
    clean = _request(org)
    services.build_report(clean.pk)
    want = _contents(clean)

    report = _request(org)
    assert jobs.enqueue_report(report.pk)
    if kill_while == "computing lines":
        with connection.cursor() as cur:
            cur.execute(SLOW_REPORT_WRITES)
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
            before = {row[0] for row in cur.fetchall()}
        worker = _worker(media, slow_disk=30 if kill_while == "writing files" else None)
        if kill_while == "computing lines":
            _wait_for(lambda: 20 <= Report.objects.get(pk=report.pk).progress <= 80, worker, "half-way")
        else:
            _wait_for(lambda: _files_on_disk(media, report), worker, "its first file")
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        assert worker.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while not _no_statement_of(before) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        with connection.cursor() as cur:
            cur.execute(FAST_REPORT_WRITES)

    # what the page shows meanwhile is true: the build started and did not finish
    report.refresh_from_db()
    assert report.status == ReportStatus.RUNNING and report.progress < 100 and report.finished is None
    if kill_while == "writing files":
        assert len(_files_on_disk(media, report)) == 1  # the kill landed between two files

    # RQ's own maintenance finds the job whose worker died once its heartbeat has expired (about
    # 90 s in production, then the next maintenance run); here the clock is moved on, not waited
    queue = rq_queues[1]
    StartedJobRegistry(queue=queue).cleanup(timestamp=time.time() + 3600)
    run_burst(rq_queues)

    report.refresh_from_db()
    assert report.status == ReportStatus.DONE and report.progress == 100 and not report.error, report.error
    assert FailedJobRegistry(queue=queue).count == 0
    got = _contents(report)
    assert got == want
    assert (report.lines, report.total_cost, report.total_card_hours) == (clean.lines, clean.total_cost,
                                                                           clean.total_card_hours)
    # the lines sum to the totals, in every file
    *lines, total = list(csv.DictReader(io.StringIO(got["csv"])))
    assert len(lines) == report.lines and total["tenant"] == "TOTAL"
    assert sum(Decimal(r["cost"]) for r in lines) == Decimal(total["cost"]) == report.total_cost
    assert sum(Decimal(r["card_hours"]) for r in lines) == Decimal(total["card_hours"])
    assert sum(Decimal(r["BilledCost"]) for r in got["focus"]) == report.total_cost
    # one row per request, one file per format: nothing left over from the killed attempt
    assert Report.objects.count() == 2
    assert AuditEvent.objects.filter(action="metering.report.request").count() == 2
    names = _files_on_disk(media, report)
    assert names == sorted(Path(f.name).name for f in (report.csv_file, report.xlsx_file, report.focus_file)), names


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_report_whose_every_attempt_dies_says_it_failed_instead_of_running_forever(org, usage, media, rq_queues):
    report = _request(org)
    assert jobs.enqueue_report(report.pk)
    queue = rq_queues[1]
    for attempt in range(jobs.REPORT_RETRIES + 1):
        worker = _worker(media, slow_disk=30)
        _wait_for(lambda: _files_on_disk(media, report), worker, f"its first file (attempt {attempt + 1})")
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        report.refresh_from_db()
        assert report.status == ReportStatus.RUNNING
        StartedJobRegistry(queue=queue).cleanup(timestamp=time.time() + 3600)
        report.refresh_from_db()
        if attempt < jobs.REPORT_RETRIES:
            assert report.status == ReportStatus.RUNNING and queue.count == 1  # queued again
            (media / "reports" / _files_on_disk(media, report)[0]).unlink()  # the next attempt's first file
    assert report.status == ReportStatus.FAILED and "AbandonedJobError" in report.error and report.finished
    assert queue.count == 0 and FailedJobRegistry(queue=queue).count == 1

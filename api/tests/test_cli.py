"""The `atrium` CLI end to end: `python -m atrium_cli` in a subprocess against a live server.

The config lives in a per-test XDG_CONFIG_HOME; the tests check its mode, the exit codes, the
--json output and that each failure is one sentence on stderr.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI_DIR = Path(__file__).resolve().parents[2] / "cli"


@pytest.fixture
def atrium(tmp_path, live_server):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ATRIUM_")},
           "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(CLI_DIR), "HOME": str(tmp_path)}

    def run(*args, stdin: str | None = None, url: bool = False, background: bool = False):
        cmd = [sys.executable, "-m", "atrium_cli", *args]
        if url:
            cmd += ["--url", live_server.url]
        if background:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True, timeout=60)

    run.config = tmp_path / "xdg" / "atrium" / "config.json"
    run.url = live_server.url
    return run


def one_sentence(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("atrium: ") and lines[0].endswith("."), lines[0]
    return lines[0]


def login(atrium, secret):
    done = atrium("login", "--token-stdin", stdin=secret + "\n", url=True)
    assert done.returncode == 0, done.stderr
    return done


def test_login_submit_watch_until_running_and_cancel(transactional_db, org, issue, atrium):
    from scheduling.backends.simulated import SimulatedCluster
    from scheduling.cycle import run_cycle

    _, secret = issue(org.people["alpha"]["user"], "submit")
    done = login(atrium, secret)
    assert "as alpha-user" in done.stdout
    assert stat.S_IMODE(atrium.config.stat().st_mode) == 0o600
    assert stat.S_IMODE(atrium.config.parent.stat().st_mode) == 0o700
    assert json.loads(atrium.config.read_text())["token"] == secret and secret not in done.stdout

    specs = atrium("specs", "--json")
    assert specs.returncode == 0 and {s["name"] for s in json.loads(specs.stdout)} == {"h100 x1", "h100 x4", "l4 x0.5"}
    assert "h100 x4" in atrium("specs").stdout.splitlines()[2]  # a table, sorted by name

    sub = atrium("submit", "--project", "alpha-p", "--spec", "h100 x1", "--priority", "batch", "--json",
                 "--", "python", "train.py", "--lr", "0.1")
    assert sub.returncode == 0, sub.stderr
    job = json.loads(sub.stdout)
    assert job["command"] == ["python", "train.py", "--lr", "0.1"] and job["state"] == "pending"

    watcher = atrium("job", str(job["id"]), "--wait", "running", "--interval", "0.3", "--wait-timeout", "40",
                     background=True)
    time.sleep(1.0)
    run_cycle()
    SimulatedCluster().tick()
    out, err = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, err
    assert "state     running" in out and "H100-SXM5-80GB" in out  # the card it holds

    listing = atrium("jobs", "--watch", "--count", "2", "--interval", "0.2")
    assert listing.returncode == 0
    assert listing.stdout.count("running") == 2 and listing.stdout.splitlines()[0].split()[:3] == ["ID", "PROJECT", "NAME"]

    cancel = atrium("cancel", str(job["id"]), "--reason", "done")
    assert cancel.returncode == 0 and cancel.stdout.strip() == f"Job {job['id']} is now cancelled."
    again = atrium("cancel", str(job["id"]))
    assert again.returncode == 6 and "already cancelled" in one_sentence(again.stderr)


def test_cli_errors_are_one_sentence_with_meaningful_exit_codes(transactional_db, org, issue, atrium, beta_job):
    not_logged_in = atrium("jobs")
    assert not_logged_in.returncode == 2 and "atrium login" in one_sentence(not_logged_in.stderr)

    bad = atrium("login", "--token-stdin", stdin="atp_wrong\n", url=True)
    assert bad.returncode == 3 and "Not logged in" in one_sentence(bad.stderr) and not atrium.config.exists()

    _, read_secret = issue(org.people["alpha"]["user"], "read")
    login(atrium, read_secret)
    scope = atrium("submit", "--project", "alpha-p", "--spec", "h100 x1", "--priority", "batch", "--", "true")
    assert scope.returncode == 4 and "scope 'submit'" in one_sentence(scope.stderr)

    _, submit_secret = issue(org.people["alpha"]["user"], "submit")
    login(atrium, submit_secret)
    spec = atrium("submit", "--project", "alpha-p", "--spec", "tpu x8", "--priority", "batch", "--", "true")
    assert spec.returncode == 6 and "spec: no active resource spec 'tpu x8'" in one_sentence(spec.stderr)
    foreign = atrium("job", str(beta_job.pk))
    assert foreign.returncode == 5 and "outside your reach" in one_sentence(foreign.stderr)
    no_cmd = atrium("submit", "--project", "alpha-p", "--spec", "h100 x1", "--priority", "batch")
    assert no_cmd.returncode == 2

    down = atrium("specs", "--url", "http://127.0.0.1:9")
    assert down.returncode == 8 and "cannot reach" in one_sentence(down.stderr)


def test_over_quota_job_says_why_it_waits(transactional_db, org, issue, atrium):
    from scheduling.cycle import run_cycle

    _, secret = issue(org.people["alpha"]["user"], "submit")
    login(atrium, secret)
    ids = []
    for _ in range(2):  # alpha-p may hold 4 H100: the second job of 4 waits for quota
        sub = atrium("submit", "--project", "alpha/alpha-p", "--spec", "h100 x4", "--priority", "batch", "--json",
                     "--", "sleep", "600")
        ids.append(json.loads(sub.stdout)["id"])
    run_cycle()
    waiting = atrium("job", str(ids[1]), "--json")
    assert json.loads(waiting.stdout)["wait_reason"] == "quota"
    shown = atrium("job", str(ids[1]))
    assert "waiting   quota:" in shown.stdout
    timed_out = atrium("job", str(ids[1]), "--wait", "running", "--wait-timeout", "0.5", "--interval", "0.2")
    assert timed_out.returncode == 9 and "gave up waiting" in one_sentence(timed_out.stderr)
    quota = atrium("quota", "--json")
    line = next(r for r in json.loads(quota.stdout) if r["project"] == "alpha-p" and r["accelerator_model"] == "H100-SXM5-80GB")
    assert line["in_use"] == 4.0 and line["left"] == 0.0
    assert "alpha/alpha-p" in atrium("quota").stdout


def test_usage_and_report_commands(transactional_db, org, issue, atrium, tmp_path):
    from metering import services as metering
    from metering.models import Report

    _, secret = issue(org.people["alpha"]["admin"])
    login(atrium, secret)
    usage = atrium("usage", "--month", "2026-01", "--json")
    assert usage.returncode == 0 and json.loads(usage.stdout)["total_card_hours"] == 0
    assert "Total 2026-01: 0 card-hours" in atrium("usage", "--month", "2026-01").stdout
    out = tmp_path / "r.csv"
    proc = atrium("report", "--period", "2026-01", "--tenant", "alpha", "--interval", "0.3", "-o", str(out),
                  background=True)
    for _ in range(100):
        report = Report.objects.first()
        if report is not None:
            break
        time.sleep(0.2)
    metering.build_report(report.pk)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert f"Report {report.pk}" in stdout and out.read_text().splitlines()[0].count(",") >= 2
    bad = atrium("report", "--period", "November")
    assert bad.returncode == 2 and "--period" in one_sentence(bad.stderr)

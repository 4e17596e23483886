"""Load benchmark: many simulated people on one Atrium (gunicorn, PostgreSQL, Redis, a worker and
the scheduler loop, all real processes on loopback), then the invariants the platform promises.

Simulated users are threads with their own `requests` session (sign-in with the form and its
CSRF token), cycling through: the dashboard, the job list, the submit form, a submission, its
detail page, a cancellation of some of their jobs, and (when a published model service and the
demo model server are there) a gateway call with a project API key. It reports requests/s and
p50/p95/p99 per page, and the error count (every answer must be the expected 200/302). Then it
checks: no quota exceeded and no card over-committed (the scheduler's invariant checker), every
submission in the database exactly once, the usage ledger equal to the exact sum of the
bindings, and one metered gateway record per successful gateway call.

Data: the demo organisation (`seed_demo`, idempotent) in its own database; users of the three
demo tenants. It never touches another database or Redis DB than the ones given. Writes
bench/results/load.json. A measurement, not a timed test.

    .venv/bin/python bench/load.py                         # 40 users, 60 s (this 2-core machine)
    .venv/bin/python bench/load.py --users 200 --seconds 300 --workers 8   # the issue's size
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlsplit

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "load.json"
DEMO_PASSWORD = "atrium-demo"
# people of the three demo tenants who submit jobs, and those who only look
SUBMITTERS = ["vision-user", "nlp-user", "genomics-user", "vision-admin", "nlp-admin"]
DASHBOARD_P95_TARGET_MS = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def ensure_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def wait_http(url: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not come up")


def setup_django(env: dict) -> None:
    os.environ.update(env)
    import django

    django.setup()


# --- what each simulated user may do (read once, in this process, through the services) ---------


def plans() -> dict:
    from django.contrib.auth import get_user_model

    from scheduling import services as sched
    from tenants import access
    from tenants.models import Project

    out = {}
    for username in SUBMITTERS:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            continue
        options = []
        projects = Project.objects.filter(pk__in=access.project_ids(user, "submit_job"), archived__isnull=True,
                                          tenant__state="active")
        for project in projects:
            specs = [s for s in sched.allowed_specs(project) if s.mode != "whole" or s.gpu_count <= 2][:3]
            prios = [p for p in sched.allowed_priority_classes(user, project) if p.preemptible] or list(
                sched.allowed_priority_classes(user, project))
            for spec in specs:
                for prio in prios[:2]:
                    options.append({"project": project.pk, "spec": spec.pk, "priority_class": prio.pk})
        if options:
            out[username] = options
    return out


def gateway_key() -> tuple[str, str] | None:
    """(model slug, secret) of a fresh key for a published demo service, or None."""
    from django.db.models import Q

    from portal import context
    from serving import services as svc
    from serving.models import ApiKey, ModelService, ServiceStatus
    from tenants import access
    from tenants.models import ProjectMembership

    service = ModelService.objects.filter(status=ServiceStatus.PUBLISHED).select_related("project").first()
    if service is None:
        return None
    holder = None
    for m in ProjectMembership.objects.filter(project=service.project).select_related("user"):
        if access.can(m.user, svc.KEY_PERM, service.project):
            holder = m.user
            break
    if holder is None:
        return None
    with context.bound(sudo=True, actor_label="bench:load"):
        ApiKey.objects.filter(Q(name="bench-load") & Q(project=service.project), revoked__isnull=True).update(
            revoked=__import__("django.utils.timezone", fromlist=["now"]).now())
        _key, secret = svc.create_api_key(holder, project=service.project, name="bench-load", services=[service],
                                          requests_per_minute=100_000, tokens_per_minute=10_000_000)
    return service.slug, secret


# --- the simulated people ---------------------------------------------------------------------


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []
        self.submitted: list[str] = []
        self.cancelled: list[int] = []
        self.gateway_ok = 0

    def add(self, label: str, seconds: float, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.latency[label].append(seconds)
            if not ok:
                self.errors.append(f"{label}: {detail}"[:300])


def timed(stats: Stats, label: str, fn, expect: tuple[int, ...]):
    t0 = time.perf_counter()
    try:
        r = fn()
    except requests.RequestException as exc:
        stats.add(label, time.perf_counter() - t0, False, repr(exc))
        return None
    ok = r.status_code in expect
    stats.add(label, time.perf_counter() - t0, ok, f"{r.status_code} {r.url}")
    return r if ok else None


def csrf(session: requests.Session) -> str:
    return session.cookies.get("csrftoken", "")


def person(base: str, username: str, options: list[dict] | None, gateway: tuple[str, str] | None, stats: Stats,
           stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    s = requests.Session()
    s.headers["Referer"] = base + "/"
    r = timed(stats, "GET /login/", lambda: s.get(base + "/login/", timeout=30), (200,))
    if r is None:
        return
    r = timed(stats, "POST /login/", lambda: s.post(base + "/login/", data={
        "username": username, "password": DEMO_PASSWORD, "csrfmiddlewaretoken": csrf(s)},
        allow_redirects=False, timeout=30), (302,))
    if r is None:
        return
    mine: list[int] = []
    while not stop.is_set():
        action = rng.random()
        if action < 0.35:
            timed(stats, "GET / (dashboard)", lambda: s.get(base + "/", timeout=30), (200,))
        elif action < 0.6:
            timed(stats, "GET /scheduling/jobs/", lambda: s.get(base + "/scheduling/jobs/", timeout=30), (200,))
        elif action < 0.75 and options:
            timed(stats, "GET /scheduling/jobs/new/", lambda: s.get(base + "/scheduling/jobs/new/", timeout=30), (200,))
            name = f"load-{uuid.uuid4().hex[:12]}"
            body = {**rng.choice(options), "name": name, "image": "busybox", "command": "sleep 1", "replicas": "1",
                    "expected_minutes": str(rng.randint(1, 30)), "time_limit_minutes": "60",
                    "csrfmiddlewaretoken": csrf(s)}
            r = timed(stats, "POST /scheduling/jobs/new/", lambda body=body: s.post(
                base + "/scheduling/jobs/new/", data=body, allow_redirects=False, timeout=30), (302,))
            if r is not None:
                with stats.lock:
                    stats.submitted.append(name)
                m = re.search(r"/jobs/(\d+)/", r.headers.get("Location", ""))
                if m:
                    mine.append(int(m.group(1)))
                    timed(stats, "GET /scheduling/jobs/<pk>/", lambda r=r: s.get(base + r.headers["Location"], timeout=30),
                          (200,))
        elif action < 0.82 and mine:
            pk = mine.pop(rng.randrange(len(mine)))
            r = timed(stats, "POST /scheduling/jobs/<pk>/cancel/", lambda pk=pk: s.post(
                base + f"/scheduling/jobs/{pk}/cancel/", data={"confirm": "on", "reason": "load test",
                                                              "csrfmiddlewaretoken": csrf(s)},
                allow_redirects=False, timeout=30), (302,))
            if r is not None:
                with stats.lock:
                    stats.cancelled.append(pk)
        elif action < 0.9 and gateway:
            model, secret = gateway
            r = timed(stats, "POST /v1/chat/completions", lambda model=model, secret=secret: requests.post(
                base + "/v1/chat/completions", json={"model": model, "messages": [
                    {"role": "user", "content": "how many cards are free"}], "max_tokens": 16},
                headers={"Authorization": f"Bearer {secret}"}, timeout=30), (200,))
            if r is not None:
                with stats.lock:
                    stats.gateway_ok += 1
        else:
            timed(stats, "GET /scheduling/jobs/?htmx", lambda: s.get(base + "/scheduling/jobs/", timeout=30,
                                                                      headers={"HX-Request": "true"}), (200,))
        time.sleep(rng.uniform(0.2, 1.0))  # think time


# --- afterwards ---------------------------------------------------------------------------------


def invariants(stats: Stats, started_at, gateway_key_name: str | None) -> dict:
    from django.db import connection
    from django.db.models import Count, Sum
    from django.utils import timezone

    from metering import services as metering
    from metering.models import UsageRecord
    from scheduling.cycle import run_cycle
    from scheduling.models import Binding, Job
    from scheduling.tests.test_concurrency import invariant_violations

    connection.close()
    run_cycle()  # let the last submissions meet one cycle, as the loop would a moment later
    out: dict = {}
    out["scheduler_violations"] = invariant_violations()
    names = stats.submitted
    counts = dict(Job.objects.filter(name__in=names).values_list("name").annotate(n=Count("id")))
    out["submissions"] = len(names)
    out["submissions_missing"] = sorted(set(names) - set(counts))[:20]
    out["submissions_duplicated"] = sorted(n for n, c in counts.items() if c != 1)[:20]
    out["cancelled_but_active"] = list(Job.objects.filter(pk__in=stats.cancelled, state__in=("admitted", "running"))
                                       .values_list("pk", flat=True))
    # the ledger equals the exact card-seconds of the bindings (accrued over their whole life)
    until = timezone.now()
    bindings = list(Binding.objects.filter(start__lte=until).select_related("accelerator"))
    since = min((b.start for b in bindings), default=until)
    metering.accrue(until=until, since=since)
    expected = sum(metering.binding_mcs(b, until) for b in bindings)
    ledger = UsageRecord.objects.filter(hour__lt=until).aggregate(s=Sum("milli_card_seconds"))["s"] or 0
    out["metering_expected_mcs"], out["metering_ledger_mcs"] = expected, ledger
    out["metering_equal"] = expected == ledger
    if gateway_key_name:
        from serving.models import GatewayRequest

        recorded = GatewayRequest.objects.filter(api_key__name=gateway_key_name, time__gte=started_at).count()
        out["gateway_ok"], out["gateway_recorded"] = stats.gateway_ok, recorded
        out["gateway_equal"] = recorded == stats.gateway_ok
    out["hold"] = (not out["scheduler_violations"] and not out["submissions_missing"]
                   and not out["submissions_duplicated"] and not out["cancelled_but_active"] and out["metering_equal"]
                   and out.get("gateway_equal", True))
    return out


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--workers", type=int, default=3, help="gunicorn worker processes")
    ap.add_argument("--threads", type=int, default=4, help="threads per gunicorn worker")
    ap.add_argument("--database-url", default="postgres://postgres@127.0.0.1:5432/atrium_load")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    ap.add_argument("--no-seed", action="store_true", help="the database is already migrated and seeded")
    args = ap.parse_args()

    env = {**os.environ, "DATABASE_URL": args.database_url, "REDIS_URL": args.redis_url, "DEBUG": "0",
           "DJANGO_SETTINGS_MODULE": "portal.settings", "ATRIUM_TESTING": "1", "LOG_LEVEL": "WARNING",
           "SECRET_KEY": os.environ.get("SECRET_KEY") or "bench-only-secret-key-0123456789abcdef-not-production",
           "SECURE_SSL_REDIRECT": "0", "SESSION_COOKIE_SECURE": "0", "CSRF_COOKIE_SECURE": "0",
           "SECURE_HSTS_SECONDS": "0", "ATRIUM_SCHEDULER_PERIOD": "2", "ATRIUM_API_RATE_LIMIT": "100000/60"}
    ensure_database(args.database_url)
    manage = [sys.executable, str(ROOT / "manage.py")]
    if not args.no_seed:
        t0 = time.monotonic()
        subprocess.run([*manage, "migrate", "--verbosity", "0"], env=env, cwd=ROOT, check=True)
        subprocess.run([*manage, "seed_demo"], env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        print(f"migrated and seeded in {time.monotonic() - t0:.0f}s")
    setup_django(env)
    import redis
    from django.utils import timezone

    redis.Redis.from_url(args.redis_url).flushdb()  # our own Redis DB: stale jobs of an earlier run
    options = plans()
    gateway = None
    procs: list[subprocess.Popen] = []
    try:
        from portal.management.commands.seed_demo import DEMO_UPSTREAM

        up_port = urlsplit(DEMO_UPSTREAM).port
        if port_free(up_port):
            procs.append(subprocess.Popen([sys.executable, "-m", "serving.upstream", "--port", str(up_port)],
                                          cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            gateway = gateway_key()
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "portal.wsgi:application", "-b", f"127.0.0.1:{port}",
             "-w", str(args.workers), "--threads", str(args.threads), "--timeout", "60"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL))
        procs.append(subprocess.Popen([*manage, "rqworker", "scheduling", "metering", "reports", "default",
                                       "--worker-class", "rq.worker.SimpleWorker", "--verbosity", "0"],
                                      cwd=ROOT, env=env, stdout=subprocess.DEVNULL))
        procs.append(subprocess.Popen([*manage, "run_scheduler"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL))
        wait_http(base + "/healthz")
        stats, stop = Stats(), threading.Event()
        people = []
        for i in range(args.users):
            username = SUBMITTERS[i % len(SUBMITTERS)]
            people.append(threading.Thread(target=person, daemon=True, args=(
                base, username, options.get(username), gateway, stats, stop, i)))
        started_at = timezone.now()
        t0 = time.monotonic()
        for p in people:
            p.start()
            time.sleep(0.05)  # a ramp, not a thundering herd of sign-ins
        time.sleep(max(0.0, args.seconds - (time.monotonic() - t0)))
        stop.set()
        for p in people:
            p.join(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    checks = invariants(stats, started_at, "bench-load" if gateway else None)
    total = sum(len(v) for v in stats.latency.values())
    pages = {label: {"count": len(v), "p50_ms": round(percentile(v, 50), 1), "p95_ms": round(percentile(v, 95), 1),
                     "p99_ms": round(percentile(v, 99), 1), "mean_ms": round(statistics.fmean(v) * 1000, 1)}
             for label, v in sorted(stats.latency.items())}
    dash = pages.get("GET / (dashboard)", {}).get("p95_ms", 0.0)
    result = {
        "benchmark": "load", "users": args.users, "seconds": round(elapsed, 1),
        "gunicorn": f"{args.workers}x{args.threads}", "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "requests": total, "requests_per_s": round(total / elapsed, 1), "errors": len(stats.errors),
        "error_samples": stats.errors[:20], "gateway": bool(gateway), "pages": pages,
        "dashboard_p95_ms": dash, "dashboard_p95_target_ms": DASHBOARD_P95_TARGET_MS,
        "dashboard_p95_ok": dash <= DASHBOARD_P95_TARGET_MS, "invariants": checks,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{args.users} users, {elapsed:.0f}s: {total} requests, {total / elapsed:.1f} req/s, "
          f"{len(stats.errors)} errors")
    for label, row in pages.items():
        print(f"  {label:38} n={row['count']:5}  p50 {row['p50_ms']:7.1f}  p95 {row['p95_ms']:7.1f}  "
              f"p99 {row['p99_ms']:7.1f} ms")
    print("invariants hold" if checks["hold"] else f"INVARIANTS BROKEN: {json.dumps(checks, default=str)[:2000]}")
    print(f"-> {RESULTS.relative_to(ROOT)}")
    if stats.errors or not checks["hold"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Load benchmark (issue 10): 200 people of 20 tenants on one Atrium for 5 minutes — gunicorn,
PostgreSQL, Redis, a worker and the scheduler loop, all real processes on loopback — then the
invariants the platform promises.

Data: the demo organisation (`seed_demo`) grown by `seed_load` to 20 tenants of ten people
each (a tenant admin, a finance viewer, eight project users; quotas that admit some jobs and
hold others; a published model service per tenant on the demo model server), in the
benchmark's own database. It never touches another database or Redis DB than the ones given.

Each person is a thread with its own `requests` session, signed in with the form and its CSRF
token, and behaves like someone at a browser: an action every 3-10 s (uniform, locust's
`between(3, 10)`), and meanwhile the open page polls exactly as its htmx attributes say (read
from the served HTML: the dashboard's alarms/quota/queue panels every 10 s and usage every
60 s, the job list and a job's page every 5 s, the latter stopping on 286). Users browse the
dashboard and the job list, open jobs, submit (the form, its two htmx re-renders as they pick
a project and a spec, the POST, the job's page), cancel some of their jobs from the job's page
and call the gateway with their tenant's API key; tenant admins browse the dashboard, the job
list and jobs; finance viewers keep the dashboard open and reload it now and then. People start
over a ramp (20 s). Static files are not fetched: with hashed names and far-future caching a
returning browser does not ask for them. Before anything is measured every gunicorn worker is
warmed up (Django loads its URLconf and compiles templates lazily, seconds per process). The
settings are the test ones (ATRIUM_TESTING=1): its fast password hasher makes the ramp's 200
sign-ins far cheaper than production PBKDF2 would.

Reported: requests/s, p50/p95/p99 per page and endpoint, errors (every answer must be the
expected status; must be 0), the dashboard's p95 against 300 ms, and the CPU the generator
itself used (so a reader can see it is not what saturates the machine), next to gunicorn's and
the machine's. Then the invariants: no quota exceeded and no card over-committed (the
scheduler's checker), every submission stored exactly once, no cancelled job holding cards,
the usage ledger equal to the exact sum of the bindings, one metered gateway record per
successful gateway call. Writes bench/results/load.json. A measurement, not a timed test.

    .venv/bin/python bench/load.py                                   # the issue's size: 200 users, 20 tenants, 300 s
    .venv/bin/python bench/load.py --users 40 --tenants 4 --seconds 40   # a smoke run
"""

from __future__ import annotations

import argparse
import html
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
from collections import Counter, defaultdict
from pathlib import Path
from urllib.parse import urlsplit

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "load.json"
DASHBOARD = "GET / (dashboard)"
DASHBOARD_P95_TARGET_MS = 300.0
PEOPLE_PER_TENANT = 10
# what each kind of person does next, with weights; a step the person cannot take (no own
# job to cancel, no submit options) falls back to the job list
ACTIONS = {
    "user": [("dashboard", 25), ("job_list", 25), ("job_detail", 10), ("submit", 20), ("cancel", 8), ("gateway", 12)],
    "admin": [("dashboard", 40), ("job_list", 35), ("job_detail", 25)],
    "finance": [("dashboard", 50), ("read", 50)],  # "read": no request, the open dashboard keeps polling
}
POLL_TAG = re.compile(r"<[^>]*\bhx-trigger=\"every (\d+(?:\.\d+)?)s\"[^>]*>")
HX_GET = re.compile(r"\bhx-get=\"([^\"]+)\"")
JOB_LINK = re.compile(r"/scheduling/jobs/(\d+)/")


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


# --- CPU accounting (Linux /proc): the generator, the server processes, the whole machine ------


def _proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _descendants(root: int) -> list[int]:
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(child for child, p in parent.items() if p == pid)
    return out


def tree_cpu(root: int) -> float:
    return sum(_proc_cpu(pid) for pid in _descendants(root))


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(ticks) / os.sysconf("SC_CLK_TCK")
    return total - (ticks[3] + ticks[4]) / os.sysconf("SC_CLK_TCK"), total  # minus idle and iowait


# --- who takes part, and what each may submit (read once, in this process, through the services) --


def people(tenants: int, users: int) -> list[tuple[str, str, str]]:
    """(username, kind, tenant) of `users` people spread evenly over the tenants; within a
    tenant the order is a user, the admin, a user, the finance viewer, then the other users."""
    from portal.management.commands.seed_load import people_of, tenant_slugs

    per_tenant = []
    for slug in tenant_slugs(tenants):
        everyone = people_of(slug)
        users_ = [p for p in everyone if p[1] == "user"]
        admin = [p for p in everyone if p[1] == "admin"]
        finance = [p for p in everyone if p[1] == "finance"]
        per_tenant.append([(name, kind, slug) for name, kind in [users_[0], *admin, users_[1], *finance, *users_[2:]]])
    out = []
    for i in range(users):
        out.append(per_tenant[i % len(per_tenant)][i // len(per_tenant)])
    return out


def plans(usernames: list[str]) -> dict:
    from django.contrib.auth import get_user_model

    from scheduling import services as sched
    from tenants import access
    from tenants.models import Project

    out = {}
    for user in get_user_model().objects.filter(username__in=usernames):
        options = []
        projects = Project.objects.filter(pk__in=access.project_ids(user, "submit_job"), archived__isnull=True,
                                          tenant__state="active")
        for project in projects:
            specs = [s for s in sched.allowed_specs(project) if s.mode != "whole" or s.gpu_count <= 2]
            prios = [p for p in sched.allowed_priority_classes(user, project) if p.preemptible] or list(
                sched.allowed_priority_classes(user, project))
            for spec in specs:
                for prio in prios[:2]:
                    options.append({"project": project.pk, "spec": spec.pk, "priority_class": prio.pk})
        if options:
            out[user.username] = options
    return out


KEY_NAME = "bench-load"


def gateway_keys(tenants: list[str]) -> dict[str, tuple[str, str]]:
    """{tenant slug: (model slug, secret)}: a fresh key per tenant for its published service,
    made (and the previous run's revoked) through the services by the tenant's admin."""
    from django.contrib.auth import get_user_model

    from portal import context
    from serving import services as svc
    from serving.models import ApiKey, ModelService, ServiceStatus

    out = {}
    with context.bound(actor_label="bench:load"):
        for slug in tenants:
            service = (ModelService.objects.filter(tenant__slug=slug, status=ServiceStatus.PUBLISHED)
                       .select_related("project").order_by("slug").first())
            holder = get_user_model().objects.filter(username=f"{slug}-admin").first()
            if service is None or holder is None:
                continue
            for old in ApiKey.objects.filter(project=service.project, name=KEY_NAME, revoked__isnull=True):
                svc.revoke_api_key(holder, old, reason="a new load run")
            _key, secret = svc.create_api_key(holder, project=service.project, name=KEY_NAME, services=[service],
                                              requests_per_minute=100_000, tokens_per_minute=10_000_000)
            out[slug] = (service.slug, secret)
    return out


# --- the simulated people ---------------------------------------------------------------------


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.samples: list[tuple[float, str, float]] = []  # (monotonic end, label, seconds)
        self.errors: list[str] = []
        self.submitted: list[str] = []
        self.cancelled: list[int] = []
        self.gateway_ok = 0

    def add(self, label: str, seconds: float, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.samples.append((time.monotonic(), label, seconds))
            if not ok:
                self.errors.append(f"{label}: {detail}"[:300])


class Poll:
    __slots__ = ("due", "every", "label", "url")

    def __init__(self, url: str, every: float, label: str, now: float):
        self.url, self.every, self.label, self.due = url, every, label, now + every


class Person:
    """One person at one browser tab: the open page's polls run between the person's actions."""

    def __init__(self, base: str, username: str, kind: str, password: str, options: list[dict] | None,
                 gateway: tuple[str, str] | None, stats: Stats, stop: threading.Event, seed: int,
                 think: tuple[float, float]):
        self.base, self.username, self.kind, self.password = base, username, kind, password
        self.options, self.gateway, self.stats, self.stop = options, gateway, stats, stop
        self.rng = random.Random(seed)  # nosec B311 # a reproducible simulated person, not a secret
        self.think = think
        self.s = requests.Session()
        self.s.headers["Referer"] = base + "/"
        self.api = requests.Session()  # the person's script calling the gateway, as an SDK would
        self.polls: list[Poll] = []
        self.page = "/"
        self.mine: list[int] = []  # own jobs that may still be cancelled
        self.seen: list[int] = []  # jobs seen in lists, to open
        self.steps: list = []  # the rest of a multi-step flow (submit, cancel)

    # --- HTTP, timed --------------------------------------------------------------------------
    def call(self, label: str, method: str, path: str, expect: tuple[int, ...], session=None, **kw):
        t0 = time.perf_counter()
        try:
            r = (session or self.s).request(method, self.base + path, timeout=30, allow_redirects=False, **kw)
        except requests.RequestException as exc:
            self.stats.add(label, time.perf_counter() - t0, False, repr(exc))
            return None
        ok = r.status_code in expect
        self.stats.add(label, time.perf_counter() - t0, ok, f"{r.status_code} {method} {path}")
        return r if ok else None

    def csrf(self) -> str:
        return self.s.cookies.get("csrftoken", "")

    def htmx(self) -> dict:
        return {"HX-Request": "true", "HX-Current-URL": self.base + self.page}

    def open(self, label: str, path: str, poll_label: str):
        """Load a page as the browser would, and start the polls its HTML asks for."""
        r = self.call(label, "GET", path, (200,))
        self.polls = []
        self.page = path
        if r is None:
            return None
        now = time.monotonic()
        for tag in POLL_TAG.finditer(r.text):
            url = HX_GET.search(tag.group(0))
            if url:
                url = html.unescape(url.group(1))
                panel = re.search(r"[?&]panel=(\w+)", url)
                self.polls.append(Poll(url, float(tag.group(1)),
                                       f"poll {poll_label}" + (f" panel={panel.group(1)}" if panel else ""), now))
        self.seen = [int(pk) for pk in JOB_LINK.findall(r.text)][:50] or self.seen
        return r

    def do_poll(self, poll: Poll) -> None:
        r = self.call(poll.label, "GET", poll.url, (200, 286), headers=self.htmx())
        if r is not None and r.status_code == 286:  # htmx: stop polling, it will not change any more
            self.polls.remove(poll)
        else:
            poll.due = time.monotonic() + poll.every

    # --- actions -----------------------------------------------------------------------------
    def sign_in(self) -> bool:
        if self.call("GET /login/", "GET", "/login/", (200,)) is None:
            return False
        r = self.call("POST /login/", "POST", "/login/", (302,), data={
            "username": self.username, "password": self.password, "csrfmiddlewaretoken": self.csrf()})
        return r is not None and self.open(DASHBOARD, r.headers.get("Location", "/"), "/") is not None

    def act(self) -> None:
        if self.steps:
            self.steps.pop(0)()
            return
        action = self.rng.choices([a for a, _ in ACTIONS[self.kind]], [w for _, w in ACTIONS[self.kind]])[0]
        if action == "dashboard":
            self.open(DASHBOARD, "/", "/")
        elif action == "job_detail" and self.seen:
            pk = self.rng.choice(self.seen)
            self.open("GET /scheduling/jobs/<pk>/", f"/scheduling/jobs/{pk}/", "/scheduling/jobs/<pk>/")
        elif action == "submit" and self.options:
            self.submit()
        elif action == "cancel" and self.mine:
            pk = self.mine.pop(self.rng.randrange(len(self.mine)))
            self.open("GET /scheduling/jobs/<pk>/", f"/scheduling/jobs/{pk}/", "/scheduling/jobs/<pk>/")
            self.steps = [lambda: self.cancel(pk)]
        elif action == "gateway" and self.gateway:
            self.call_gateway()
        elif action == "read":
            pass
        else:
            self.open("GET /scheduling/jobs/", "/scheduling/jobs/", "/scheduling/jobs/")

    def submit(self) -> None:
        """The form, then (one think time apart, as a person fills it in) the htmx re-render for
        the chosen project, the one for the chosen spec, and the POST with the job's page."""
        path = "/scheduling/jobs/new/"
        self.open("GET /scheduling/jobs/new/", path, path)
        choice = self.rng.choice(self.options)
        body = {"name": f"load-{uuid.uuid4().hex[:12]}", "image": "busybox", "command": "sleep 1", "replicas": "1",
                "expected_minutes": str(self.rng.randint(1, 30)), "time_limit_minutes": "60"}

        def rerender(field: str, fields: dict) -> None:
            self.call(f"POST /scheduling/jobs/new/ (htmx: {field})", "POST", path, (200,), data={
                **fields, "csrfmiddlewaretoken": self.csrf()}, headers={
                **self.htmx(), "HX-Trigger-Name": field, "HX-Target": "job-form-dependent"})

        def post() -> None:
            r = self.call("POST /scheduling/jobs/new/", "POST", path, (302,), data={
                **body, **choice, "csrfmiddlewaretoken": self.csrf()})
            if r is None:
                return
            with self.stats.lock:
                self.stats.submitted.append(body["name"])
            m = JOB_LINK.search(r.headers.get("Location", ""))
            if m:
                self.mine.append(int(m.group(1)))
                self.open("GET /scheduling/jobs/<pk>/", r.headers["Location"], "/scheduling/jobs/<pk>/")

        self.steps = [lambda: rerender("project", {**body, "project": choice["project"]}),
                      lambda: rerender("spec", {**body, "project": choice["project"], "spec": choice["spec"]}),
                      post]

    def cancel(self, pk: int) -> None:
        path = f"/scheduling/jobs/{pk}/"
        r = self.call("POST /scheduling/jobs/<pk>/cancel/", "POST", path + "cancel/", (302,), data={
            "confirm": "on", "reason": "load test", "csrfmiddlewaretoken": self.csrf()})
        if r is not None:
            with self.stats.lock:
                self.stats.cancelled.append(pk)
            self.open("GET /scheduling/jobs/<pk>/", path, "/scheduling/jobs/<pk>/")

    def call_gateway(self) -> None:
        model, secret = self.gateway
        r = self.call("POST /v1/chat/completions", "POST", "/v1/chat/completions", (200,), session=self.api, json={
            "model": model, "messages": [{"role": "user", "content": "how many cards are free"}], "max_tokens": 16},
            headers={"Authorization": f"Bearer {secret}"})
        if r is not None:
            with self.stats.lock:
                self.stats.gateway_ok += 1

    # --- the person's time -------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.live()
        finally:  # no idle keep-alive connection left for gunicorn's graceful stop to wait on
            self.s.close()
            self.api.close()

    def live(self) -> None:
        if not self.sign_in():
            return
        next_action = time.monotonic() + self.rng.uniform(*self.think)
        while not self.stop.is_set():
            poll = min(self.polls, key=lambda p: p.due, default=None)
            due = min(next_action, poll.due) if poll else next_action
            if self.stop.wait(max(0.0, due - time.monotonic())):
                return
            if poll is not None and poll.due <= next_action:
                self.do_poll(poll)
            else:
                self.act()
                next_action = time.monotonic() + self.rng.uniform(*self.think)


def warm_up(base: str, username: str, password: str, parallel: int, limit: float = 60) -> float:
    """Bring every gunicorn worker past its first requests (Django imports the URLconf and
    compiles templates lazily, seconds per process) before anything is measured: at least two
    rounds of `parallel` concurrent requests to each of the sign-in page and the signed-in
    pages, more until a round's slowest answer is under a second or `limit` seconds have
    passed (a busy machine). Returns the seconds it took; nothing here is counted."""
    from concurrent.futures import ThreadPoolExecutor

    s = requests.Session()
    s.get(base + "/login/", timeout=120)
    s.post(base + "/login/", data={"username": username, "password": password,
                                   "csrfmiddlewaretoken": s.cookies.get("csrftoken", "")}, timeout=120)
    paths = ["/login/", "/", "/scheduling/jobs/", "/scheduling/jobs/new/"]

    def get(i: int) -> float:
        t = time.perf_counter()
        path = paths[i % len(paths)]
        try:
            (requests if path == "/login/" else s).get(base + path, timeout=120)
        except requests.RequestException:
            return float("inf")
        return time.perf_counter() - t

    t0 = time.monotonic()
    with ThreadPoolExecutor(parallel) as pool:
        rounds, slowest = 0, float("inf")
        while rounds < 2 or (time.monotonic() - t0 < limit and slowest >= 1.0):
            slowest = max(pool.map(get, range(parallel * len(paths))))
            rounds += 1
    s.close()
    return time.monotonic() - t0


# --- afterwards ---------------------------------------------------------------------------------


def invariants(stats: Stats, started_at, gateway_used: bool) -> dict:
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
    # where the load's jobs ended up, per tenant: quotas admit some and hold the others
    rows = list(Job.objects.filter(name__in=names).values_list("tenant__slug", "state", "wait_reason"))
    out["tenants_submitting"] = len({t for t, _s, _w in rows})
    out["job_states"] = dict(Counter(s for _t, s, _w in rows))
    out["wait_reasons"] = dict(Counter(w for _t, s, w in rows if s == "pending"))
    # the ledger equals the exact card-seconds of the bindings (accrued over their whole life)
    until = timezone.now()
    bindings = list(Binding.objects.filter(start__lte=until).select_related("accelerator"))
    since = min((b.start for b in bindings), default=until)
    metering.accrue(until=until, since=since)
    expected = sum(metering.binding_mcs(b, until) for b in bindings)
    ledger = UsageRecord.objects.filter(hour__lt=until).aggregate(s=Sum("milli_card_seconds"))["s"] or 0
    out["metering_expected_mcs"], out["metering_ledger_mcs"] = expected, ledger
    out["metering_equal"] = expected == ledger
    if gateway_used:
        from serving.models import GatewayRequest

        recorded = GatewayRequest.objects.filter(api_key__name=KEY_NAME, time__gte=started_at).count()
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
    cpus = os.cpu_count() or 2
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--tenants", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=300, help="from the first sign-in to the stop, ramp included")
    ap.add_argument("--ramp", type=float, default=20, help="seconds over which people start")
    ap.add_argument("--think", type=float, nargs=2, default=(3.0, 10.0), metavar=("MIN", "MAX"),
                    help="seconds between a person's actions (uniform)")
    # Django is CPU-bound under the GIL: processes give the parallelism, two threads per process
    # keep a worker busy while one request waits on PostgreSQL or the model server
    ap.add_argument("--workers", type=int, default=2 * cpus, help="gunicorn worker processes (default 2 x cores)")
    ap.add_argument("--threads", type=int, default=2, help="threads per gunicorn worker")
    ap.add_argument("--database-url", default="postgres://postgres@127.0.0.1:5432/atrium_load")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    ap.add_argument("--no-seed", action="store_true", help="the database is already migrated and seeded")
    args = ap.parse_args()
    if args.users > PEOPLE_PER_TENANT * args.tenants:
        ap.error(f"{args.tenants} tenants have {PEOPLE_PER_TENANT * args.tenants} people; raise --tenants")

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
        subprocess.run([*manage, "seed_load", "--tenants", str(args.tenants)], env=env, cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        # planner statistics, as autovacuum would gather them soon after a load (it may be off)
        import psycopg

        with psycopg.connect(args.database_url, autocommit=True) as conn:
            conn.execute("ANALYZE")
        print(f"migrated and seeded in {time.monotonic() - t0:.0f}s")
    setup_django(env)
    import redis
    from django.utils import timezone

    from portal.management.commands.seed_demo import DEMO_PASSWORD, DEMO_UPSTREAM
    from portal.management.commands.seed_load import tenant_slugs

    redis.Redis.from_url(args.redis_url).flushdb()  # our own Redis DB: stale jobs of an earlier run
    crowd = people(args.tenants, args.users)
    options = plans([name for name, kind, _t in crowd if kind == "user"])
    keys: dict = {}
    procs: dict[str, subprocess.Popen] = {}
    try:
        up_port = urlsplit(DEMO_UPSTREAM).port
        if port_free(up_port):
            procs["model server"] = subprocess.Popen(
                [sys.executable, "-m", "serving.upstream", "--port", str(up_port)], cwd=ROOT, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:  # ours, or a demo model server already running there (`make run`): it serves any model
            wait_http(DEMO_UPSTREAM + "/models", timeout=15)
            keys = gateway_keys(tenant_slugs(args.tenants))
        except SystemExit:
            print(f"no model server at {DEMO_UPSTREAM}: no gateway calls in this run")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        # keep-alive above the longest pause between a person's requests (10 s), as the proxy in
        # front of gunicorn would hold a browser's connection
        procs["gunicorn"] = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "portal.wsgi:application", "-b", f"127.0.0.1:{port}",
             "-w", str(args.workers), "--threads", str(args.threads), "--timeout", "60", "--keep-alive", "15",
             "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        procs["worker"] = subprocess.Popen(
            [*manage, "rqworker", "scheduling", "metering", "reports", "default",
             "--worker-class", "rq.worker.SimpleWorker", "--verbosity", "0"], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL)
        procs["scheduler loop"] = subprocess.Popen([*manage, "run_scheduler"], cwd=ROOT, env=env,
                                                   stdout=subprocess.DEVNULL)
        wait_http(base + "/healthz")
        warm_name = next((name for name, kind, _t in crowd if kind == "user"), crowd[0][0])
        print(f"workers warmed up in {warm_up(base, warm_name, DEMO_PASSWORD, args.workers * args.threads):.0f}s")
        stats, stop = Stats(), threading.Event()
        threads = [threading.Thread(target=Person(
            base, name, kind, DEMO_PASSWORD, options.get(name), keys.get(tenant) if kind == "user" else None, stats,
            stop, i, tuple(args.think)).run, daemon=True, name=name) for i, (name, kind, tenant) in enumerate(crowd)]
        started_at = timezone.now()
        cpu0 = {label: tree_cpu(p.pid) for label, p in procs.items()}
        gen0, (busy0, total0) = time.process_time(), machine_busy()
        t0 = time.monotonic()
        for i, thread in enumerate(threads):
            thread.start()
            time.sleep(max(0.0, t0 + args.ramp * (i + 1) / len(threads) - time.monotonic()))
        ramped = time.monotonic()
        time.sleep(max(0.0, args.seconds - (time.monotonic() - t0)))
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        elapsed = time.monotonic() - t0
        gen_cpu = time.process_time() - gen0
        busy1, total1 = machine_busy()
        server_cpu = {label: round(tree_cpu(p.pid) - cpu0[label], 1) for label, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    checks = invariants(stats, started_at, bool(keys))
    by_label: dict[str, list[float]] = defaultdict(list)
    for _t, label, seconds in stats.samples:
        by_label[label].append(seconds)
    total = len(stats.samples)
    steady = sum(1 for t, _l, _s in stats.samples if t >= ramped)
    pages = {label: {"count": len(v), "per_s": round(len(v) / elapsed, 2), "p50_ms": round(percentile(v, 50), 1),
                     "p95_ms": round(percentile(v, 95), 1), "p99_ms": round(percentile(v, 99), 1),
                     "mean_ms": round(statistics.fmean(v) * 1000, 1)}
             for label, v in sorted(by_label.items())}
    dash = pages.get(DASHBOARD, {}).get("p95_ms", 0.0)
    wall_cores = elapsed * cpus
    cpu = {"generator_s": round(gen_cpu, 1), "generator_pct_of_one_core": round(100 * gen_cpu / elapsed, 1),
           "generator_ms_per_request": round(1000 * gen_cpu / max(1, total), 2),
           "processes_s": server_cpu,
           "machine_busy_pct": round(100 * (busy1 - busy0) / max(1e-9, total1 - total0), 1),
           "note": f"CPU seconds over {elapsed:.0f} s wall on {cpus} cores ({wall_cores:.0f} core-seconds); "
                   "PostgreSQL and Redis are in the machine figure only, as are other users of the machine"}
    result = {
        "benchmark": "load", "users": args.users, "tenants": args.tenants, "seconds": round(elapsed, 1),
        "ramp_s": args.ramp, "think_s": list(args.think), "people": dict(Counter(k for _n, k, _t in crowd)),
        "gunicorn": f"{args.workers} workers x {args.threads} threads", "machine": f"{platform.machine()} {cpus} cpus",
        "requests": total, "requests_per_s": round(total / elapsed, 1),
        "requests_per_s_after_ramp": round(steady / max(1e-9, elapsed - (ramped - t0)), 1),
        "errors": len(stats.errors), "error_samples": stats.errors[:20], "gateway_tenants": len(keys),
        "pages": pages, "dashboard_p95_ms": dash, "dashboard_p95_target_ms": DASHBOARD_P95_TARGET_MS,
        "dashboard_p95_ok": dash <= DASHBOARD_P95_TARGET_MS, "cpu": cpu, "invariants": checks,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"{args.users} users of {args.tenants} tenants, {elapsed:.0f}s (ramp {args.ramp:.0f}s, think "
          f"{args.think[0]:g}-{args.think[1]:g}s), gunicorn {result['gunicorn']}: {total} requests, "
          f"{result['requests_per_s']} req/s ({result['requests_per_s_after_ramp']} after the ramp), "
          f"{len(stats.errors)} errors")
    for label, row in pages.items():
        print(f"  {label:48} n={row['count']:5}  p50 {row['p50_ms']:7.1f}  p95 {row['p95_ms']:7.1f}  "
              f"p99 {row['p99_ms']:7.1f} ms")
    print(f"dashboard p95 {dash:.1f} ms: {'within' if result['dashboard_p95_ok'] else 'OVER'} the "
          f"{DASHBOARD_P95_TARGET_MS:.0f} ms target")
    print(f"CPU: generator {cpu['generator_s']} s ({cpu['generator_pct_of_one_core']} % of one core, "
          f"{cpu['generator_ms_per_request']} ms/request); "
          + ", ".join(f"{k} {v} s" for k, v in server_cpu.items())
          + f"; machine {cpu['machine_busy_pct']} % busy of {cpus} cores")
    print(f"load's jobs: {checks['job_states']} in {checks['tenants_submitting']} tenants; "
          f"waiting for {checks['wait_reasons']}")
    print("invariants hold" if checks["hold"] else f"INVARIANTS BROKEN: {json.dumps(checks, default=str)[:2000]}")
    for sample in stats.errors[:5]:
        print(f"  error: {sample}")
    print(f"-> {RESULTS.relative_to(ROOT)}")
    if stats.errors or not checks["hold"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

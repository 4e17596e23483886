"""Fault tests: real processes stopped, restarted and killed while Atrium works.

* Redis: a private redis-server (its own free port; the machine's Redis on 6379 is never
  touched) is stopped with SIGTERM and started again. Pages keep rendering with the "Background
  work is paused" banner, a submission is stored, and one round of the scheduler loop after
  Redis returns schedules it. A frozen (SIGSTOP) Redis costs a page at most the probe timeout.
* PostgreSQL: a private cluster (initdb in a temporary directory, a free port) serves a real
  gunicorn process under a steady trickle of requests; the cluster is stopped (fast shutdown)
  and started again. Meanwhile every answer is 200 or a 503 with Retry-After (never a 500 or a
  traceback), and afterwards the same gunicorn workers answer 200 again.
  To see this test fail, run it with ATRIUM_FAULTS_SETTINGS=portal.tests.faults_settings_without_resilience
  (the same settings without portal.resilience): the outage then answers 500.
* A real worker process killed with SIGKILL while its scheduling cycle is writing decisions:
  nothing of the cycle is visible afterwards, the invariants hold, the next cycle completes.
  The invariant checker is shown to catch a half-written decision in the same test.
  (Rollup and report crash tests: metering/tests/test_crash.py.)

These tests must never stop, signal or reconfigure a process they did not start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from django.urls import reverse

from conftest import PASSWORD
from portal import resilience

ROOT = Path(settings.BASE_DIR)
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, step: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# --- a private Redis -----------------------------------------------------------------------


class PrivateRedis:
    """A redis-server this test owns: started, stopped with SIGTERM, started again on one port."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.2).ping())
        except redis.RedisError:
            return False

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(self.answers, 10, what="the private redis-server to answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=10)
        assert not self.answers()


@pytest.fixture
def private_redis(tmp_path):
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)  # in case a test left it frozen
            server.stop()
        resilience.forget_redis_state()


@contextmanager
def queues_on(server: PrivateRedis):
    queues = {name: {**cfg, "URL": server.url(1)} for name, cfg in settings.RQ_QUEUES.items()}
    with override_settings(RQ_QUEUES=queues, REDIS_URL=server.url(1)):
        resilience.forget_redis_state()
        yield
    resilience.forget_redis_state()


def submit_form(org) -> dict:
    return {"project": org.projects["alpha"].pk, "spec": org.specs["h1"].pk, "priority_class": org.prio["batch"].pk,
            "name": "while-redis-is-down", "image": "busybox", "command": "sleep 60", "replicas": 1,
            "expected_minutes": 30, "time_limit_minutes": 60}


@pytest.mark.django_db
def test_redis_stopped_pages_render_with_banner_submissions_stored_and_scheduling_resumes(
        org, client, private_redis, django_capture_on_commit_callbacks, capsys):
    import django_rq
    from rq import SimpleWorker

    from scheduling.models import Job, JobState

    assert client.login(username="alpha-user", password=PASSWORD)
    with queues_on(private_redis):
        page = client.get("/")
        assert page.status_code == 200 and "Background work is paused" not in page.content.decode()

        private_redis.stop()
        resilience.forget_redis_state()
        started = time.monotonic()
        for url in ("/", reverse("scheduling:job_list"), reverse("scheduling:job_create")):
            page = client.get(url)
            assert page.status_code == 200, url
            assert "Background work is paused" in page.content.decode(), url
        assert time.monotonic() - started < 5, "pages must not wait on the dead Redis"

        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            t0 = time.monotonic()
            response = client.post(reverse("scheduling:job_create"), submit_form(org))
            submit_seconds = time.monotonic() - t0
        assert response.status_code == 302, response.content.decode()[:2000]
        assert callbacks, "the submission enqueues its cycle after commit"
        assert submit_seconds < 3, f"a submission waited {submit_seconds:.1f}s on the dead Redis"
        job = Job.objects.get(name="while-redis-is-down")
        assert job.state == JobState.PENDING

        # the periodic loop keeps going while Redis is away (it says so, it does not exit)
        call_command("run_scheduler", "--once")
        assert "Redis unreachable" in capsys.readouterr().err

        private_redis.start()
        resilience.forget_redis_state()
        page = client.get("/")
        assert "Background work is paused" not in page.content.decode()
        # django-rq defers enqueueing to the commit of the (test's) transaction
        with django_capture_on_commit_callbacks(execute=True):
            call_command("run_scheduler", "--once")
        queue = django_rq.get_queue("scheduling")
        assert queue.connection.connection_pool.connection_kwargs["port"] == private_redis.port
        assert queue.count >= 1, "the loop enqueued the cycle once Redis was back"
        SimpleWorker([queue], connection=queue.connection).work(burst=True)
        job.refresh_from_db()
        assert job.state in (JobState.ADMITTED, JobState.RUNNING), (job.state, job.pending_reason)
        assert job.bindings.filter(end__isnull=True).count() == 1
        assert Job.objects.filter(name="while-redis-is-down").count() == 1  # stored once, not lost, not doubled


@pytest.mark.django_db
def test_a_frozen_redis_costs_a_page_at_most_the_probe_timeout_and_is_cached(private_redis):
    with queues_on(private_redis):
        assert resilience.redis_problem() == ""
        private_redis.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
        try:
            resilience.forget_redis_state()
            t0 = time.monotonic()
            problem = resilience.redis_problem()
            first = time.monotonic() - t0
            t0 = time.monotonic()
            for _ in range(200):
                assert resilience.redis_problem() == problem
            cached = time.monotonic() - t0
        finally:
            private_redis.proc.send_signal(signal.SIGCONT)
    assert problem, "a Redis that does not answer is reported"
    assert first < 1.0, f"one probe took {first:.2f}s"
    assert cached < 0.2, f"200 cached checks took {cached:.2f}s"


# --- SIGKILL in the middle of a scheduling cycle ---------------------------------------------

CYCLE_WORKER = """
import django, os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django.setup()
from scheduling.cycle import run_cycle
while True:
    run_cycle()
"""


def _cycle_writer_pid(cur) -> int | None:
    """The backend that holds the cycle lock and has written something in its transaction."""
    from scheduling.cycle import CYCLE_LOCK_KEY

    cur.execute(
        """SELECT a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
           WHERE l.locktype = 'advisory' AND l.granted AND l.objid = %s AND a.backend_xid IS NOT NULL""",
        [CYCLE_LOCK_KEY],
    )
    row = cur.fetchone()
    return row[0] if row else None


def _cycle_lock_held(cur) -> bool:
    from scheduling.cycle import CYCLE_LOCK_KEY

    cur.execute("SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objid = %s", [CYCLE_LOCK_KEY])
    return cur.fetchone() is not None


@pytest.fixture
def crowded_org(org):
    """The org fleet grown to 40 H100 cards and quota for them, and 600 pending jobs, so one
    cycle has seconds of decisions to write."""
    from scheduling import services as sched
    from scheduling.models import Job, JobState

    h100 = org.models["h100"]
    pool = org.nodes[0].pool
    for i in range(8):
        sched.register_node(org.ops, pool=pool, name=f"crowd-{i}", cpu_milli=128_000, memory_mib=1024 * 1024,
                            model=h100, cards=4)
    for slug in ("alpha", "beta"):
        tenant, project = org.tenants[slug], org.projects[slug]
        sched.set_quota(org.admin, tenant=tenant, resource="gpus", accelerator_model=h100, guaranteed=20, limit=40)
        sched.set_quota(org.admin, tenant=tenant, project=project, resource="gpus", accelerator_model=h100,
                        guaranteed=20, limit=40)
    for i in range(600):
        slug = ("alpha", "beta")[i % 2]
        sched.submit_job(org.people[slug]["user"], project=org.projects[slug], spec=org.specs["h1"],
                         priority_class=org.prio["batch"], name=f"crowd-{i}", image="busybox", command=["true"])
    assert Job.objects.filter(state=JobState.PENDING).count() == 600
    return org


@pytest.mark.django_db(transaction=True)
def test_worker_killed_mid_cycle_leaves_no_half_written_decision(crowded_org):
    from scheduling.cycle import run_cycle
    from scheduling.models import Binding, Job, JobEvent, JobState
    from scheduling.tests.test_concurrency import invariant_violations

    events_before = JobEvent.objects.count()
    db = settings.DATABASES["default"]
    env = {**os.environ,
           "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{connection.settings_dict['NAME']}"}
    worker = subprocess.Popen([PYTHON, "-c", CYCLE_WORKER], cwd=ROOT, env=env)
    try:
        with connection.cursor() as cur:
            writer = wait_for(lambda: worker.poll() is None and _cycle_writer_pid(cur), 120, step=0.005,
                              what="the worker's cycle to start writing its decisions")
            time.sleep(0.05)  # well inside the write phase (it lasts seconds for 600 jobs)
            assert _cycle_writer_pid(cur) == writer, "the cycle finished before the kill; make it longer"
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
            # the server notices the dead client and rolls the transaction back
            wait_for(lambda: not _cycle_lock_held(cur), 60, what="PostgreSQL to end the killed cycle's transaction")
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
    assert worker.returncode == -signal.SIGKILL

    # nothing of the killed cycle is visible: every job still pending, no binding, no event
    assert Job.objects.exclude(state=JobState.PENDING).count() == 0
    assert Binding.objects.count() == 0
    assert JobEvent.objects.count() == events_before
    assert invariant_violations() == []

    # the next cycle completes and decides
    outcome = run_cycle()
    assert not outcome.skipped
    admitted = Job.objects.filter(state=JobState.ADMITTED).count()
    assert admitted == 40, admitted  # every card of the fleet's H100 pool, within the raised quotas
    assert invariant_violations() == []

    # and the checker is not vacuous: a half-written decision (admitted, no bindings) is caught
    half = Job.objects.filter(state=JobState.PENDING).first()
    Job.objects.filter(pk=half.pk).update(state=JobState.ADMITTED)
    assert any(f"job {half.pk} admitted holds 0 bindings" in v for v in invariant_violations())


# --- PostgreSQL stopped and started under a real gunicorn ---------------------------------------


class PrivatePostgres:
    """A PostgreSQL cluster this test owns (initdb in a temporary directory, its own port)."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="atrium-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        shutil.chown(self.dir, "postgres", "postgres")

    def _as_postgres(self, *args: str, **kw) -> subprocess.CompletedProcess:
        cmd = list(args) if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--", *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120, **kw)

    def init(self) -> None:
        self._as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                          "--no-sync", "-E", "UTF8", "--locale=C")

    def start(self) -> None:
        opts = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off "
                "-c full_page_writes=off -c synchronous_commit=off")
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w",
                          "-t", "60", "-o", opts, "start")

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-m", mode, "stop")

    def url(self, name: str = "atrium") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{name}"

    def destroy(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def private_postgres():
    if not (PG_BIN / "initdb").exists() or shutil.which("pg_dump") is None:
        pytest.skip("PostgreSQL server binaries are not installed here")
    cluster = PrivatePostgres()
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


def copy_test_database_to(cluster: PrivatePostgres) -> None:
    """The test database's schema and migration rows, plus one signed-in-able user."""
    import psycopg
    from django.contrib.auth.hashers import make_password

    db = settings.DATABASES["default"]
    subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres", "-q", "-c",
                    "CREATE DATABASE atrium"], check=True, timeout=60)
    dump = subprocess.run(["pg_dump", "-h", db["HOST"], "-p", str(db["PORT"] or 5432), "-U", db["USER"],
                           "--no-owner", connection.settings_dict["NAME"]], check=True, capture_output=True,
                          timeout=120)
    subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres", "-q", "-v",
                    "ON_ERROR_STOP=1", "-d", "atrium"], input=dump.stdout, check=True, capture_output=True,
                   timeout=120)
    with psycopg.connect(cluster.url(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, is_staff,"
            " is_active, date_joined) VALUES (%s, false, 'pat', '', '', 'pat@t.test', false, true, now())",
            [make_password(PASSWORD)])


def worker_pids(master: int) -> set[int]:
    children = Path(f"/proc/{master}/task/{master}/children")
    return {int(p) for p in children.read_text().split()} if children.exists() else set()


class Trickle:
    """Threads that request pages in a loop, as a signed-in person (or a script) would."""

    PATHS = ("/", "/scheduling/jobs/", "/api/v1/me")

    def __init__(self, base: str, session, threads: int = 3):
        self.base, self.session, self.threads = base, session, threads
        self.results: list[tuple[float, str, int, dict, str]] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def _run(self, k: int) -> None:
        import requests

        i = k
        while not self.stopping.is_set():
            path = self.PATHS[i % len(self.PATHS)]
            i += 1
            try:
                r = self.session.get(self.base + path, timeout=15, allow_redirects=False)
                row = (time.monotonic(), path, r.status_code, dict(r.headers), r.text[:4000])
            except requests.RequestException as exc:  # the web process itself must never drop a request
                row = (time.monotonic(), path, -1, {}, repr(exc))
            with self.lock:
                self.results.append(row)
            time.sleep(0.05)

    def __enter__(self):
        self.workers = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(self.threads)]
        for w in self.workers:
            w.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for w in self.workers:
            w.join(timeout=20)

    def since(self, t: float) -> list:
        with self.lock:
            return [r for r in self.results if r[0] >= t]


@pytest.mark.django_db
def test_postgresql_restart_under_load_answers_503_with_retry_after_then_recovers(private_postgres):
    import requests

    copy_test_database_to(private_postgres)
    port = free_port()
    env = {**os.environ, "DATABASE_URL": private_postgres.url(), "DEBUG": "0",
           "DJANGO_SETTINGS_MODULE": os.environ.get("ATRIUM_FAULTS_SETTINGS", "portal.settings"),
           "SECURE_SSL_REDIRECT": "0", "SESSION_COOKIE_SECURE": "0", "CSRF_COOKIE_SECURE": "0", "LOG_LEVEL": "ERROR"}
    web = subprocess.Popen([PYTHON, "-m", "gunicorn", "portal.wsgi:application", "--bind", f"127.0.0.1:{port}",
                            "--workers", "2", "--timeout", "60", "--graceful-timeout", "2"],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _get_status(base + "/healthz") == 200, 60, step=0.2, what="gunicorn to answer")
        session = requests.Session()
        session.get(base + "/login/", timeout=10)
        login = session.post(base + "/login/", data={"username": "pat", "password": PASSWORD,
                                                     "csrfmiddlewaretoken": session.cookies["csrftoken"]},
                             headers={"Referer": base + "/login/"}, allow_redirects=False, timeout=10)
        assert login.status_code == 302, login.text[:500]
        workers = worker_pids(web.pid)
        assert len(workers) == 2

        with Trickle(base, session) as load:
            time.sleep(2)
            t_down = time.monotonic()
            private_postgres.stop("fast")  # terminates every connection, as a restart does
            time.sleep(4)
            t_up = time.monotonic()
            private_postgres.start()
            wait_for(lambda: all(r[2] == 200 for r in load.since(time.monotonic() - 1.5))
                     and len(load.since(time.monotonic() - 1.5)) >= 6, 60, step=0.2,
                     what="every page to answer 200 again")
            t_recovered = time.monotonic()
            time.sleep(1.5)
        assert web.poll() is None and worker_pids(web.pid) == workers, "the web process was not restarted"
    finally:
        web.send_signal(signal.SIGTERM)
        try:
            web.wait(timeout=15)
        except subprocess.TimeoutExpired:
            web.kill()
            web.wait(timeout=5)

    rows = load.results
    statuses = {r[2] for r in rows}
    assert statuses <= {200, 503}, f"only 200 or 503 may answer, saw {sorted(statuses)}: " + "; ".join(
        f"{r[1]} {r[2]} {r[4][:200]!r}" for r in rows if r[2] not in (200, 503))[:3000]
    down = [r for r in rows if t_down + 0.5 < r[0] < t_up]
    assert down and all(r[2] == 503 for r in down), "while the database is away every request answers 503"
    assert {r[1] for r in down} == set(Trickle.PATHS)
    for _, path, status, headers, body in rows:
        assert "Traceback" not in body
        if status != 503:
            continue
        assert headers.get("Retry-After", "").isdigit(), (path, headers)
        if path.startswith("/api/"):
            assert headers["Content-Type"].startswith("application/problem+json")
            assert '"status": 503' in body or '"status":503' in body
        else:
            assert "briefly unavailable" in body
    after = [r for r in rows if r[0] >= t_recovered]
    assert after and all(r[2] == 200 for r in after)
    assert any(r[2] == 200 for r in rows if r[0] < t_down), "the pages worked before the outage"


def _get_status(url: str) -> int:
    import requests

    try:
        return requests.get(url, timeout=2).status_code
    except requests.RequestException:
        return -1


# --- what counts as an outage --------------------------------------------------------------------


def _raising(exc):
    def view(request):
        raise exc
    return view


def _db_error(cause):
    from django.db import OperationalError

    try:
        raise OperationalError(str(cause)) from cause
    except OperationalError as err:
        return err


def test_only_connection_level_database_errors_become_503():
    import psycopg.errors
    from django.test import RequestFactory

    rf = RequestFactory()
    outage = _db_error(psycopg.OperationalError("connection refused"))  # no SQLSTATE: could not connect
    shutdown = _db_error(psycopg.errors.AdminShutdown("terminating connection due to administrator command"))
    deadlock = _db_error(psycopg.errors.DeadlockDetected("deadlock detected"))
    for exc, api in ((outage, False), (shutdown, True)):
        request = rf.get("/api/v1/me" if api else "/scheduling/jobs/")
        mw = resilience.DatabaseUnavailableMiddleware(_raising(exc))
        response = mw(request)
        assert response.status_code == 503 and response["Retry-After"] == "5"
        assert response["Content-Type"].startswith("application/problem+json" if api else "text/html")
    # a deadlock is a bug in lock ordering, not an outage: it must stay loud
    with pytest.raises(type(deadlock)):
        resilience.DatabaseUnavailableMiddleware(_raising(deadlock))(rf.get("/"))
    assert resilience.DatabaseUnavailableMiddleware(None).process_exception(rf.get("/"), deadlock) is None

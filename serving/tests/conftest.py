"""Fixtures of the serving tests: a real OpenAI-compatible upstream on loopback and a small
two-tenant serving world (same service name and same distinctive word in both tenants)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from portal.tests.test_faults import _get_status, free_port, wait_for
from serving import authcache, ratelimit, upstream
from serving import services as svc
from tenants import services as tenancy

WORD = "zorblax"


@pytest.fixture(scope="session")
def upstream_server():
    server = upstream.start(model_names=("alpha-llm", "beta-llm"))
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def up(upstream_server):
    upstream_server.stats.reset()
    return upstream_server


@pytest.fixture(autouse=True)
def _clean_rate_limits():
    ratelimit.clear()
    authcache.clear()
    yield


def server_env(**extra) -> dict:
    """The environment of a gateway server process on the test database and Redis."""
    db = connection.settings_dict
    return {**os.environ, "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/"
                                          f"{db['NAME']}",
            "REDIS_URL": settings.REDIS_URL, "DEBUG": "0", "SECURE_SSL_REDIRECT": "0", "LOG_LEVEL": "WARNING",
            "DJANGO_SETTINGS_MODULE": "portal.settings", "SESSION_COOKIE_SECURE": "0", "CSRF_COOKIE_SECURE": "0",
            **extra}


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: str

    def stop(self, timeout: float = 30) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_dataplane(*, workers: int = 2, **env) -> Server:
    """serving.dataplane as production runs it (deploy/k8s/gateway.yaml), on the test database."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="atrium-dataplane-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "serving.dataplane:application", "-k", "serving.dataplane_worker.Worker",
         "-b", f"127.0.0.1:{port}", "-w", str(workers), "--log-level", "warning"],
        cwd=settings.BASE_DIR, env=server_env(**env), stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, log.name)
    try:
        wait_for(lambda: _get_status(f"{server.url}/healthz") == 200, 60, what="the data plane to answer")
    except AssertionError:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def dataplane_server(django_db_setup, django_db_blocker):
    """One data plane (two processes) for the session's tests that use it."""
    server = start_dataplane()
    yield server
    server.stop()
    with open(server.log) as log:
        text = log.read()
    if "Traceback" in text:  # the data plane's own account of a failure, next to the test's
        sys.stderr.write(f"--- data plane log ---\n{text[-20000:]}\n")
    os.unlink(server.log)


@pytest.fixture
def dataplane(dataplane_server, up):
    """The session's data plane for one test, which ends once the data plane has metered what the
    upstream answered: a write arriving after the next test emptied the tables would land there."""
    yield dataplane_server
    from serving.models import GatewayRequest

    wait_for(lambda: GatewayRequest.objects.count() >= up.stats.requests, 15,
             what="the data plane to meter what it answered")


@pytest.fixture(params=["django", "dataplane"])
def gateway_url(request):
    """The gateway over real HTTP: the Django gateway (the test's live server) and the data plane."""
    if request.param == "django":
        return request.getfixturevalue("live_server").url
    return request.getfixturevalue("dataplane").url


class World:
    pass


@pytest.fixture
def world(org, up, make_user):
    """Per tenant: a published project-visible service "chat", a KB with a document holding WORD,
    an application over both, and a key scoped to the service and KB. Plus alpha-q, a second
    project of alpha with its own user and key."""
    w = World()
    w.org, w.up = org, up
    w.service, w.kb, w.app, w.key, w.secret, w.doc = {}, {}, {}, {}, {}, {}
    for slug in ("alpha", "beta"):
        tadmin = org.people[slug]["admin"]
        user = org.people[slug]["user"]
        project = org.projects[slug]
        s = svc.create_model_service(
            tadmin, project=project, slug="chat", name=f"{slug} chat", base_model=f"{slug}-llm",
            spec=org.specs["l4half"], priority_class=org.prio["batch"], upstream_url=up.base_url,
        )
        w.service[slug] = svc.publish_service(tadmin, s)
        kb = svc.create_knowledge_base(tadmin, tenant=org.tenants[slug], slug="handbook", name=f"{slug} handbook",
                                       projects=[project])
        w.kb[slug] = kb
        w.doc[slug] = svc.upload_document(
            user, kb, filename=f"{slug}-policy.md", content_type="text/markdown",
            data=(f"# {slug} policy\n\nThe {WORD} procedure at {slug} requires the {slug}secret approval form.\n\n"
                  f"Unrelated paragraph about lunch menus at {slug}.").encode(),
        )
        w.app[slug] = svc.create_application(user, project=project, slug="helpdesk", name="Helpdesk",
                                             service=w.service[slug], knowledge_bases=[kb],
                                             system_prompt=f"You help {slug} staff.")
        w.key[slug], w.secret[slug] = svc.create_api_key(user, project=project, name=f"{slug} key",
                                                         services=[w.service[slug]], knowledge_bases=[kb])
    # a second project in alpha, with its own user and key (no scope on alpha-p's private service)
    admin = org.admin
    w.q_project = tenancy.create_project(admin, org.tenants["alpha"], slug="alpha-q", name="alpha q",
                                         project_class="research")
    w.q_user = make_user("alpha-q-user")
    tenancy.add_project_member(admin, w.q_project, w.q_user, "user")
    w.q_key, w.q_secret = svc.create_api_key(w.q_user, project=w.q_project, name="q key")
    return w


def chat_body(text: str = "hello there world", model: str = "chat", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def bearer(secret: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {secret}"}


def admin_connection() -> psycopg.Connection:
    """A second session on the test database, beside Django's (autocommit)."""
    params = connection.get_connection_params()
    return psycopg.connect(**{k: v for k, v in params.items() if k in ("host", "port", "user", "password", "dbname")},
                           autocommit=True)

"""Fixtures of the serving tests: a real OpenAI-compatible upstream on loopback and a small
two-tenant serving world (same service name and same distinctive word in both tenants)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection

from serving import ratelimit, upstream
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
    yield


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

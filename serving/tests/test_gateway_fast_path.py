"""The gateway's short path and its hand-written statements: what a request costs (two
statements, no session middleware), what still applies on the short path (Host check,
security headers), metering through one statement that counts a repeated uid once, and a
gateway that recovers by itself from a database connection the server dropped."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from serving import services as svc
from serving.models import GatewayRequest, TokenUsage
from serving.tests.conftest import bearer, chat_body


def post(client, secret, body, **extra):
    return client.post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                       **bearer(secret), **extra)


def test_a_chat_completion_costs_two_statements_and_touches_no_session(world, client):
    w = world
    assert post(client, w.secret["alpha"], chat_body()).status_code == 200  # sets last_used (one more write)
    with CaptureQueriesContext(connection) as queries:
        resp = post(client, w.secret["alpha"], chat_body("two statements please"))
    assert resp.status_code == 200
    key_check, meter = (q["sql"] for q in queries.captured_queries)  # exactly two
    assert key_check.startswith("SELECT") and "serving_apikey" in key_check
    assert meter.startswith("WITH req AS (INSERT INTO serving_gatewayrequest")
    assert "sessionid" not in resp.cookies and "csrftoken" not in resp.cookies
    assert "Cookie" not in resp.get("Vary", "")
    # what the short path still answers with
    assert resp["Content-Security-Policy"] == "default-src 'none'; frame-ancestors 'none'"
    assert resp["X-Frame-Options"] == "DENY"
    assert resp["X-Content-Type-Options"] == "nosniff"
    assert int(resp["Content-Length"]) == len(resp.content)
    assert resp["X-Request-ID"]
    assert resp.json()["model"] == "chat"


def test_the_short_path_still_checks_the_host(world, client):
    resp = post(client, world.secret["alpha"], chat_body(), HTTP_HOST="attacker.example")
    assert resp.status_code == 400
    assert GatewayRequest.objects.count() == 0


def test_an_unknown_v1_path_goes_through_the_whole_chain(world, client):
    resp = client.get("/v1/no-such-endpoint", **bearer(world.secret["alpha"]))
    assert resp.status_code == 404
    assert resp["Content-Security-Policy"] != "default-src 'none'; frame-ancestors 'none'"  # the site's own policy


def test_metering_statement_counts_a_repeated_uid_once(world):
    w = world
    key, service = w.key["alpha"], w.service["alpha"]
    uid = uuid.uuid4()
    assert svc.record_usage(uid=uid, key=key, service=service, endpoint="chat", input_tokens=5, output_tokens=7)
    assert not svc.record_usage(uid=uid, key=key, service=service, endpoint="chat", input_tokens=5, output_tokens=7)
    assert svc.record_usage(uid=uuid.uuid4(), key=key, service=service, endpoint="chat", input_tokens=None,
                            output_tokens=None, note="no usage")
    row = TokenUsage.objects.get(api_key=key, service=service)
    assert (row.requests, row.input_tokens, row.output_tokens, row.unmetered_requests) == (2, 5, 7, 1)
    assert GatewayRequest.objects.filter(api_key=key).count() == 2
    assert GatewayRequest.objects.get(uid=uid).metered


@pytest.mark.django_db(transaction=True)
def test_key_check_reconnects_when_the_server_dropped_the_connection(world):
    """Without Django's per-request SELECT 1, the key check itself finds a dead persistent
    connection and reads again on a new one: the caller gets its answer, never a 503."""
    w = world
    assert svc.authenticate_key(w.secret["alpha"], service="chat").service_in_scope
    old_pid = connection.connection.info.backend_pid
    connection.health_check_done = False  # as at the start of each request (django.db.close_old_connections)
    params = connection.get_connection_params()
    with psycopg.connect(**{k: v for k, v in params.items() if k in ("host", "port", "user", "password", "dbname")},
                         autocommit=True) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", [old_pid]).fetchone()[0]
    caller = svc.authenticate_key(w.secret["alpha"], service="chat")
    assert caller.service == w.service["alpha"] and caller.service_in_scope
    assert connection.connection.info.backend_pid != old_pid
    assert svc.record_usage(uid=uuid.uuid4(), key=caller.key, service=caller.service, endpoint="chat",
                            input_tokens=1, output_tokens=1)


@pytest.mark.django_db(transaction=True)
def test_statements_are_prepared_again_on_a_new_connection(world):
    w = world
    key, service = w.key["alpha"], w.service["alpha"]
    assert svc.authenticate_key(w.secret["alpha"], service="chat").service_in_scope
    connection.close()  # a new session: its prepared statements are gone
    caller = svc.authenticate_key(w.secret["alpha"], service="chat")
    assert caller.service == service and caller.key == key and caller.month_tokens is None
    assert svc.record_usage(uid=uuid.uuid4(), key=key, service=service, endpoint="chat", input_tokens=1,
                            output_tokens=2)
    with connection.cursor() as cur:
        cur.execute("SELECT statement FROM pg_prepared_statements")
        statements = [r[0] for r in cur.fetchall()]
    assert sum("serving_apikey k" in st for st in statements) == 1
    assert sum(st.startswith("WITH req AS") for st in statements) == 1

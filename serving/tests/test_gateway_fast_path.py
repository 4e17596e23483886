"""The gateway's short path and its hand-written statements: what a request costs (two
statements, no session middleware), what still applies on the short path (Host check,
security headers), metering through one statement that counts a repeated uid once, once the
answer is written (a failure to meter then is logged, not swallowed), and a gateway that
recovers by itself from a database connection the server dropped."""

from __future__ import annotations

import io
import json
import uuid
from contextlib import contextmanager

import pytest
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, connection
from django.test.utils import CaptureQueriesContext

from serving import services as svc
from serving.gateway import MeteredResponse
from serving.models import GatewayRequest, TokenUsage
from serving.tests.conftest import admin_connection, bearer, chat_body


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


def meter_now(**usage) -> bool:
    """Meter one request on this connection, now; True when it was recorded by this call."""
    u = svc.usage_of(**usage)
    return svc.record_usages([u]) == {u.uid}


def test_metering_statement_counts_a_repeated_uid_once(world):
    w = world
    key, service = w.key["alpha"], w.service["alpha"]
    uid = uuid.uuid4()
    assert meter_now(uid=uid, key=key, service=service, endpoint="chat", input_tokens=5, output_tokens=7)
    assert not meter_now(uid=uid, key=key, service=service, endpoint="chat", input_tokens=5, output_tokens=7)
    assert meter_now(uid=uuid.uuid4(), key=key, service=service, endpoint="chat", input_tokens=None,
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
    with admin_connection() as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", [old_pid]).fetchone()[0]
    caller = svc.authenticate_key(w.secret["alpha"], service="chat")
    assert caller.service == w.service["alpha"] and caller.service_in_scope
    assert connection.connection.info.backend_pid != old_pid
    assert meter_now(uid=uuid.uuid4(), key=caller.key, service=caller.service, endpoint="chat",
                            input_tokens=1, output_tokens=1)


@pytest.mark.django_db(transaction=True)
def test_statements_are_prepared_again_on_a_new_connection(world):
    w = world
    key, service = w.key["alpha"], w.service["alpha"]
    assert svc.authenticate_key(w.secret["alpha"], service="chat").service_in_scope
    connection.close()  # a new session: its prepared statements are gone
    caller = svc.authenticate_key(w.secret["alpha"], service="chat")
    assert caller.service == service and caller.key == key and caller.month_tokens is None
    assert meter_now(uid=uuid.uuid4(), key=key, service=service, endpoint="chat", input_tokens=1,
                            output_tokens=2)
    with connection.cursor() as cur:
        cur.execute("SELECT statement FROM pg_prepared_statements")
        statements = [r[0] for r in cur.fetchall()]
    assert sum("serving_apikey k" in st for st in statements) == 1
    assert sum(st.startswith("WITH req AS") for st in statements) == 1


@contextmanager
def wsgi_server_signals_quiet():
    """As Django's test client does: no connection clean-up per request, which would close the
    test's own transaction."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def test_an_answer_is_metered_when_the_server_closes_it_and_only_once(world):
    """The WSGI contract as a server drives it: call the application, write the body, then
    close() it. The answer is complete before anything is metered; close() meters it once."""
    w = world
    body = json.dumps(chat_body("metered after the answer")).encode()
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/v1/chat/completions", "SCRIPT_NAME": "", "QUERY_STRING": "",
               "SERVER_NAME": "testserver", "SERVER_PORT": "80", "HTTP_HOST": "testserver",
               "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(body),
               "wsgi.errors": io.StringIO(), "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": "application/json",
               "HTTP_AUTHORIZATION": f"Bearer {w.secret['alpha']}", "REMOTE_ADDR": "127.0.0.1"}
    statuses = []
    with wsgi_server_signals_quiet():
        result = get_wsgi_application()(environ, lambda status, headers, exc_info=None: statuses.append(status))
        answer = json.loads(b"".join(result))
        assert statuses == ["200 OK"] and answer["usage"]["completion_tokens"] > 0
        assert GatewayRequest.objects.count() == 0  # written, not yet closed: nothing metered
        result.close()
        result.close()  # a second close() changes nothing
    row = GatewayRequest.objects.get()
    assert (row.input_tokens, row.output_tokens) == (answer["usage"]["prompt_tokens"],
                                                     answer["usage"]["completion_tokens"])
    assert TokenUsage.objects.get().requests == 1


def test_a_metering_failure_after_the_answer_is_logged_with_the_request_id(caplog):
    uid = uuid.uuid4()

    def meter():
        raise RuntimeError("metering store down")

    resp = MeteredResponse({"ok": True}, uid=uid, meter=meter)
    with caplog.at_level("ERROR", logger="atrium.gateway"):
        resp.close()  # Django's close() would have swallowed it silently
    assert resp.closed
    assert [r.getMessage() for r in caplog.records] == [f"gateway request {uid} was answered but could not be metered"]
    assert "metering store down" in caplog.text

"""The data plane (serving.dataplane) as production runs it (gunicorn, uvicorn's worker), on the test database:
what it answers from memory (serving.authcache) and how a change reaches it, the rate limits
and budgets of its own path, the headers Django would have sent, upstream failures, and a
graceful stop that meters every answered request.

A session keeps one connection, so its requests meet one process: a key's first request takes
the Django path, which keeps its check (for a project with a monthly budget only the second
does: the first learns which month counter to read), the next ones are answered from memory."""

from __future__ import annotations

import signal
import time

import pytest
import requests
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from portal.tests.test_faults import wait_for
from serving import authcache, ratelimit
from serving import services as svc
from serving.models import ApiKey, GatewayRequest, ServingAlarm, TokenUsage
from serving.tests.conftest import chat_body, start_dataplane

pytestmark = pytest.mark.django_db(transaction=True)

WARM = 2  # requests of one key on one connection after which it is answered from memory, budget or not


def session(secret: str) -> requests.Session:
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {secret}"
    return s


def chat(s: requests.Session, server, text: str = "hello there world", **extra) -> requests.Response:
    return s.post(f"{server.url}/v1/chat/completions", json=chat_body(text, **extra), timeout=30)


def warm(s, server) -> None:
    assert [chat(s, server).status_code for _ in range(WARM)] == [200] * WARM


def metered(count: int, project=None, tokens: int = 0) -> None:
    """Until `count` requests are in the ledger (and `tokens` in the project's month counter: the
    writer adds them there just after its commit)."""
    wait_for(lambda: GatewayRequest.objects.count() >= count, 10, what=f"{count} requests to be metered")
    if project is not None:
        key = ratelimit.month_key(project.pk, svc.month_start(timezone.now()))
        wait_for(lambda: int(ratelimit.client().get(key) or 0) >= tokens, 10, what="the month counter")


def test_answered_from_memory_until_the_generation_changes(dataplane, world):
    """A revocation written past Django (raw SQL, no signal) is not seen by a key check kept in
    memory (it would be within authcache.TTL); the generation bumped, the next request reads
    the database and is refused. This is also what shows the fast path answered."""
    w = world
    s = session(w.secret["alpha"])
    warm(s, dataplane)
    with connection.cursor() as cur:
        cur.execute(f"UPDATE {ApiKey._meta.db_table} SET revoked = now() WHERE id = %s", [w.key["alpha"].pk])
    assert chat(s, dataplane).status_code == 200  # from memory
    authcache.bump()
    refused = chat(s, dataplane)
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]
    metered(WARM + 1)
    assert GatewayRequest.objects.count() == WARM + 1  # the refused one is not billed


@pytest.mark.parametrize("change", ["revoke", "archive project", "end membership", "retire service", "narrow scope"])
def test_a_change_made_through_atrium_stops_the_key_at_the_next_request_in_every_process(
        dataplane, world, change):
    """New connections spread over both processes; each has the key in memory before the change."""
    w = world
    secret, key, model = w.secret["alpha"], w.key["alpha"], "chat"
    if change == "end membership":  # a key of alpha-q's user, on a service alpha shares with its tenant
        admin = w.org.people["alpha"]["admin"]
        shared = svc.publish_service(admin, svc.create_model_service(
            admin, project=w.org.projects["alpha"], slug="shared", name="s", base_model="alpha-llm",
            spec=w.org.specs["l4half"], priority_class=w.org.prio["batch"], upstream_url=w.up.base_url,
            visibility="tenant"))
        key, secret = svc.create_api_key(w.q_user, project=w.q_project, name="q2", services=[shared])
        model = "shared"

    def fresh():  # a new connection each time: either process may take it
        return requests.post(f"{dataplane.url}/v1/chat/completions", json=chat_body(model=model), timeout=30,
                             headers={"Authorization": f"Bearer {secret}", "Connection": "close"})

    assert [fresh().status_code for _ in range(12)] == [200] * 12
    admin, user = w.org.people["alpha"]["admin"], w.org.people["alpha"]["user"]
    if change == "revoke":
        svc.revoke_api_key(user, key)
    elif change == "archive project":
        from tenants import services as tenancy

        tenancy.archive_project(admin, w.org.projects["alpha"])
    elif change == "end membership":
        from tenants import services as tenancy
        from tenants.models import ProjectMembership

        tenancy.remove_project_member(w.org.admin, ProjectMembership.objects.get(user=w.q_user, project=w.q_project))
    elif change == "retire service":
        svc.retire_service(admin, w.service["alpha"])
    else:
        key.services.remove(w.service["alpha"])
    statuses = {fresh().status_code for _ in range(12)}
    assert statuses and 200 not in statuses, statuses
    assert statuses <= {401, 403, 404}


def test_rate_limit_refused_by_the_fast_path_with_retry_after(dataplane, world):
    w = world
    key, secret = svc.create_api_key(w.org.people["alpha"]["user"], project=w.org.projects["alpha"], name="slow",
                                     services=[w.service["alpha"]], requests_per_minute=WARM + 1)
    s = session(secret)
    answers = [chat(s, dataplane) for _ in range(WARM + 2)]
    assert [a.status_code for a in answers] == [200] * (WARM + 1) + [429]
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert f"{WARM + 1} requests per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    metered(WARM + 1)
    assert GatewayRequest.objects.filter(api_key=key).count() == WARM + 1  # the refused one is not billed


def test_budget_checked_from_memory_counts_what_was_metered_since(dataplane, world):
    """Budget 30, 13 tokens a request: the third request (from memory) still fits (26 used), the
    fourth finds 39: refused, with one alarm, and so is every one after it."""
    w = world
    svc.set_serving_limits(w.org.people["alpha"]["admin"], w.org.projects["alpha"], requests_per_minute=None,
                           tokens_per_minute=None, monthly_token_budget=30)
    s = session(w.secret["alpha"])
    text = "one two three four five six"  # 6 prompt + 7 completion tokens
    for n in range(1, 4):
        assert chat(s, dataplane, text).status_code == 200
        metered(n, w.org.projects["alpha"], 13 * n)
    for _ in range(2):
        refused = chat(s, dataplane, text)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "budget_exceeded"
        assert "39 of 30 tokens" in refused.json()["error"]["message"]
    assert GatewayRequest.objects.count() == 3
    assert ServingAlarm.objects.filter(project=w.org.projects["alpha"], kind="token_budget").count() == 1


def test_fast_path_answers_with_the_headers_django_sends(dataplane, world):
    w = world
    s = session(w.secret["alpha"])
    django_answer = chat(s, dataplane)  # the key's first request: the Django path
    chat(s, dataplane)
    fast = chat(s, dataplane)
    ignored = {"date", "server", "content-length", "x-request-id"}
    assert {h.lower() for h in fast.headers} - ignored == {h.lower() for h in django_answer.headers} - ignored
    for name in ("Content-Security-Policy", "X-Frame-Options", "X-Content-Type-Options", "Referrer-Policy"):
        assert fast.headers[name] == django_answer.headers[name], name
    assert fast.json()["model"] == "chat" and w.up.stats.bodies[-1]["model"] == "alpha-llm"
    mine = s.post(f"{dataplane.url}/v1/chat/completions", json=chat_body(), timeout=30,
                  headers={"X-Request-ID": "trace42"})
    assert mine.headers["X-Request-ID"] == "trace42"
    wait_for(lambda: GatewayRequest.objects.filter(request_id="trace42").exists(), 10, what="the traced request")


def test_upstream_failures_on_the_fast_path_are_mapped_and_not_billed(dataplane, world):
    w = world
    s = session(w.secret["alpha"])
    warm(s, dataplane)
    failed = chat(s, dataplane, "boom [[fail:500]]")
    assert failed.status_code == 502 and failed.json()["error"]["code"] == "upstream_error"
    rejected = chat(s, dataplane, "bad [[fail:400]]")
    assert rejected.status_code == 400 and rejected.json()["error"]["code"] == "upstream_rejected"
    assert "Traceback" not in failed.text + rejected.text
    assert chat(s, dataplane).status_code == 200
    metered(WARM + 1)
    time.sleep(0.2)  # a wrongly billed failure would have been written by now
    assert GatewayRequest.objects.count() == WARM + 1


def test_sigterm_meters_every_answered_request_before_the_process_ends(world, up):
    """With a long gathering pause the answered requests are still queued at SIGTERM; the
    server's shutdown waits for the requests, then the lifespan (and gunicorn's worker_exit)
    drain the writer."""
    w = world
    server = start_dataplane(workers=1, ATRIUM_METER_GATHER_MS="20000")
    try:
        s = session(w.secret["alpha"])
        answers = [chat(s, server, f"question {i}") for i in range(6)]
        assert [a.status_code for a in answers] == [200] * 6
        assert GatewayRequest.objects.count() <= 1  # the first went at once; the rest wait for the pause
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=30)
    finally:
        server.stop()
    agg = TokenUsage.objects.aggregate(i=Sum("input_tokens"), o=Sum("output_tokens"), r=Sum("requests"))
    assert agg["r"] == 6 == GatewayRequest.objects.count()
    assert agg["i"] == sum(a.json()["usage"]["prompt_tokens"] for a in answers)
    assert agg["o"] == sum(a.json()["usage"]["completion_tokens"] for a in answers)
    with open(server.log) as log:
        assert "not metered" not in log.read()

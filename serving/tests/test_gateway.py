"""The gateway over a real upstream on loopback: authorisation matrix over real HTTP, metering
exactly once (also under 200 concurrent requests), limits and budgets, request validation,
upstream failures mapped without leaks, and streaming."""

from __future__ import annotations

import datetime as dt
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import time_machine
from django.db.models import Sum
from django.utils import timezone

from portal.models import AuditEvent
from serving import services as svc
from serving.models import GatewayRequest, ServingAlarm, TokenUsage
from serving.tests.conftest import bearer, chat_body
from tenants import services as tenancy
from tenants.models import ProjectMembership


def post(client, secret, body, path="/v1/chat/completions", **extra):
    headers = bearer(secret) if secret else {}
    return client.post(path, data=json.dumps(body), content_type="application/json", **headers, **extra)


def metered_totals():
    agg = TokenUsage.objects.aggregate(i=Sum("input_tokens"), o=Sum("output_tokens"), r=Sum("requests"))
    return agg["i"] or 0, agg["o"] or 0, agg["r"] or 0


def metered_totals_once_written(requests_answered: int, timeout: float = 10.0):
    """metered_totals() over real HTTP: the server meters a request when it closes the answer,
    just after the client has it, so wait (bounded) until every answered request is counted,
    then read the totals; a request metered twice or never still shows in them."""
    deadline = time.monotonic() + timeout
    while GatewayRequest.objects.count() < requests_answered and time.monotonic() < deadline:
        time.sleep(0.02)
    return metered_totals()


# --- authorisation --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_authorisation_matrix_over_real_http(gateway_url, world):
    """Over both servers: the Django gateway and the data plane (which hands all of these to it)."""
    w = world
    url = f"{gateway_url}/v1/chat/completions"
    beta_only = svc.create_model_service(
        w.org.people["beta"]["admin"], project=w.org.projects["beta"], slug="beta-private", name="bp",
        base_model="beta-llm", spec=w.org.specs["l4half"], priority_class=w.org.prio["batch"], upstream_url=w.up.base_url)
    svc.publish_service(w.org.people["beta"]["admin"], beta_only)
    revoked, revoked_secret = svc.create_api_key(w.org.people["alpha"]["user"], project=w.org.projects["alpha"],
                                                 name="r", services=[w.service["alpha"]])
    svc.revoke_api_key(w.org.people["alpha"]["user"], revoked)
    expiring, expiring_secret = svc.create_api_key(
        w.org.people["alpha"]["user"], project=w.org.projects["alpha"], name="e", services=[w.service["alpha"]],
        expires=timezone.now() + dt.timedelta(seconds=1))
    unscoped, unscoped_secret = svc.create_api_key(w.org.people["alpha"]["user"], project=w.org.projects["alpha"],
                                                   name="u")
    time.sleep(1.1)

    def call(headers, model="chat"):
        return requests.post(url, json=chat_body(model=model), headers=headers, timeout=10)

    cases = [
        ("no key", call({}), 401),
        ("malformed key", call({"Authorization": "Bearer not-a-key"}), 401),
        ("revoked key", call({"Authorization": f"Bearer {revoked_secret}"}), 401),
        ("expired key", call({"Authorization": f"Bearer {expiring_secret}"}), 401),
        ("key of another project", call({"Authorization": f"Bearer {w.q_secret}"}), 404),
        ("key without scope", call({"Authorization": f"Bearer {unscoped_secret}"}), 403),
        ("service of another tenant", call({"Authorization": f"Bearer {w.secret['alpha']}"}, model="beta-private"), 404),
    ]
    for label, resp, status in cases:
        assert resp.status_code == status, (label, resp.status_code, resp.text)
        err = resp.json()["error"]
        assert err["message"] and "type" in err and "code" in err, label
    assert GatewayRequest.objects.count() == 0
    assert TokenUsage.objects.count() == 0
    assert w.up.stats.requests == 0
    # and the good key goes through, to alpha's own "chat" (not beta's service of the same name)
    ok = call({"Authorization": f"Bearer {w.secret['alpha']}"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["model"] == "chat"
    assert w.up.stats.bodies[-1]["model"] == "alpha-llm"


def test_models_lists_only_what_the_key_may_call(world, client):
    w = world
    resp = client.get("/v1/models", **bearer(w.secret["alpha"]))
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == ["chat"]
    assert resp.json()["data"][0]["owned_by"] == "alpha"
    assert client.get("/v1/models", **bearer(w.q_secret)).json()["data"] == []
    assert client.get("/v1/models").status_code == 401


def test_tenant_visible_service_reaches_other_projects_of_the_tenant_only(world, client):
    w = world
    admin = w.org.people["alpha"]["admin"]
    shared = svc.create_model_service(admin, project=w.org.projects["alpha"], slug="shared", name="s",
                                      base_model="alpha-llm", spec=w.org.specs["l4half"],
                                      priority_class=w.org.prio["batch"], upstream_url=w.up.base_url,
                                      visibility="tenant")
    svc.publish_service(admin, shared)
    key, secret = svc.create_api_key(w.q_user, project=w.q_project, name="q2", services=[shared])
    assert post(client, secret, chat_body(model="shared")).status_code == 200
    # beta cannot even name it in a key's scope, and its key gets 404
    with pytest.raises(Exception, match="not available"):
        svc.create_api_key(w.org.people["beta"]["user"], project=w.org.projects["beta"], name="x", services=[shared])
    assert post(client, w.secret["beta"], chat_body(model="shared")).status_code == 404


def test_revoked_key_refused_at_next_request_and_revoke_audited_once(world, client):
    w = world
    assert post(client, w.secret["alpha"], chat_body()).status_code == 200
    svc.revoke_api_key(w.org.people["alpha"]["user"], w.key["alpha"], reason="leaked")
    resp = post(client, w.secret["alpha"], chat_body())
    assert resp.status_code == 401
    assert "revoked" in resp.json()["error"]["message"]
    assert AuditEvent.objects.filter(action="apikey.revoke", target_id=str(w.key["alpha"].pk)).count() == 1


def test_rotated_key_works_during_grace_then_stops(world, client):
    w = world
    user = w.org.people["alpha"]["user"]
    new, new_secret = svc.rotate_api_key(user, w.key["alpha"], grace=dt.timedelta(hours=1))
    assert new_secret != w.secret["alpha"]
    assert list(new.services.all()) == [w.service["alpha"]]
    assert post(client, w.secret["alpha"], chat_body()).status_code == 200
    assert post(client, new_secret, chat_body()).status_code == 200
    assert AuditEvent.objects.filter(action="apikey.rotate").count() == 1
    with time_machine.travel(timezone.now() + dt.timedelta(hours=1, minutes=1)):
        old = post(client, w.secret["alpha"], chat_body())
        assert old.status_code == 401
        assert "rotated" in old.json()["error"]["message"]
        assert post(client, new_secret, chat_body()).status_code == 200


def test_archiving_the_project_stops_its_keys(world, client):
    w = world
    assert post(client, w.secret["alpha"], chat_body()).status_code == 200
    tenancy.archive_project(w.org.people["alpha"]["admin"], w.org.projects["alpha"])
    assert post(client, w.secret["alpha"], chat_body()).status_code == 401


def test_ending_the_creators_membership_stops_their_keys(world, client):
    w = world
    assert post(client, w.q_secret, chat_body(model="none")).status_code == 404  # authenticated, no such model
    membership = ProjectMembership.objects.get(user=w.q_user, project=w.q_project)
    tenancy.remove_project_member(w.org.admin, membership)
    resp = post(client, w.q_secret, chat_body(model="none"))
    assert resp.status_code == 401
    assert "no longer belongs" in resp.json()["error"]["message"]


def test_suspended_tenant_keys_are_refused(world, client):
    w = world
    tenancy.set_tenant_state(w.org.admin, w.org.tenants["alpha"], "suspended")
    assert post(client, w.secret["alpha"], chat_body()).status_code == 403
    assert post(client, w.secret["beta"], chat_body()).status_code == 200


# --- metering -------------------------------------------------------------------------------


def test_every_successful_request_is_metered_exactly_once(world, client):
    w = world
    for i in range(5):
        assert post(client, w.secret["alpha"], chat_body("word " * (i + 1))).status_code == 200
    emb = post(client, w.secret["alpha"], {"model": "chat", "input": ["one two", "three"]}, path="/v1/embeddings")
    assert emb.status_code == 200
    inp, out, reqs = metered_totals()
    assert (inp, out) == (w.up.stats.prompt_tokens, w.up.stats.completion_tokens)
    assert reqs == 6 == GatewayRequest.objects.filter(metered=True).count()
    row = TokenUsage.objects.get(api_key=w.key["alpha"], service=w.service["alpha"])
    assert row.project == w.org.projects["alpha"] and row.tenant == w.org.tenants["alpha"]
    w.key["alpha"].refresh_from_db()
    assert w.key["alpha"].last_used is not None


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_200_concurrent_requests_over_20_keys_metered_exactly_once(gateway_url, world):
    """Over the data plane, each key's first requests take the Django path (and fill the
    memory of key checks) while the others are answered from memory: both, concurrently."""
    w = world
    user = w.org.people["alpha"]["user"]
    secrets = [svc.create_api_key(user, project=w.org.projects["alpha"], name=f"k{i}",
                                  services=[w.service["alpha"]])[1] for i in range(20)]
    url = f"{gateway_url}/v1/chat/completions"

    def one(i):
        r = requests.post(url, json=chat_body("tok " * (1 + i % 7)), timeout=30,
                          headers={"Authorization": f"Bearer {secrets[i % 20]}"})
        return r.status_code

    with ThreadPoolExecutor(max_workers=32) as pool:
        statuses = list(pool.map(one, range(200)))
    assert statuses.count(200) == 200, set(statuses)
    inp, out, reqs = metered_totals_once_written(200)
    assert reqs == 200 == GatewayRequest.objects.count()
    assert (inp, out) == (w.up.stats.prompt_tokens, w.up.stats.completion_tokens)
    assert TokenUsage.objects.count() == 20


# --- limits ---------------------------------------------------------------------------------


def test_per_key_request_rate_limit_answers_429_with_retry_after(world, client):
    w = world
    key, secret = svc.create_api_key(w.org.people["alpha"]["user"], project=w.org.projects["alpha"], name="slow",
                                     services=[w.service["alpha"]], requests_per_minute=2)
    assert [post(client, secret, chat_body()).status_code for _ in range(2)] == [200, 200]
    resp = post(client, secret, chat_body())
    assert resp.status_code == 429
    assert 1 <= int(resp["Retry-After"]) <= 60
    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    assert GatewayRequest.objects.filter(api_key=key).count() == 2
    assert post(client, w.secret["alpha"], chat_body()).status_code == 200  # other keys unaffected


def test_per_project_token_rate_limit(world, client):
    w = world
    svc.set_serving_limits(w.org.people["alpha"]["admin"], w.org.projects["alpha"], requests_per_minute=None,
                           tokens_per_minute=5, monthly_token_budget=None)
    assert post(client, w.secret["alpha"], chat_body("a b c d e f")).status_code == 200
    resp = post(client, w.secret["alpha"], chat_body("x"))
    assert resp.status_code == 429 and "tokens per minute" in resp.json()["error"]["message"]
    assert post(client, w.secret["beta"], chat_body("x")).status_code == 200


def test_monthly_budget_refuses_with_clear_message_and_one_alarm(world, client):
    w = world
    svc.set_serving_limits(w.org.people["alpha"]["admin"], w.org.projects["alpha"], requests_per_minute=None,
                           tokens_per_minute=None, monthly_token_budget=10)
    assert post(client, w.secret["alpha"], chat_body("one two three four five six")).status_code == 200
    for _ in range(2):
        resp = post(client, w.secret["alpha"], chat_body("x"))
        assert resp.status_code == 429
        assert resp.json()["error"]["code"] == "budget_exceeded"
        assert "monthly token budget" in resp.json()["error"]["message"]
        assert int(resp["Retry-After"]) > 0
    assert ServingAlarm.objects.filter(project=w.org.projects["alpha"], kind="token_budget").count() == 1
    assert AuditEvent.objects.filter(action="serving.budget_exceeded").count() == 1
    assert GatewayRequest.objects.count() == 1


# --- request validation and upstream failures ------------------------------------------------


def test_bad_requests_get_openai_shaped_errors_and_are_not_metered(world, client, settings):
    w = world
    h = bearer(w.secret["alpha"])
    bad_json = client.post("/v1/chat/completions", data="{not json", content_type="application/json", **h)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    not_object = client.post("/v1/chat/completions", data="[1,2]", content_type="application/json", **h)
    assert not_object.status_code == 400
    huge = client.post("/v1/chat/completions", data=json.dumps(chat_body("x" * (2 * 1024 * 1024))),
                       content_type="application/json", **h)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    form = client.post("/v1/chat/completions", data={"model": "chat"}, **h)
    assert form.status_code == 415
    no_messages = post(client, w.secret["alpha"], {"model": "chat"})
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    wrong_method = client.get("/v1/chat/completions", **h)
    assert wrong_method.status_code == 405
    assert "error" in wrong_method.json()
    assert GatewayRequest.objects.count() == 0 and w.up.stats.requests == 0


def test_upstream_failures_map_to_502_504_without_internals_and_are_not_billed(world, client):
    w = world
    failed = post(client, w.secret["alpha"], chat_body("boom [[fail:500]]"))
    assert failed.status_code == 502
    assert "worker-7" not in failed.content.decode()
    rejected = post(client, w.secret["alpha"], chat_body("bad [[fail:400]]"))
    assert rejected.status_code == 400 and "worker-7" not in rejected.content.decode()
    service = w.service["alpha"]
    service.read_timeout = 0.3
    service.save(update_fields=["read_timeout"])
    slow = post(client, w.secret["alpha"], chat_body("wait [[sleep:1500]]"))
    assert slow.status_code == 504
    service.upstream_url = "http://127.0.0.1:9/v1"  # discard port: nothing listens
    service.save(update_fields=["upstream_url"])
    down = post(client, w.secret["alpha"], chat_body())
    assert down.status_code == 502 and down.json()["error"]["code"] == "upstream_unavailable"
    assert GatewayRequest.objects.count() == 0 and TokenUsage.objects.count() == 0


def test_response_without_usage_is_recorded_unmetered_never_guessed(world, client):
    w = world
    assert post(client, w.secret["alpha"], chat_body("hello [[nousage]]")).status_code == 200
    req = GatewayRequest.objects.get()
    assert not req.metered and req.input_tokens == 0 and req.output_tokens == 0
    assert TokenUsage.objects.get().unmetered_requests == 1


# --- streaming ------------------------------------------------------------------------------


def _sse(lines):
    events = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    return [json.loads(e) for e in events if e != "[DONE]"], events


@pytest.mark.django_db(transaction=True)
def test_stream_arrives_chunk_by_chunk_and_is_metered_once(gateway_url, world):
    w = world
    text = "one two three four five six"
    started = time.monotonic()
    arrivals = []
    with requests.post(f"{gateway_url}/v1/chat/completions", stream=True, timeout=30,
                       headers={"Authorization": f"Bearer {w.secret['alpha']}"},
                       json=chat_body(text + " [[slow:150]]", stream=True)) as resp:
        assert resp.status_code == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = []
        for line in resp.iter_lines(decode_unicode=True):
            if line:
                arrivals.append(time.monotonic() - started)
                lines.append(line)
    chunks, events = _sse(lines)
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]).split() == \
        ["echo:", *text.split()]
    assert all(c["model"] == "chat" for c in chunks)
    assert not any("usage" in c for c in chunks)  # not asked for: kept for metering only
    # chunk by chunk: the first event came well before the last (7 chunks, 150 ms apart)
    assert arrivals[-1] - arrivals[0] > 0.6
    inp, out, reqs = metered_totals_once_written(1)
    assert reqs == 1 and (inp, out) == (w.up.stats.prompt_tokens, w.up.stats.completion_tokens) and out == 7


def test_stream_with_include_usage_forwards_the_usage_chunk(world, client):
    w = world
    resp = post(client, w.secret["alpha"], chat_body("a b", stream=True, stream_options={"include_usage": True}))
    lines = b"".join(resp.streaming_content).decode().split("\n")
    chunks, _ = _sse(lines)
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert GatewayRequest.objects.get().output_tokens == 3


def test_interrupted_stream_without_usage_is_recorded_unmetered(world, client):
    w = world
    resp = post(client, w.secret["alpha"], chat_body("one two three four [[cut]]", stream=True))
    body = b"".join(resp.streaming_content).decode()
    assert "upstream_interrupted" in body
    req = GatewayRequest.objects.get()
    assert not req.metered and "interrupted" in req.note
    assert TokenUsage.objects.get().unmetered_requests == 1
    assert metered_totals()[:2] == (0, 0)

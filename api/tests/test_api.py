"""The JSON API: every endpoint with a token and with a session, cross-tenant 404s read from the
OpenAPI schema, problem+json shapes, token scopes, expiry and revocation, rate limits and audit."""

from __future__ import annotations

import json
import re

import pytest
from django.test import override_settings
from django.utils import timezone

from api.models import PersonalAccessToken
from api.tests.conftest import bearer, session
from portal.models import AuditEvent

V1 = "/api/v1"
PROBLEM = "application/problem+json"


def problem(response, status: int, slug: str) -> dict:
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert response["Content-Type"].startswith(PROBLEM)
    body = response.json()
    assert body["type"] == f"urn:atrium:problem:{slug}"
    assert body["status"] == status and body["title"] and body["detail"]
    return body


def schema_operations(client):
    spec = client.get(f"{V1}/openapi.json").json()
    for path, item in spec["paths"].items():
        for method, op in item.items():
            yield path, method, op


def fill(path: str, ids: dict) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: str(ids[m.group(1)]), path)


# --- schema and docs ------------------------------------------------------------------------------


def test_openapi_schema_documents_every_endpoint_with_problem_responses(client):
    spec = client.get(f"{V1}/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    ops = {(m.upper(), p) for p, item in spec["paths"].items() for m in item}
    assert {("GET", "/api/v1/jobs"), ("POST", "/api/v1/jobs"), ("GET", "/api/v1/jobs/{job_id}"),
            ("POST", "/api/v1/jobs/{job_id}/cancel"), ("GET", "/api/v1/specs"), ("GET", "/api/v1/quotas"),
            ("GET", "/api/v1/audit-events"), ("POST", "/api/v1/tokens"), ("DELETE", "/api/v1/tokens/{token_id}"),
            ("GET", "/api/v1/projects/{project_id}/priority-classes")} <= ops
    assert set(spec["components"]["securitySchemes"]) == {"TokenAuth", "PortalSession"}
    for _path, _method, op in schema_operations(client):
        responses = op["responses"]
        assert "401" in responses and PROBLEM in responses["401"]["content"]
        for status, response in responses.items():
            if int(status) >= 400:
                assert list(response["content"]) == [PROBLEM]
        if "429" in responses:
            assert "Retry-After" in responses["429"]["headers"]


def test_docs_page_is_self_hosted_under_the_csp(client):
    response = client.get(f"{V1}/docs")
    html = response.content.decode()
    assert response.status_code == 200
    assert "/static/api/swagger/swagger-ui-bundle.js" in html and "/static/api/swagger/swagger-init.js" in html
    assert "cdn" not in html.lower() and "<script>" not in html  # no CDN, no inline script
    assert "script-src 'self'" in response["Content-Security-Policy"]
    assert json.loads(re.search(r'id="swagger-settings"[^>]*>(.*?)</script>', html, re.S).group(1))["url"] == f"{V1}/openapi.json"


def test_unknown_api_path_is_a_problem_not_an_html_page(client):
    problem(client.get(f"{V1}/no-such-thing"), 404, "not-found")


# --- every endpoint with a token and with a session --------------------------------------------


@pytest.mark.parametrize("how", ["token", "session"])
def test_every_get_endpoint_answers_for_a_tenant_admin(org, issue, alpha_job, reports, how):
    user = org.people["alpha"]["admin"]
    own, secret = issue(user, "admin")
    client = bearer(secret) if how == "token" else session(user)
    ids = {"job_id": alpha_job.pk, "project_id": org.projects["alpha"].pk, "token_id": own.pk,
           "report_id": reports["alpha"].pk}
    seen = set()
    for path, method, _op in schema_operations(client):
        if method != "get" or path.endswith(("openapi.json", "/docs")):
            continue
        response = client.get(fill(path, ids), {"month": "2026-01"} if path.endswith("/usage") else {})
        if path.endswith("/download"):
            problem(response, 409, "conflict")  # the report is still queued
            continue
        assert response.status_code == 200, (path, response.content[:300])
        assert response["Content-Type"] == "application/json; charset=utf-8"
        seen.add(path)
    assert {"/api/v1/jobs", "/api/v1/jobs/{job_id}", "/api/v1/me", "/api/v1/quotas", "/api/v1/audit-events",
            "/api/v1/usage", "/api/v1/reports/{report_id}"} <= seen
    me = client.get(f"{V1}/me").json()
    assert me["username"] == "alpha-admin" and me["auth"] == how
    assert me["token_scope"] == ("admin" if how == "token" else None)


@pytest.mark.parametrize("how", ["token", "session"])
def test_submit_detail_and_cancel_a_job(org, issue, how):
    user = org.people["alpha"]["user"]
    _, secret = issue(user, "submit")
    client = bearer(secret) if how == "token" else session(user)
    body = {"project": "alpha/alpha-p", "spec": "h100 x1", "priority_class": "batch", "image": "busybox",
            "command": ["python", "train.py", "--epochs", "3"]}
    created = client.post(f"{V1}/jobs", body, content_type="application/json")
    assert created.status_code == 201, created.content
    job = created.json()
    assert job["state"] == "pending" and job["wait_reason"] == "queued" and job["name"] == "python"
    assert job["project"] == {"id": org.projects["alpha"].pk, "tenant": "alpha", "slug": "alpha-p"}
    assert job["command"] == ["python", "train.py", "--epochs", "3"] and job["events"][0]["kind"] == "submitted"

    detail = client.get(f"{V1}/jobs/{job['id']}").json()
    assert detail["wait_message"] and detail["bindings"] == []
    cancelled = client.post(f"{V1}/jobs/{job['id']}/cancel", {"reason": "typo"}, content_type="application/json")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    again = client.post(f"{V1}/jobs/{job['id']}/cancel", {}, content_type="application/json")
    problem(again, 409, "conflict")


def test_job_list_filters_and_pages(org, issue, alpha_job):
    from scheduling import services as sched

    user = org.people["alpha"]["user"]
    for i in range(3):
        sched.submit_job(user, project=org.projects["alpha"], spec=org.specs["l4half"], priority_class=org.prio["batch"],
                         name=f"sweep-{i}", image="busybox", command=["true"])
    _, secret = issue(user)
    client = bearer(secret)
    page = client.get(f"{V1}/jobs", {"limit": 2, "offset": 0}).json()
    assert page["count"] == 4 and len(page["items"]) == 2 and page["items"][0]["name"] == "sweep-2"
    rest = client.get(f"{V1}/jobs", {"limit": 2, "offset": 2}).json()
    assert [j["name"] for j in rest["items"]] == ["sweep-0", "alpha-train"]
    assert client.get(f"{V1}/jobs", {"q": "sweep"}).json()["count"] == 3
    assert client.get(f"{V1}/jobs", {"state": "running"}).json()["count"] == 0
    viewer_secret = issue(org.people["alpha"]["viewer"])[1]
    assert bearer(viewer_secret).get(f"{V1}/jobs", {"mine": "true"}).json()["count"] == 0
    problem(client.get(f"{V1}/jobs", {"limit": 0}), 422, "validation-error")


def test_catalogue_specs_and_priority_classes_per_project(org, issue):
    _, secret = issue(org.people["alpha"]["user"])
    client = bearer(secret)
    specs = {s["name"]: s for s in client.get(f"{V1}/specs").json()}
    assert set(specs) == {"h100 x1", "h100 x4", "l4 x0.5"} and specs["l4 x0.5"]["card_fraction"] == 0.5
    # alpha-p is a research project: "production" is not allowed there
    names = [p["name"] for p in client.get(f"{V1}/projects/{org.projects['alpha'].pk}/priority-classes").json()]
    assert names == ["training", "batch"]
    viewer = bearer(issue(org.people["alpha"]["viewer"])[1])
    assert viewer.get(f"{V1}/projects/{org.projects['alpha'].pk}/priority-classes").json() == []
    projects = client.get(f"{V1}/projects").json()
    assert [p["slug"] for p in projects] == ["alpha-p"] and "submit_job" in projects[0]["permissions"]


def test_quotas_show_own_lines_with_current_use(org, issue, alpha_job):
    from scheduling.backends.simulated import SimulatedCluster
    from scheduling.cycle import run_cycle

    run_cycle()
    SimulatedCluster().tick()
    _, secret = issue(org.people["alpha"]["user"])
    rows = bearer(secret).get(f"{V1}/quotas").json()
    assert {r["tenant"] for r in rows} == {"alpha"}
    h100 = {(r["project"]): r for r in rows if r["accelerator_model"] == "H100-SXM5-80GB"}
    assert h100["alpha-p"]["in_use"] == 1.0 and h100["alpha-p"]["limit"] == 4.0
    assert h100[None]["in_use"] == 1.0  # the tenant line counts every project of the tenant


# --- cross-tenant: every route of the schema -------------------------------------------------------


def test_every_route_answers_404_for_another_tenants_objects_exactly_like_a_missing_one(org, issue, alpha_job, beta_job,
                                                                                       reports):
    from serving import services as svc

    user = org.people["alpha"]["admin"]  # the strongest tenant role of alpha
    own, secret = issue(user, "admin")
    beta_token, _ = issue(org.people["beta"]["admin"], "admin")
    beta_key, _ = svc.create_api_key(org.people["beta"]["admin"], project=org.projects["beta"], name="beta-key")
    client = bearer(secret)
    other = {"job_id": beta_job.pk, "project_id": org.projects["beta"].pk, "token_id": beta_token.pk,
             "report_id": reports["beta"].pk, "key_id": beta_key.pk}
    missing = {k: 999_999 for k in other}
    checked = 0
    for path, method, _op in schema_operations(client):
        if "{" not in path:
            continue
        # a body every POST route accepts, so that the lookup (not body validation) answers
        body = {"reason": "x", "name": "x"} if method == "post" else None
        calls = [getattr(client, method)(fill(path, ids), *([json.dumps(body)] if body else []),
                                         content_type="application/json") for ids in (other, missing)]
        foreign, absent = (problem(c, 404, "not-found") for c in calls)
        assert {k: v for k, v in foreign.items() if k != "instance"} == {k: v for k, v in absent.items() if k != "instance"}
        assert "beta" not in json.dumps(foreign)
        checked += 1
    assert checked >= 4
    assert not PersonalAccessToken.objects.get(pk=beta_token.pk).revoked
    assert org.projects["beta"].jobs.get(pk=beta_job.pk).state == "pending"
    beta_key.refresh_from_db()
    assert beta_key.revoked is None and beta_key.replaced_by_id is None
    assert beta_key.project.api_keys.count() == 1


# Query parameters and body fields that name an object of a tenant: (beta's, a missing one) by
# JSON type. A reference a route takes that is not here fails the walk below ("add it").
REFERENCES = {
    ("project", "integer"): lambda org: (org.projects["beta"].pk, 999_999),
    ("project", "string"): lambda org: ("beta/beta-p", "beta/nope-p"),
    ("tenant", "string"): lambda org: ("beta", "nope"),
}
# what a route needs besides the reference to be a valid call, so the reference is what decides
REQUIRED = {
    ("get", "/api/v1/usage"): {"month": "2026-01"},
    ("post", "/api/v1/jobs"): {"project": "alpha-p", "spec": "h100 x1", "priority_class": "batch", "image": "busybox",
                               "command": ["true"]},
    ("post", "/api/v1/reports"): {"period_start": "2026-01-01", "period_end": "2026-02-01"},
}


def _inputs(spec: dict, op: dict) -> list[tuple[str, str, str]]:
    """(where, name, JSON type) of every query parameter and top-level body field of an operation."""

    def resolve(schema):
        while "$ref" in schema:
            schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
        options = [resolve(s) for s in schema.get("anyOf", [])]
        return next((o for o in options if o.get("type") != "null"), schema) if options else schema

    found = [("query", p["name"], resolve(p["schema"]).get("type", "")) for p in op.get("parameters", [])
             if p["in"] == "query"]
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body:
        found += [("body", name, resolve(prop).get("type", "")) for name, prop in resolve(body).get("properties", {}).items()]
    return found


def test_every_route_refers_to_another_tenants_objects_exactly_like_missing_ones(org, issue, alpha_job, beta_job,
                                                                                reports):
    # the same walk for references in query strings and bodies: routes without an id in their path
    # (lists with filters, submissions, report requests) answer for beta's object as for none at all
    _, secret = issue(org.people["alpha"]["admin"], "admin")
    client = bearer(secret)
    spec = client.get(f"{V1}/openapi.json").json()
    checked, unknown = [], []
    for path, method, op in schema_operations(client):
        for where, name, kind in _inputs(spec, op):
            if name not in ("project", "tenant") and not name.endswith("_id"):
                continue
            if (name, kind) not in REFERENCES:
                unknown.append(f"{method.upper()} {path} {where} {name} ({kind})")
                continue
            answers = []
            for value in REFERENCES[(name, kind)](org):
                args = {**REQUIRED.get((method, path), {}), name: value}
                if where == "query" and method == "get":
                    response = client.get(path, args)
                else:
                    response = getattr(client, method)(path, json.dumps(args), content_type="application/json")
                raw = json.dumps(value)[1:-1] if kind == "string" else str(value)  # as it may be echoed in a detail
                body = re.sub(rf"(?<![\w/]){re.escape(raw)}(?![\w/])", "<ref>", response.content.decode())
                answers.append((response.status_code, response["Content-Type"], body))
            foreign, absent = answers
            assert foreign == absent, (method, path, name, foreign, absent)
            assert foreign[0] in (200, 404, 422) and "beta" not in foreign[2], (method, path, name, foreign)
            checked.append((method, path, where, name))
    assert not unknown, f"routes take references this matrix does not know; add them to REFERENCES: {unknown}"
    assert {("get", "/api/v1/jobs", "query", "project"), ("get", "/api/v1/quotas", "query", "tenant"),
            ("post", "/api/v1/jobs", "body", "project"), ("post", "/api/v1/reports", "body", "tenant"),
            ("post", "/api/v1/reports", "body", "project"), ("get", "/api/v1/audit-events", "query", "tenant")} <= set(checked)
    assert not org.projects["beta"].jobs.exclude(pk=beta_job.pk).exists()
    assert AuditEvent.objects.filter(action="metering.report.request", tenant=org.tenants["beta"]).count() == 1


def test_lists_never_name_another_tenant(org, issue, alpha_job, beta_job, reports):
    # every GET route of the schema without an id in its path, as alpha's strongest tenant role
    _, secret = issue(org.people["alpha"]["admin"], "admin")
    client = bearer(secret)
    seen = []
    for path, method, _op in schema_operations(client):
        if method != "get" or "{" in path or path.endswith(("openapi.json", "/docs")):
            continue
        response = client.get(path, REQUIRED.get((method, path), {}))
        assert response.status_code == 200, (path, response.content[:300])
        assert "beta" not in response.content.decode(), path
        seen.append(path)
    assert {f"{V1}{p}" for p in ("/jobs", "/projects", "/quotas", "/audit-events", "/reports", "/usage", "/tokens")} <= set(seen)


def test_submitting_into_another_tenants_project_is_refused_like_a_missing_project(org, issue):
    _, secret = issue(org.people["alpha"]["user"], "submit")
    body = {"spec": "h100 x1", "priority_class": "batch", "image": "busybox", "command": ["true"]}
    foreign = problem(bearer(secret).post(f"{V1}/jobs", {**body, "project": "beta/beta-p"}, content_type="application/json"),
                      422, "validation-error")
    absent = problem(bearer(secret).post(f"{V1}/jobs", {**body, "project": "beta/nope-p"}, content_type="application/json"),
                     422, "validation-error")
    assert foreign["errors"][0]["field"] == absent["errors"][0]["field"] == "project"
    assert not org.projects["beta"].jobs.exists()


# --- problems and validation ------------------------------------------------------------------------


def test_unauthenticated_and_bad_tokens_are_401_problems(org, client):
    body = problem(client.get(f"{V1}/jobs"), 401, "unauthenticated")
    assert "Bearer" in body["detail"]
    assert client.get(f"{V1}/jobs")["WWW-Authenticate"].startswith("Bearer")
    problem(bearer("atp_not-a-real-token").get(f"{V1}/jobs"), 401, "invalid-token")
    problem(bearer("ghp_something").get(f"{V1}/jobs"), 401, "invalid-token")


def test_validation_errors_name_the_field(org, issue):
    _, secret = issue(org.people["alpha"]["user"], "submit")
    client = bearer(secret)
    base = {"project": "alpha-p", "spec": "h100 x1", "priority_class": "batch", "image": "busybox", "command": ["true"]}
    missing = problem(client.post(f"{V1}/jobs", {k: v for k, v in base.items() if k != "image"},
                                  content_type="application/json"), 422, "validation-error")
    assert [e["field"] for e in missing["errors"]] == ["image"]
    zero = problem(client.post(f"{V1}/jobs", {**base, "replicas": 0}, content_type="application/json"), 422, "validation-error")
    assert zero["errors"][0]["field"] == "replicas"
    spec = problem(client.post(f"{V1}/jobs", {**base, "spec": "tpu x8"}, content_type="application/json"), 422,
                   "validation-error")
    assert spec["errors"] == [{"field": "spec", "message": spec["errors"][0]["message"]}] and "h100 x1" in spec["detail"]
    prio = problem(client.post(f"{V1}/jobs", {**base, "priority_class": "vip"}, content_type="application/json"), 422,
                   "validation-error")
    assert prio["errors"][0]["field"] == "priority_class"
    broken = problem(client.post(f"{V1}/jobs", "{not json", content_type="application/json"), 400, "malformed-request")
    assert broken["errors"][0]["field"] == "body"


def test_a_priority_class_not_allowed_is_forbidden_and_audited(org, issue):
    _, secret = issue(org.people["alpha"]["user"], "submit")
    body = {"project": "alpha-p", "spec": "h100 x1", "priority_class": "production", "image": "busybox",
            "command": ["true"]}
    problem(bearer(secret).post(f"{V1}/jobs", body, content_type="application/json"), 403, "forbidden")
    denied = AuditEvent.objects.filter(action="job.submit", outcome="denied").get()
    assert denied.actor == org.people["alpha"]["user"]


def test_a_viewer_may_see_but_not_cancel(org, issue, alpha_job):
    _, secret = issue(org.people["alpha"]["viewer"], "submit")
    client = bearer(secret)
    assert client.get(f"{V1}/jobs/{alpha_job.pk}").status_code == 200
    problem(client.post(f"{V1}/jobs/{alpha_job.pk}/cancel", {}, content_type="application/json"), 403, "forbidden")
    alpha_job.refresh_from_db()
    assert alpha_job.state == "pending"


# --- scopes, expiry, revocation ------------------------------------------------------------------------


def test_a_read_token_cannot_submit_cancel_or_manage_tokens(org, issue, alpha_job):
    _, secret = issue(org.people["alpha"]["user"], "read")
    client = bearer(secret)
    body = {"project": "alpha-p", "spec": "h100 x1", "priority_class": "batch", "image": "busybox", "command": ["true"]}
    problem(client.post(f"{V1}/jobs", body, content_type="application/json"), 403, "insufficient-scope")
    problem(client.post(f"{V1}/jobs/{alpha_job.pk}/cancel", {}, content_type="application/json"), 403, "insufficient-scope")
    problem(client.post(f"{V1}/tokens", {"name": "x"}, content_type="application/json"), 403, "insufficient-scope")
    problem(client.get(f"{V1}/tokens"), 403, "insufficient-scope")
    assert org.projects["alpha"].jobs.count() == 1


def test_a_submit_token_cannot_mint_tokens_and_an_admin_token_cannot_exceed_itself(org, issue):
    user = org.people["alpha"]["user"]
    _, submit = issue(user, "submit")
    problem(bearer(submit).post(f"{V1}/tokens", {"name": "x", "scope": "read"}, content_type="application/json"),
            403, "insufficient-scope")
    _, admin = issue(user, "admin")
    made = bearer(admin).post(f"{V1}/tokens", {"name": "ci", "scope": "submit", "expires_in_days": 7},
                              content_type="application/json")
    assert made.status_code == 201
    secret = made.json()["secret"]
    assert secret.startswith("atp_") and bearer(secret).get(f"{V1}/me").json()["token_scope"] == "submit"
    row = PersonalAccessToken.objects.get(pk=made.json()["token"]["id"])
    assert secret not in (row.digest, row.prefix) and len(row.digest) == 64


def test_expired_and_revoked_tokens_are_refused(org, issue):
    user = org.people["alpha"]["user"]
    expired, expired_secret = issue(user)
    PersonalAccessToken.objects.filter(pk=expired.pk).update(expires=timezone.now() - timezone.timedelta(seconds=1))
    assert "expired" in problem(bearer(expired_secret).get(f"{V1}/jobs"), 401, "invalid-token")["detail"]
    revoked, revoked_secret = issue(user, "admin")
    assert bearer(revoked_secret).delete(f"{V1}/tokens/{revoked.pk}").json()["revoked"]
    assert "revoked" in problem(bearer(revoked_secret).get(f"{V1}/jobs"), 401, "invalid-token")["detail"]


def test_a_disabled_account_cannot_use_its_token(org, issue):
    user = org.people["alpha"]["user"]
    _, secret = issue(user)
    user.is_active = False
    user.save()
    problem(bearer(secret).get(f"{V1}/me"), 401, "invalid-token")


def test_a_token_request_never_runs_in_sudo_mode(org, issue):
    # raising a tenant line needs sudo; a browser session's sudo must not leak into a token call
    from portal import context

    _, secret = issue(org.admin, "admin")
    with context.bound(sudo=True):
        me = bearer(secret).get(f"{V1}/me")
    assert me.status_code == 200
    # the token path resets sudo for the request, observable on the audit event it writes
    bearer(secret).post(f"{V1}/tokens", {"name": "another", "scope": "read"}, content_type="application/json")
    assert AuditEvent.objects.filter(action="api.token.create").order_by("-id").first().sudo is False


# --- sessions and CSRF -------------------------------------------------------------------------------


def test_a_session_must_send_the_csrf_token_on_changes(org):
    user = org.people["alpha"]["user"]
    client = session(user, enforce_csrf_checks=True)
    body = {"project": "alpha-p", "spec": "h100 x1", "priority_class": "batch", "image": "busybox", "command": ["true"]}
    problem(client.post(f"{V1}/jobs", body, content_type="application/json"), 403, "csrf-failed")
    assert client.get(f"{V1}/jobs").status_code == 200  # reads need no CSRF token
    client.get(f"{V1}/docs")  # sets the CSRF cookie, as any portal page does
    csrf = client.cookies["csrftoken"].value
    ok = client.post(f"{V1}/jobs", body, content_type="application/json", HTTP_X_CSRFTOKEN=csrf)
    assert ok.status_code == 201


# --- rate limit ------------------------------------------------------------------------------------------


@override_settings(ATRIUM_API_RATE_LIMIT="2/60")
def test_state_changing_calls_are_rate_limited_per_token(org, issue, alpha_job):
    user = org.people["alpha"]["user"]
    _, first = issue(user, "submit")
    _, second = issue(user, "submit")
    body = {"project": "alpha-p", "spec": "l4 x0.5", "priority_class": "batch", "image": "busybox", "command": ["true"]}
    for _ in range(2):
        assert bearer(first).post(f"{V1}/jobs", body, content_type="application/json").status_code == 201
    refused = bearer(first).post(f"{V1}/jobs", body, content_type="application/json")
    body429 = problem(refused, 429, "rate-limited")
    retry = int(refused["Retry-After"])
    assert 1 <= retry <= 61 and body429["retry_after"] == retry
    assert bearer(first).get(f"{V1}/jobs").status_code == 200  # reads are not limited
    assert bearer(second).post(f"{V1}/jobs", body, content_type="application/json").status_code == 201  # per token
    assert org.projects["alpha"].jobs.count() == 1 + 3


# --- audit ----------------------------------------------------------------------------------------------


def test_one_audit_event_per_token_create_and_revoke(org):
    user = org.people["alpha"]["user"]
    client = session(user)
    before = AuditEvent.objects.count()
    made = client.post(f"{V1}/tokens", {"name": "laptop", "scope": "submit"}, content_type="application/json").json()
    created = AuditEvent.objects.filter(id__gt=0).order_by("-id")[:1].get()
    assert AuditEvent.objects.count() == before + 1
    assert (created.action, created.actor, created.target_id) == ("api.token.create", user, str(made["token"]["id"]))
    assert made["secret"] not in json.dumps(created.after)
    client.delete(f"{V1}/tokens/{made['token']['id']}")
    revoked = AuditEvent.objects.order_by("-id").first()
    assert AuditEvent.objects.count() == before + 2 and revoked.action == "api.token.revoke"
    problem(client.delete(f"{V1}/tokens/{made['token']['id']}"), 409, "conflict")
    assert AuditEvent.objects.count() == before + 2


def _audit_shape(e: AuditEvent) -> dict:
    """An event without what must differ between two requests: ids, time, hash chain, request id."""
    return {"action": e.action, "actor": e.actor_id, "actor_label": e.actor_label, "on_behalf_of": e.on_behalf_of,
            "tenant": e.tenant_id, "project": e.project_id, "target_type": e.target_type, "outcome": e.outcome,
            "reason": e.reason, "before": e.before, "after": e.after, "sudo": e.sudo, "source_ip": e.source_ip}


def _events_of(call) -> list[AuditEvent]:
    last = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
    call()
    return list(AuditEvent.objects.filter(id__gt=last).order_by("id"))


def test_api_and_pages_write_the_same_audit_events_for_submit_and_cancel(org, issue, settings):
    from scheduling.models import Job

    # A fresh sign-in counts as a re-authentication for a while (sudo=True on the page's events) and a
    # token never does (test_a_token_request_never_runs_in_sudo_mode); outside that window they agree.
    settings.ATRIUM_SUDO_SECONDS = 0

    user, viewer, project = org.people["alpha"]["user"], org.people["alpha"]["viewer"], org.projects["alpha"]
    token = bearer(issue(user, "submit")[1])
    viewer_token = bearer(issue(viewer, "submit")[1])
    browser, viewer_browser = session(user), session(viewer)  # signing in is audited too: done before counting

    def api_submit():
        response = token.post(f"{V1}/jobs", {"project": "alpha-p", "spec": "h100 x1", "priority_class": "batch",
                                             "image": "busybox", "command": ["sleep", "1"], "name": "same"},
                              content_type="application/json")
        assert response.status_code == 201, response.content[:500]

    def page_submit():
        response = browser.post("/scheduling/jobs/new/", {
            "project": project.pk, "spec": org.specs["h1"].pk, "priority_class": org.prio["batch"].pk,
            "name": "same", "image": "busybox", "command": "sleep 1", "replicas": 1, "expected_minutes": 60,
            "time_limit_minutes": 1440,
        })
        assert response.status_code == 302, response.content[:500]

    pairs = {"submit": (_events_of(api_submit), _events_of(page_submit))}
    by_api, by_page = (Job.objects.get(pk=int(events[0].target_id)) for events in pairs["submit"])

    # a cancel the caller may make, and one a viewer may not (refused and audited the same way)
    pairs["cancel"] = (
        _events_of(lambda: token.post(f"{V1}/jobs/{by_api.pk}/cancel", {"reason": "typo"}, content_type="application/json")),
        _events_of(lambda: browser.post(f"/scheduling/jobs/{by_page.pk}/cancel/", {"reason": "typo", "confirm": "on"})),
    )
    kept = token.post(f"{V1}/jobs", {"project": "alpha-p", "spec": "h100 x1", "priority_class": "batch",
                                     "image": "busybox", "command": ["sleep", "1"]}, content_type="application/json").json()
    pairs["denied cancel"] = (
        _events_of(lambda: viewer_token.post(f"{V1}/jobs/{kept['id']}/cancel", {"reason": "mine"},
                                             content_type="application/json")),
        _events_of(lambda: viewer_browser.post(f"/scheduling/jobs/{kept['id']}/cancel/", {"reason": "mine", "confirm": "on"})),
    )

    expected = {"submit": ("job.submit", "success", user), "cancel": ("job.cancel", "success", user),
                "denied cancel": ("job.cancel", "denied", viewer)}
    for what, (api_events, page_events) in pairs.items():
        assert len(api_events) == len(page_events) == 1, (what, api_events, page_events)
        api_event, page_event = api_events[0], page_events[0]
        action, outcome, actor = expected[what]
        assert (api_event.action, api_event.outcome, api_event.actor) == (action, outcome, actor), what
        assert (api_event.tenant, api_event.project, api_event.target_type) == (org.tenants["alpha"], project, "scheduling.job")
        assert _audit_shape(api_event) == _audit_shape(page_event), what
        # the two differ only in what names the request and the object
        assert api_event.request_id and page_event.request_id and api_event.request_id != page_event.request_id
    assert pairs["denied cancel"][0][0].target_id == pairs["denied cancel"][1][0].target_id == str(kept["id"])
    assert {Job.objects.get(pk=j.pk).state for j in (by_api, by_page)} == {"cancelled"}
    assert Job.objects.get(pk=kept["id"]).state == "pending"


def test_audit_events_by_role(org, issue, alpha_job, beta_job):
    auditor = bearer(issue(org.auditor)[1]).get(f"{V1}/audit-events", {"action": "job.", "limit": 500}).json()
    assert {e["tenant"] for e in auditor["items"]} == {"alpha", "beta"}
    tadmin = bearer(issue(org.people["alpha"]["admin"])[1]).get(f"{V1}/audit-events", {"action": "job.submit"}).json()
    assert tadmin["count"] == 1 and tadmin["items"][0]["tenant"] == "alpha"
    problem(bearer(issue(org.people["alpha"]["user"])[1]).get(f"{V1}/audit-events"), 403, "forbidden")
    bad = problem(bearer(issue(org.auditor)[1]).get(f"{V1}/audit-events", {"since": "yesterday"}), 422, "validation-error")
    assert bad["errors"][0]["field"] == "since"


# --- the token page -------------------------------------------------------------------------------------


def test_token_page_shows_the_secret_once_and_revokes(org):
    user = org.people["alpha"]["user"]
    client = session(user)
    response = client.post("/api/tokens/", {"name": "laptop", "scope": "submit", "expires_in_days": 30})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    secret = re.search(r"(atp_[A-Za-z0-9_-]{40})", response.content.decode()).group(1)
    token = PersonalAccessToken.objects.get(user=user)
    assert token.scope == "submit" and secret.startswith(token.prefix)
    assert secret not in client.get("/api/tokens/").content.decode()  # shown once
    assert bearer(secret).get(f"{V1}/me").json()["username"] == user.username
    other = session(org.people["alpha"]["viewer"])
    assert other.post(f"/api/tokens/{token.pk}/revoke/").status_code == 404  # not theirs
    assert client.post(f"/api/tokens/{token.pk}/revoke/").status_code == 302
    assert AuditEvent.objects.filter(action__startswith="api.token.").count() == 2
    problem(bearer(secret).get(f"{V1}/me"), 401, "invalid-token")
    bad = client.post("/api/tokens/", {"name": "", "scope": "root", "expires_in_days": 9999})
    assert bad.status_code == 400 and PersonalAccessToken.objects.count() == 1


def test_usage_of_a_month_is_priced_and_scoped(org, issue, alpha_job, beta_job):
    import datetime as dt

    from metering import services as metering
    from scheduling.backends.simulated import SimulatedCluster
    from scheduling.cycle import run_cycle

    now = timezone.now()
    run_cycle()
    SimulatedCluster().tick()
    metering.set_price(org.admin, accelerator_model=org.models["h100"], per_card_hour=2,
                       effective_from=now - dt.timedelta(days=40))
    metering.accrue(until=now + dt.timedelta(hours=2))
    _, secret = issue(org.people["alpha"]["user"])
    data = bearer(secret).get(f"{V1}/usage", {"month": now.strftime("%Y-%m")}).json()
    assert {r["tenant"] for r in data["rows"]} == {"alpha"}
    assert 1.9 <= data["total_card_hours"] <= 2.1 and abs(data["total_cost"] - 2 * data["total_card_hours"]) < 0.01
    assert sum(d["card_hours"] for d in data["days"]) == pytest.approx(data["total_card_hours"])
    problem(bearer(secret).get(f"{V1}/usage", {"month": "2026-13"}), 422, "validation-error")


def test_report_request_poll_and_download(org, issue):
    from metering import services as metering

    _, secret = issue(org.people["alpha"]["admin"])
    client = bearer(secret)
    asked = client.post(f"{V1}/reports", {"period_start": "2026-01-01", "period_end": "2026-02-01", "tenant": "alpha"},
                        content_type="application/json")
    assert asked.status_code == 202 and asked.json()["status"] == "queued"
    rid = asked.json()["id"]
    problem(client.get(f"{V1}/reports/{rid}/download"), 409, "conflict")
    metering.build_report(rid)
    done = client.get(f"{V1}/reports/{rid}").json()
    assert done["status"] == "done" and set(done["downloads"]) == {"csv", "xlsx", "focus"}
    csv = client.get(f"{V1}/reports/{rid}/download", {"format": "csv"})
    assert csv.status_code == 200 and b"," in b"".join(csv.streaming_content)
    foreign = problem(client.post(f"{V1}/reports", {"period_start": "2026-01-01", "period_end": "2026-02-01",
                                                    "tenant": "beta"}, content_type="application/json"),
                      422, "validation-error")
    assert foreign["errors"][0]["field"] == "tenant"
    assert AuditEvent.objects.filter(action="metering.report.request").count() == 1

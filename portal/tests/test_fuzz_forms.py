"""Every form of the portal fed garbage with hypothesis: never a 500, nothing partially saved.

The targets are the project's POST views: those of tenants/permission_matrix.yaml that take a
body (the URL list is checked against the resolver, as portal/tests/test_matrix.py does),
plus the serving, metering and token forms the matrix does not list yet. Each is posted to as
a user the matrix lets through, with bodies built from the valid one by replacing, dropping
or corrupting fields: empty, huge, unicode (incl. NUL and right-to-left marks), negative,
out-of-range, wrong types, and the ids of the other tenant's objects. Assertions:

* never a 5xx (the test client re-raises an exception from the view, so a crash fails here);
* when the answer is a refusal (4xx) or the form again with its errors (200), the row count
  of every model is unchanged (the audit log and sessions excepted: a refusal is audited);
* nothing the other tenant owns ever appears in a form answered to an alpha user.

Gateway garbage (malformed JSON, 413, wrong content types, missing fields, absurd max_tokens)
is at the end. The examples per form are bounded so the file runs in about a minute.
"""

from __future__ import annotations

import json
import re

import pytest
from django.apps import apps
from django.db import connection, transaction
from django.urls import reverse
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from portal.tests.test_matrix import _Rollback, fill, url_patterns
from tenants import matrix
from tenants.tests.factories import build_world, client_for

# make fuzz loads the "fuzz" hypothesis profile (conftest.py): a bigger, randomized budget
FUZZING = hsettings.get_current_profile_name() == "fuzz"
EXAMPLES = max(14, hsettings.default.max_examples) if FUZZING else 14
OMIT = object()
# Tables whose rows a refused request may legitimately add: the audit trail of the refusal
# (and its chain head), the session store, and a refused sign-in's failure counter (axes).
MAY_GROW = {"portal_auditevent", "portal_auditchainhead", "django_session", "axes_accessattempt"}
NASTY = [
    "", " ", "0", "-1", "-0", "1.5", "1e309", "NaN", "-inf", "0x10", "99999999999999999999999999999",
    "-9223372036854775809", "9223372036854775808", "2147483648", "null", "None", "true", "[]", "{}", "on",
    "<script>alert(1)</script>", "'; DROP TABLE auth_user; --", "%s%s%n", "../../etc/passwd",
    "a\x00b", "\x00", "\u202egnp.exe", "١٢٣", "𝟙𝟚𝟛", "ß" * 41, "é" * 301, "x" * 10_000, "🙂" * 200,
    "2025-13-45", "9999-12-31", "0000-00-00", "t0", "p0", "all", "http://169.254.169.254/latest", "javascript:alert(1)",
]

# Forms the matrix has no (or only part of the) body for: field -> a valid value, with "{kind}"
# for alpha's object of that kind (as in the matrix).
EXTRA_FIELDS = {
    "scheduling:job_create": {"project": "{project}", "spec": "{spec}", "priority_class": "{prio}",
                              "name": "fuzz", "image": "busybox", "command": "sleep 1", "replicas": "1",
                              "expected_minutes": "10", "time_limit_minutes": "20"},
    "tenants:member_add": {"project": "{project}"},
    "tenants:project_create": {"cost_centre": "cc-1"},
}
# Views outside the matrix: (url name, acting role, kwargs kinds, body)
UNLISTED = [
    ("serving:service_create", "project_admin", {},
     {"project": "{project}", "slug": "fuzz-svc", "name": "Fuzz", "base_model": "llama", "model_version": "1",
      "spec": "{spec}", "priority_class": "{prio}", "replicas": "1", "upstream_url": "http://127.0.0.1:9/v1",
      "upstream_model": "m", "visibility": "project"}),
    ("serving:application_create", "project_admin", {},
     {"project": "{project}", "slug": "fuzz-app", "name": "App", "service": "{job}", "knowledge_bases": "",
      "system_prompt": "be brief", "top_k": "4"}),
    ("serving:kb_create", "tenant_admin", {},
     {"tenant": "{tenant}", "slug": "fuzz-kb", "name": "KB", "description": "d", "all_projects": "on",
      "projects": "{project}"}),
    ("serving:key_create", "project_admin", {},
     {"project": "{project}", "name": "k", "services": "", "knowledge_bases": "", "expires_in_days": "30",
      "requests_per_minute": "60", "tokens_per_minute": "1000"}),
    ("metering:budget_create", "tenant_admin", {},
     {"scope": "t{tenant}", "unit": "cost", "amount": "100.00", "mode": "warn", "thresholds": "80, 100"}),
    ("metering:report_list", "tenant_admin", {},
     {"scope": "t{tenant}", "period_start": "2025-01-01", "period_end": "2025-02-01", "grouping": "tenant",
      "mode": "showback"}),
    ("api_token_list", "project_user", {}, {"name": "laptop", "scope": "read", "expires_in_days": "30"}),
]
# Roles tried first: a tenant-scoped actor makes "the other tenant's id" meaningful.
ROLE_PREFERENCE = ("project_user", "project_admin", "tenant_admin", "ops_engineer", "security_admin",
                   "platform_admin", "anonymous")


def _acting_role(name: str) -> str | None:
    if name == "login":
        return "anonymous"  # a signed-in browser is sent on before the form is read
    for role in ROLE_PREFERENCE:
        if matrix.expected(name, "post", role) in ("200", "302", "400"):
            return role
    return None


def targets(world) -> list[dict]:
    """(name, url, role, valid body) of every form-taking POST view."""
    objects = {**world.own, "spec": world.org.specs["h1"], "prio": world.org.prio["batch"]}
    names = {name for name, _ in url_patterns()}
    out = []
    unlisted = {entry[0] for entry in UNLISTED}
    for name, spec in matrix.urls().items():
        if name not in names or "post" not in spec or name in unlisted:
            continue
        body = {**(spec.get("data") or {}), **EXTRA_FIELDS.get(name, {})}
        role = _acting_role(name)
        if not body or role is None:
            continue  # a bare POST (approve, remove, archive): nothing to fuzz
        kinds = spec.get("kwargs", {})
        if any(kind not in world.own for kind in kinds.values()):
            continue  # an object this world does not build; such forms are listed in UNLISTED
        try:
            filled = fill(body, objects)
        except KeyError:
            continue  # the body names an object kind this world does not build
        kwargs = {k: world.own[kind].pk for k, kind in kinds.items()}
        out.append({"name": name, "url": reverse(name, kwargs=kwargs), "role": role, "body": filled})
    for name, role, kinds, body in UNLISTED:
        if name in names:
            kwargs = {k: world.own[kind].pk for k, kind in kinds.items()}
            out.append({"name": name, "url": reverse(name, kwargs=kwargs), "role": role,
                        "body": _fill_inline(body, objects)})
    return out


def _fill_inline(body: dict, objects: dict) -> dict:
    return {k: re.sub(r"\{(\w+)\}", lambda m: str(objects[m.group(1)].pk), v) for k, v in body.items()}


def foreign_ids(world) -> list[str]:
    ids = [str(o.pk) for o in world.other.values()]
    ids += [f"t{world.other['tenant'].pk}", f"p{world.other['project'].pk}"]
    return ids


def row_counts() -> dict[str, int]:
    tables = sorted({m._meta.db_table for m in apps.get_models() if m._meta.managed})
    sql = "SELECT " + ", ".join(f"(SELECT count(*) FROM {connection.ops.quote_name(t)})" for t in tables)
    with connection.cursor() as cur:
        cur.execute(sql)
        return dict(zip(tables, cur.fetchone()))


def body_strategy(body: dict, foreign: list[str]):
    unicode_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
    junk = st.one_of(
        st.sampled_from(NASTY), unicode_text, st.integers(-(2**70), 2**70).map(str),
        st.decimals(allow_nan=True, allow_infinity=True).map(str), st.sampled_from(foreign),
        st.lists(st.sampled_from(NASTY + foreign), min_size=2, max_size=3),
    )
    fields = {k: st.one_of(st.just(v), st.just(OMIT), junk) for k, v in body.items()}
    return st.fixed_dictionaries(fields).map(lambda d: {k: v for k, v in d.items() if v is not OMIT})


def _fuzzer(target: dict, client, baseline: dict, bodies, seen: dict, other_names):
    @hsettings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not FUZZING,
               suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def post_garbage(body):
        try:
            with transaction.atomic():
                response = client.post(target["url"], body)
                after = row_counts() if response.status_code != 302 else baseline
                raise _Rollback
        except _Rollback:
            pass
        status = response.status_code
        seen.setdefault(target["name"], set()).add(status)
        where = f"POST {target['url']} ({target['name']}) as {target['role']} with {body!r}"
        assert status < 500, f"{where} answered {status}"
        # a created token or key is shown once on a 200 page (no redirect may carry a secret)
        shown_secret = status == 200 and re.search(rb"\b(atp|atr)_[A-Za-z0-9_-]{20,}", response.content)
        if status != 302 and not shown_secret:
            grew = {t: (baseline[t], after[t]) for t in baseline if after[t] != baseline[t] and t not in MAY_GROW}
            assert not grew, f"{where} answered {status} but changed rows: {grew}"
            if target["role"] not in ("platform_admin", "security_admin", "ops_engineer") and status == 200:
                found = other_names.search(response.content.decode())
                assert not found, f"{where} shows the other tenant's {found.group(0)!r}"

    return post_garbage


@pytest.fixture
def world(org, make_user, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    return build_world(org, make_user)


def test_every_form_refuses_garbage_cleanly_and_saves_nothing(world):
    all_targets = targets(world)
    assert len(all_targets) >= 20, [t["name"] for t in all_targets]
    foreign = foreign_ids(world)
    other_names = re.compile(r"\bbeta\b|beta-secret-job", re.IGNORECASE)
    clients = {}
    seen: dict[str, set[int]] = {}
    for target in all_targets:
        role = target["role"]
        clients.setdefault(role, client_for(world.users[role]))
        client = clients[role]
        baseline = row_counts()

        _fuzzer(target, client, baseline, body_strategy(target["body"], foreign), seen, other_names)()
    # the fuzzing reached the forms (not only the permission check) for most targets
    reached = [n for n, statuses in seen.items() if statuses & {200, 302, 400}]
    assert len(reached) >= len(all_targets) - 2, seen


# --- the gateway ------------------------------------------------------------------------------


@pytest.fixture
def gateway(world):
    """A published chat service of alpha-p and a key for it (upstream unreachable: nothing
    below may reach it)."""
    from serving import services as svc

    org = world.org
    tadmin, user = org.people["alpha"]["admin"], org.people["alpha"]["user"]
    service = svc.create_model_service(tadmin, project=org.projects["alpha"], slug="chat", name="Chat",
                                       base_model="m", spec=org.specs["l4half"], priority_class=org.prio["batch"],
                                       upstream_url="http://127.0.0.1:9/v1")
    svc.publish_service(tadmin, service)
    _key, secret = svc.create_api_key(user, project=org.projects["alpha"], name="fuzz", services=[service])
    return {"Authorization": f"Bearer {secret}"}


GATEWAY_BAD = [
    ("{not json", "application/json", 400),
    ("[1, 2]", "application/json", 400),
    ('"just a string"', "application/json", 400),
    ("null", "application/json", 400),
    ("", "application/json", (400, 415)),  # the test client sends no content type with an empty body
    ('{"model": "chat", "messages": "hi"}', "application/json", 400),
    ('{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}', "text/plain", 415),
    ('{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}', "application/x-www-form-urlencoded", 415),
    ('{"model": "chat"}', "application/json", 400),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "application/json", 400),
    ('{"model": 7, "messages": [{"role": "user", "content": "hi"}]}', "application/json", 400),
    ('{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}', "application/json", 400),
    ('{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}', "application/json", 400),
    ('{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999999999999999999999}',
     "application/json", 400),
    ('{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "lots"}', "application/json", 400),
    ('{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": [1]}', "application/json", 400),
    ('{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "application/json", 400),
    ('{"model": "chat", "messages": [' + "[" * 5000 + "]" * 5000 + "]}", "application/json", 400),
]


@pytest.mark.parametrize("raw,content_type,want", GATEWAY_BAD, ids=range(len(GATEWAY_BAD)))
def test_gateway_refuses_malformed_requests_in_openai_shape_without_calling_upstream(
        world, gateway, client, raw, content_type, want):
    from serving.models import GatewayRequest

    response = client.post("/v1/chat/completions", data=raw, content_type=content_type,
                           **{"HTTP_" + k.upper(): v for k, v in gateway.items()})
    assert response.status_code in (want if isinstance(want, tuple) else (want,)), (response.status_code, response.content[:300])
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert GatewayRequest.objects.count() == 0  # nothing metered, nothing proxied


def test_gateway_refuses_a_huge_body_with_413_even_without_content_length(world, gateway, client):
    huge = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "x" * (3 * 1024 * 1024)}]})
    response = client.post("/v1/chat/completions", data=huge, content_type="application/json",
                           HTTP_AUTHORIZATION=gateway["Authorization"])
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    # a client that lies about the length (says small, sends a lot) is cut at the limit too
    response = client.generic("POST", "/v1/chat/completions", huge.encode(), content_type="application/json",
                              HTTP_AUTHORIZATION=gateway["Authorization"], CONTENT_LENGTH="10")
    assert response.status_code in (400, 413)

"""The cross-tenant page matrix: every URL of the project, for every role, against two tenants.

The URL list is not written here: the test walks the project's resolver, so a new view is
covered (and fails with "add it to the matrix") without editing this file. Expectations come
from tenants/permission_matrix.yaml, the same file docs/permissions.md is generated from.
For every role it checks the exact status of each URL, that another tenant's objects answer
404, that no list or htmx fragment names another tenant, that state-changing views refuse
GET, and that every POST without a CSRF token is refused.
"""

from __future__ import annotations

import re
from copy import deepcopy

import pytest
from django.db import transaction
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from tenants import matrix
from tenants.tests.factories import build_world, client_for

TENANT_SCOPED = ("tenant_admin", "member", "finance_viewer", "project_admin", "project_user", "project_viewer")
PLATFORM = ("platform_admin", "ops_engineer", "security_admin", "finance", "auditor")
TENANT_KINDS = {"tenant", "project", "job", "membership", "project_membership"}
INVENTORY_KINDS = {"node", "card"}
OTHER_TENANT = re.compile(r"\bbeta\b", re.IGNORECASE)  # beta's slug, name, projects, people and jobs
ANY_TENANT = re.compile(r"\b(alpha|beta)\b", re.IGNORECASE)


def url_patterns(patterns=None, namespace: str = ""):
    """(name, pattern) of every URL of the project, namespaced, however deeply included."""
    patterns = get_resolver().url_patterns if patterns is None else patterns
    for p in patterns:
        if isinstance(p, URLResolver):
            ns = f"{namespace}{p.namespace}:" if p.namespace else namespace
            yield from url_patterns(p.url_patterns, ns)
        elif isinstance(p, URLPattern):
            yield (f"{namespace}{p.name}" if p.name else f"<unnamed {p.pattern}>"), p


class _Rollback(Exception):
    pass


def classify(response) -> str:
    if response.status_code in (301, 302):
        return "login" if response["Location"].split("?")[0] == reverse("login") else "302"
    return str(response.status_code)


def fill(data: dict, objects: dict) -> dict:
    out = {}
    for key, value in (data or {}).items():
        m = re.fullmatch(r"\{(\w+)\}", str(value))
        out[key] = str(objects[m.group(1)].pk) if m else value
    return out


def request(client, method: str, url: str, data=None, **headers):
    """One request whose database changes are rolled back and whose cookies are restored, so
    each URL meets the same world (a POST that archives a project does not change the next)."""
    cookies = deepcopy(client.cookies)
    try:
        with transaction.atomic():
            response = getattr(client, method)(url, data or {}, **headers)
            raise _Rollback
    except _Rollback:
        pass
    client.cookies = cookies
    return response


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def world(org, make_user):
    return build_world(org, make_user)


def test_every_url_pattern_is_in_the_matrix():
    names = {name for name, _ in url_patterns()}
    listed = set(matrix.urls())
    missing = sorted(names - listed)
    assert not missing, f"URL names without an entry in tenants/permission_matrix.yaml — add it to the matrix: {missing}"
    stale = sorted(listed - names)
    assert not stale, f"matrix entries for URLs that no longer exist: {stale}"


def test_matrix_kwargs_match_the_url_patterns():
    for name, pattern in url_patterns():
        if name not in matrix.urls():
            continue  # reported by test_every_url_pattern_is_in_the_matrix
        wanted = set(pattern.pattern.converters)
        given = set(matrix.urls()[name].get("kwargs", {}))
        assert wanted == given, f"{name}: the URL takes {sorted(wanted)}, the matrix fills {sorted(given)}"
        spec = matrix.urls()[name]
        assert spec.get("get") or spec.get("post") or spec.get("post_only"), f"{name}: no expectation"
        if spec.get("post_only"):
            assert "get" not in spec and "post" in spec, f"{name}: a post-only URL states its POST statuses only"


def test_every_matrix_role_is_a_role_of_the_organisation():
    from tenants.roles import ROLES

    # the matrix names people by the role they hold; each role of tenants/roles.py is covered
    covered = {"project_user": "user", "project_viewer": "viewer"}
    named = {covered.get(r, r) for r in matrix.roles()}
    assert set(ROLES) <= named, f"roles missing from the matrix: {sorted(set(ROLES) - named)}"


@pytest.mark.parametrize("role", matrix.roles())
def test_each_role_gets_exactly_what_the_matrix_says(role, world):
    client = client_for(world.users[role])
    problems: list[str] = []
    leak = ANY_TENANT if role.startswith("vendor") else OTHER_TENANT if role in TENANT_SCOPED else None
    for name, spec in matrix.urls().items():
        kinds = spec.get("kwargs", {})
        url = reverse(name, kwargs={k: world.own[kind].pk for k, kind in kinds.items()})
        for method in matrix.METHODS:
            want = matrix.expected(name, method, role)
            if want is None:
                continue
            data = fill(spec.get("data"), world.own) if method == "post" else None
            response = request(client, method, url, data)
            got = classify(response)
            if got != want:
                problems.append(f"{method.upper()} {url} ({name}) as {role}: got {got}, the matrix says {want}")
            if method == "get" and got == "200" and leak is not None:
                for headers in ({}, {"HTTP_HX_REQUEST": "true"}):
                    page = request(client, "get", url, **headers)
                    found = leak.search(page.content.decode())
                    if found:
                        where = "fragment" if headers else "page"
                        problems.append(f"GET {url} ({name}, {where}) as {role} names {found.group(0)!r}")
        # the other tenant's objects (and, for a vendor, nodes outside the work order) do not exist
        foreign = set(kinds.values()) & (TENANT_KINDS | (INVENTORY_KINDS if role == "vendor" else set()))
        if foreign and (role in TENANT_SCOPED or role == "vendor"):
            other = reverse(name, kwargs={k: world.other[kind].pk for k, kind in kinds.items()})
            method = "post" if spec.get("post_only") else "get"
            got = classify(request(client, method, other, fill(spec.get("data"), world.own)))
            if got != "404":
                problems.append(f"{method.upper()} {other} ({name}, other tenant's object) as {role}: got {got}, want 404")
        # a platform role reaches both tenants alike
        if set(kinds.values()) & TENANT_KINDS and role in PLATFORM and not spec.get("post_only"):
            other = reverse(name, kwargs={k: world.other[kind].pk for k, kind in kinds.items()})
            got, want = classify(request(client, "get", other)), matrix.expected(name, "get", role)
            if got != want:
                problems.append(f"GET {other} ({name}, beta) as {role}: got {got}, alpha's answers {want}")
    assert not problems, "\n".join(problems)


def _acting_role(name: str) -> str:
    """A role the matrix lets through this POST, so a 403 can only come from the CSRF check."""
    for role in matrix.roles():
        if matrix.expected(name, "post", role) in ("200", "302", "400", "login") and role != "vendor_expired":
            return role
    return "platform_admin"


def test_state_changing_views_refuse_get_and_posts_without_a_csrf_token(world):
    problems = []
    for name, spec in matrix.urls().items():
        url = reverse(name, kwargs={k: world.own[kind].pk for k, kind in spec.get("kwargs", {}).items()})
        if spec.get("post_only"):
            got = request(client_for(world.org.admin), "get", url).status_code
            if got != 405:
                problems.append(f"GET {url} ({name}) changes state but answered {got}, not 405")
        if "post" not in spec:
            continue
        role = _acting_role(name)
        client = client_for(world.users[role], enforce_csrf_checks=True)
        response = request(client, "post", url, fill(spec.get("data"), world.own))
        if response.status_code != 403 or b"CSRF" not in response.content:
            problems.append(f"POST {url} ({name}) as {role} without a CSRF token answered {response.status_code}")
    assert not problems, "\n".join(problems)

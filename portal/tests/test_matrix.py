"""The cross-tenant page matrix: every URL of the project, for every role, against two tenants.

The URL list is not written here: the test walks the project's resolver, so a new view is
covered (and fails with "add it to the matrix") without editing this file. Expectations come
from tenants/permission_matrix.yaml, the same file docs/permissions.md is generated from.
For every role it checks the exact status of each URL, that another tenant's objects answer
404, that no list or htmx fragment names another tenant, that state-changing views refuse
GET, and that every POST without a CSRF token is refused.

URLs that are not session pages (the JSON API, the key-authenticated /v1/ gateway) are left
out only through the matrix's explicit `covered_elsewhere` list, whose named tests must exist.
"""

from __future__ import annotations

import datetime as dt
import re
import warnings
from copy import deepcopy
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import transaction
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from tenants import matrix
from tenants.tests.factories import build_world, client_for

TENANT_SCOPED = ("tenant_admin", "member", "finance_viewer", "project_admin", "project_user", "project_viewer")
PLATFORM = ("platform_admin", "ops_engineer", "security_admin", "finance", "auditor")
# kinds owned by a tenant (or, for a personal token, by one of its people): beta's answer 404
TENANT_KINDS = {"tenant", "project", "job", "membership", "project_membership", "report", "budget",
                "model_service", "knowledge_base", "api_key", "token"}
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
        if str(value).startswith("@file "):
            name = str(value).split(" ", 1)[1]
            out[key] = SimpleUploadedFile(name, b"# Matrix notes\n\nA short document.\n", content_type="text/markdown")
        else:
            out[key] = re.sub(r"\{(\w+)\}", lambda m: str(objects[m.group(1)].pk), str(value))
    return out


def url_for(name: str, objects: dict) -> str:
    kinds, literals = matrix.kwargs_of(name)
    return reverse(name, kwargs={**{k: objects[kind].pk for k, kind in kinds.items()}, **literals})


def text_of(response) -> str:
    # a download streams; its bytes are searched like a page's
    raw = b"".join(response.streaming_content) if response.streaming else response.content
    return raw.decode(errors="replace")


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
def world(org, make_user, settings, tmp_path):
    settings.MEDIA_ROOT = str(tmp_path)  # report files
    w = build_world(org, make_user)
    add_usage_serving_and_tokens(w)
    return w


def add_usage_serving_and_tokens(w) -> None:
    """Per tenant, through the apps' services: a priced, rolled-up day of usage, a built report
    and a project budget (metering); a model service, a knowledge base with a document, an
    application and an API key (serving); a personal access token of the project user (api).
    Every name carries the tenant's slug, so a leak shows up as the word "beta"."""
    from api import tokens
    from metering import services as metering
    from portal import context
    from scheduling.models import Accelerator, Binding, Job, JobState
    from serving import services as serving

    org = w.org
    with context.bound(sudo=True):
        metering.set_price(org.admin, accelerator_model=org.models["h100"], per_card_hour=Decimal("2.00"),
                           effective_from=dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
    day = metering.day_start(dt.date.today() - dt.timedelta(days=3))
    card = Accelerator.objects.filter(model=org.models["h100"]).order_by("pk").first()
    for slug, bucket in (("alpha", w.own), ("beta", w.other)):
        people, project, tenant = org.people[slug], org.projects[slug], org.tenants[slug]
        # a finished job's binding as the scheduler leaves it (the metering tests do the same)
        start = day + dt.timedelta(hours=9 if slug == "alpha" else 14)
        job = Job.objects.create(tenant=tenant, project=project, submitter=people["user"], name=f"{slug}-done-job",
                                 spec=org.specs["h1"], priority_class=org.prio["batch"], image="busybox",
                                 state=JobState.SUCCEEDED, submitted=start, started=start,
                                 finished=start + dt.timedelta(hours=4))
        Binding.objects.create(job=job, accelerator=card, tenant=tenant, project=project, start=start,
                               end=start + dt.timedelta(hours=4))
    metering.rollup(day.date(), dt.date.today())  # before the reports, so they have lines to leak
    for slug, bucket in (("alpha", w.own), ("beta", w.other)):
        people, project, tenant = org.people[slug], org.projects[slug], org.tenants[slug]
        service = serving.create_model_service(
            people["admin"], project=project, slug="chat", name=f"{slug} chat", base_model=f"{slug}-llm",
            spec=org.specs["l4half"], priority_class=org.prio["batch"], upstream_url="http://127.0.0.1:9")
        kb = serving.create_knowledge_base(people["admin"], tenant=tenant, slug="handbook", name=f"{slug} handbook",
                                           projects=[project])
        serving.upload_document(people["user"], kb, filename=f"{slug}-policy.md", content_type="text/markdown",
                                data=f"# {slug} policy\n\nThe {slug} approval form is kept in the {slug} wiki.".encode())
        serving.create_application(people["user"], project=project, slug="helpdesk", name=f"{slug} helpdesk",
                                   service=service, knowledge_bases=[kb])
        key, _ = serving.create_api_key(people["user"], project=project, name=f"{slug} key", services=[service],
                                        knowledge_bases=[kb])
        token, _ = tokens.create_token(people["user"], name=f"{slug} laptop", scope="read", days=30)
        budget = metering.set_budget(people["admin"], tenant=tenant, project=project, amount=Decimal("100"))
        report = metering.request_report(people["admin"], tenant=tenant, period_start=day.date().replace(day=1),
                                         period_end=dt.date.today() + dt.timedelta(days=1), grouping="project",
                                         mode="showback", enqueue=False)
        metering.build_report(report.pk)
        bucket.update(report=report, budget=budget, model_service=service, knowledge_base=kb, api_key=key, token=token)
    w.own.update(spec=org.specs["h1"], priority_class=org.prio["batch"])


def test_every_url_pattern_is_in_the_matrix():
    names = {name for name, _ in url_patterns()}
    listed = set(matrix.urls())
    elsewhere = {n for n in names if matrix.covered_by(n)}
    missing = sorted(names - listed - elsewhere)
    assert not missing, f"URL names without an entry in tenants/permission_matrix.yaml — add it to the matrix: {missing}"
    stale = sorted(listed - names)
    assert not stale, f"matrix entries for URLs that no longer exist: {stale}"
    both = sorted(listed & elsewhere)
    assert not both, f"URLs both in the matrix and covered_elsewhere (pick one): {both}"
    unused = sorted(p for p in matrix.covered_elsewhere() if not any(matrix.covered_by(n) == [p] for n in names))
    assert not unused, f"covered_elsewhere patterns matching no URL (or only together with another pattern): {unused}"


def test_urls_covered_elsewhere_name_tests_that_exist(org):
    root = Path(django_settings.BASE_DIR)
    problems = []
    assert matrix.covered_elsewhere(), "the API and gateway exclusions are expected to be listed"
    for pattern, entry in matrix.covered_elsewhere().items():
        if not str(entry.get("why", "")).strip() or not entry.get("tests"):
            problems.append(f"{pattern}: say why and name the tests that cover it")
        for ref in entry.get("tests", []):
            path, _, func = ref.partition("::")
            source = root / path
            if not source.is_file():
                problems.append(f"{pattern}: {path} does not exist")
            elif func and not re.search(rf"^def {re.escape(func)}\(", source.read_text(), re.MULTILINE):
                problems.append(f"{pattern}: {path} has no test {func}")
    # a session never opens the gateway: it answers as to anyone without a key
    response = client_for(None).get("/v1/models")
    signed_in = client_for(org.admin).get("/v1/models")
    if signed_in.status_code != response.status_code or response.status_code != 401:
        problems.append(f"/v1/models: anonymous {response.status_code}, with a session {signed_in.status_code}, want 401")
    assert not problems, "\n".join(problems)


def test_matrix_kwargs_match_the_url_patterns():
    for name, pattern in url_patterns():
        if name not in matrix.urls():
            continue  # reported by test_every_url_pattern_is_in_the_matrix
        wanted = set(pattern.pattern.regex.groupindex)  # named groups: converters and re_path groups alike
        kinds, literals = matrix.kwargs_of(name)
        given = set(kinds) | set(literals)
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
    known: list[str] = []
    for name, spec in matrix.urls().items():
        kinds = spec.get("kwargs", {})
        url = url_for(name, world.own)
        for method in matrix.METHODS:
            want = matrix.expected(name, method, role)
            if want is None:
                continue
            data = fill(spec.get("data"), world.own) if method == "post" else None
            response = request(client, method, url, data)
            got = classify(response)
            case = f"{method.upper()} {url} ({name}) as {role}: got {got}, the matrix says {want}"
            reason = matrix.xfail(name, method, role)
            if reason and got == want:
                problems.append(f"{case} — fixed: remove its xfail from the matrix")
            elif reason:
                known.append(f"{case} (xfail: {reason})")
            elif got != want:
                problems.append(case)
            if method == "get" and got == "200" and leak is not None:
                for headers in ({}, {"HTTP_HX_REQUEST": "true"}):
                    page = request(client, "get", url, **headers)
                    found = leak.search(text_of(page))
                    if found:
                        where = "fragment" if headers else "page"
                        problems.append(f"GET {url} ({name}, {where}) as {role} names {found.group(0)!r}")
        # the other tenant's objects (and, for a vendor, nodes outside the work order) do not exist
        foreign = set(kinds.values()) & (TENANT_KINDS | (INVENTORY_KINDS if role == "vendor" else set()))
        if foreign and (role in TENANT_SCOPED or role == "vendor"):
            other = url_for(name, world.other)
            method = "post" if spec.get("post_only") else "get"
            got = classify(request(client, method, other, fill(spec.get("data"), world.own)))
            if got != "404":
                problems.append(f"{method.upper()} {other} ({name}, other tenant's object) as {role}: got {got}, want 404")
        # a platform role reaches both tenants alike
        if set(kinds.values()) & TENANT_KINDS and role in PLATFORM and not spec.get("post_only"):
            other = url_for(name, world.other)
            got, want = classify(request(client, "get", other)), matrix.expected(name, "get", role)
            if got != want:
                problems.append(f"GET {other} ({name}, beta) as {role}: got {got}, alpha's answers {want}")
    for case in known:
        warnings.warn(f"known gap of the page matrix: {case}", stacklevel=1)
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
        url = url_for(name, world.own)
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

"""Schemathesis against a live server: every operation of /api/v1/openapi.json, called over real
HTTP with a tenant admin's admin-scope token, must answer no 5xx and only what the schema says
(status code, content type, headers and body).

Each operation gets one hand-written case that reaches its success answer (a job that exists,
a report that is built, a token that may be revoked...) and a bounded number of generated
cases, positive and negative. The schema is read from the live server, so a new route is
fuzzed without editing this test. This test must never relax a check to make a route pass:
a mismatch is a bug in the route or in its documented schema.
"""

from __future__ import annotations

import datetime as dt
import os
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
# Generated examples per operation and mode. `make test` runs the default, derandomized, so it
# is reproducible; ATRIUM_SCHEMATHESIS_EXAMPLES=200 ATRIUM_SCHEMATHESIS_BUDGET=600 is a deeper,
# random local run.
EXAMPLES = int(os.environ.get("ATRIUM_SCHEMATHESIS_EXAMPLES", "8"))
# make test must stay well under 90 s on a busy machine; the fuzzing itself gets at most this much
BUDGET_SECONDS = int(os.environ.get("ATRIUM_SCHEMATHESIS_BUDGET", "60"))
# the budget is checked before each operation's batch, so the last batch may run over by this
# much (make fuzz, with hundreds of examples per batch, allows more)
OVERRUN_SECONDS = int(os.environ.get("ATRIUM_SCHEMATHESIS_OVERRUN", "15"))
# Shrinking is left out so that a failure costs seconds, not minutes.
HYPOTHESIS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                      derandomize="ATRIUM_SCHEMATHESIS_EXAMPLES" not in os.environ,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.fixture
def world(transactional_db, org, issue, settings):
    """The objects the hand-written cases point at, all inside alpha, and the caller's token."""
    from metering import services as metering
    from scheduling import services as sched
    from serving import services as serving

    # the fuzzer makes hundreds of changes in a minute; the rate limit has its own test
    settings.ATRIUM_API_RATE_LIMIT = "100000/60"
    admin = org.people["alpha"]["admin"]

    def job(name):
        return sched.submit_job(admin, project=org.projects["alpha"], spec=org.specs["h1"],
                                priority_class=org.prio["batch"], name=name, image="busybox", command=["sleep", "60"])

    report = metering.request_report(admin, period_start=dt.date(2026, 1, 1), period_end=dt.date(2026, 2, 1),
                                     grouping="project", mode="showback", tenant=org.tenants["alpha"], enqueue=False)
    metering.build_report(report.pk)
    own, secret = issue(admin, "admin", name="schemathesis")
    spare, _ = issue(admin, "read", name="to-revoke")
    key_to_rotate, _ = serving.create_api_key(admin, project=org.projects["alpha"], name="to-rotate")
    key_to_revoke, _ = serving.create_api_key(admin, project=org.projects["alpha"], name="to-revoke")
    return {"own": own, "secret": secret, "spare": spare, "job": job("kept"), "to_cancel": job("to-cancel"),
            "project": org.projects["alpha"], "report": report, "key_to_rotate": key_to_rotate,
            "key_to_revoke": key_to_revoke}


def known_good(world) -> dict[tuple[str, str], dict]:
    """(METHOD, path) -> the arguments of a case that succeeds (2xx)."""
    job_body = {"project": "alpha/alpha-p", "spec": "h100 x1", "priority_class": "batch", "image": "busybox",
                "command": ["python", "train.py"]}
    return {
        ("GET", "/api/v1/usage"): {"query": {"month": "2026-01"}},
        ("GET", "/api/v1/jobs/{job_id}"): {"path_parameters": {"job_id": world["job"].pk}},
        ("POST", "/api/v1/jobs"): {"body": job_body, "media_type": "application/json"},
        ("POST", "/api/v1/jobs/{job_id}/cancel"): {"path_parameters": {"job_id": world["to_cancel"].pk},
                                                   "body": {"reason": "schemathesis"}, "media_type": "application/json"},
        ("GET", "/api/v1/projects/{project_id}/priority-classes"): {"path_parameters": {"project_id": world["project"].pk}},
        ("POST", "/api/v1/tokens"): {"body": {"name": "fuzz", "scope": "read"}, "media_type": "application/json"},
        ("DELETE", "/api/v1/tokens/{token_id}"): {"path_parameters": {"token_id": world["spare"].pk}},
        ("POST", "/api/v1/reports"): {"body": {"period_start": "2026-01-01", "period_end": "2026-02-01", "tenant": "alpha"},
                                      "media_type": "application/json"},
        ("GET", "/api/v1/reports/{report_id}"): {"path_parameters": {"report_id": world["report"].pk}},
        ("GET", "/api/v1/reports/{report_id}/download"): {"path_parameters": {"report_id": world["report"].pk},
                                                          "query": {"format": "csv"}},
        ("GET", "/api/v1/projects/{project_id}/api-keys"): {"path_parameters": {"project_id": world["project"].pk}},
        ("POST", "/api/v1/projects/{project_id}/api-keys"): {"path_parameters": {"project_id": world["project"].pk},
                                                            "body": {"name": "fuzz"}, "media_type": "application/json"},
        ("POST", "/api/v1/api-keys/{key_id}/rotate"): {"path_parameters": {"key_id": world["key_to_rotate"].pk}},
        ("POST", "/api/v1/api-keys/{key_id}/revoke"): {"path_parameters": {"key_id": world["key_to_revoke"].pk},
                                                      "body": {"reason": "schemathesis"}, "media_type": "application/json"},
    }


def test_every_operation_conforms_to_the_schema_over_http(world, live_server):
    from api.models import PersonalAccessToken

    started = time.monotonic()
    auth = {"Authorization": f"Bearer {world['secret']}"}
    schema = schemathesis.openapi.from_url(f"{live_server.url}/api/v1/openapi.json", headers=auth, timeout=30)
    good = known_good(world)
    own_id = world["own"].pk
    failures, covered, succeeded = [], set(), set()

    for result in schema.get_all_operations():
        operation = result.ok()  # an operation the schema itself gets wrong raises here
        key = (operation.method.upper(), operation.path if operation.path.startswith("/api/") else
               f"/api/v1{operation.path}")
        covered.add(key)
        # 1. the hand-written case: the success answer must conform too
        case = operation.Case(headers=auth, **good.get(key, {}))
        try:
            response = case.call_and_validate(base_url=schema.get_base_url(), checks=CHECKS, timeout=30)
            if response.status_code < 300:
                succeeded.add(key)
        except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collect every failure, report them together
            failures.append(f"{key} known-good case: {exc}")

        # 2. generated cases; never let the fuzzer revoke the token it is calling with. An operation
        # without parameters or body has nothing to make invalid: it gets positive cases only.
        has_input = any(len(c) for c in (operation.path_parameters, operation.query, operation.body))
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,)
        for mode in modes:
            if time.monotonic() - started > BUDGET_SECONDS:
                break
            strategy = operation.as_strategy(generation_mode=mode, headers=auth).filter(
                lambda c: c.path_parameters is None or c.path_parameters.get("token_id") != own_id)

            @HYPOTHESIS
            @given(case=strategy)
            def fuzz(case):
                case.headers = {**(case.headers or {}), **auth}
                case.call_and_validate(base_url=schema.get_base_url(), checks=CHECKS, timeout=30)

            try:
                fuzz()
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - schemathesis raises a FailureGroup
                failures.append(f"{key} {mode.value}: {exc}")

    elapsed = time.monotonic() - started
    assert not failures, "\n\n".join(failures)
    # the run really exercised the API: every route was reached, and each hand-written case succeeded
    assert len(covered) >= 17, sorted(covered)
    assert set(good) <= covered, set(good) - covered
    assert succeeded == covered, sorted(covered - succeeded)
    assert PersonalAccessToken.objects.get(pk=own_id).revoked is None
    assert elapsed < BUDGET_SECONDS + OVERRUN_SECONDS, f"schemathesis took {elapsed:.0f} s"


# --- what schemathesis found, pinned as plain tests --------------------------------------------


@pytest.mark.parametrize("where", ["body", "command", "query-jobs", "query-audit", "query-quotas", "query-usage"])
def test_a_nul_character_is_a_validation_error_not_a_server_error(org, issue, where):
    # PostgreSQL refuses NUL in text and jsonb; Django's form fields reject it, the API must too
    from api.tests.conftest import bearer

    client = bearer(issue(org.people["alpha"]["admin"], "admin")[1])
    body = {"project": "alpha-p", "spec": "h100 x1", "priority_class": "batch", "image": "busybox", "command": ["true"]}
    if where == "body":
        response, field = client.post("/api/v1/jobs", {**body, "project": "alpha\x00p"},
                                      content_type="application/json"), "project"
    elif where == "command":
        response, field = client.post("/api/v1/jobs", {**body, "command": ["a\x00b"]},
                                      content_type="application/json"), "command.0"
    elif where == "query-jobs":
        response, field = client.get("/api/v1/jobs", {"q": "x\x00"}), "q"
    elif where == "query-audit":
        response, field = client.get("/api/v1/audit-events", {"action": "job.\x00"}), "action"
    elif where == "query-quotas":
        response, field = client.get("/api/v1/quotas", {"tenant": "\x00"}), "tenant"
    else:
        response, field = client.get("/api/v1/usage", {"month": "2026-01", "tenant": "\x00"}), "tenant"
    assert response.status_code == 422, (response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/problem+json")
    assert [e["field"] for e in response.json()["errors"]] == [field]
    assert not org.projects["alpha"].jobs.exists()


@pytest.mark.parametrize("field, value", [("project", "³"), ("spec", "²"), ("project", "9" * 30), ("spec", "9" * 30)])
def test_a_reference_that_only_looks_numeric_is_a_validation_error(org, issue, field, value):
    # "³".isdigit() is true but int("³") fails: found by schemathesis as a 500 on POST /jobs
    from api.tests.conftest import bearer

    client = bearer(issue(org.people["alpha"]["user"], "submit")[1])
    body = {"project": "alpha-p", "spec": "h100 x1", "priority_class": "batch", "image": "busybox", "command": ["true"]}
    response = client.post("/api/v1/jobs", {**body, field: value}, content_type="application/json")
    assert response.status_code == 422, (response.status_code, response.content[:300])
    assert [e["field"] for e in response.json()["errors"]] == [field]

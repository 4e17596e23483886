"""The API keys of a project over the JSON API: list, create, rotate and revoke with a token;
the secret only in the create/rotate answer; another tenant's project or key is a 404 like a
missing one; a viewer is refused (403); a read token cannot change; one audit event per change."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from api.tests.conftest import bearer
from api.tests.test_api import problem
from portal.models import AuditEvent
from serving import keys as keymat
from serving import services as svc
from serving.models import ApiKey

V1 = "/api/v1"


@pytest.fixture
def chat(org):
    """A model service of each tenant's project (never started: the API only names it)."""
    out = {}
    for slug in ("alpha", "beta"):
        out[slug] = svc.create_model_service(
            org.people[slug]["admin"], project=org.projects[slug], slug="chat", name=f"{slug} chat",
            base_model=f"{slug}-llm", spec=org.specs["l4half"], priority_class=org.prio["batch"],
            upstream_url="http://127.0.0.1:9",
        )
    return out


@pytest.fixture
def beta_key(org, chat):
    return svc.create_api_key(org.people["beta"]["admin"], project=org.projects["beta"], name="beta-key",
                              services=[chat["beta"]])[0]


def audits(action: str) -> int:
    """Successful changes audited under `action` (refusals are audited too, as "denied")."""
    return AuditEvent.objects.filter(action=action, outcome="success").count()


def test_create_list_rotate_revoke_with_a_token(org, issue, chat):
    user = org.people["alpha"]["user"]  # a project user manages the project's keys
    client = bearer(issue(user, "admin")[1])
    project = org.projects["alpha"]
    expires = (timezone.now() + dt.timedelta(days=10)).replace(microsecond=0)

    created = client.post(f"{V1}/projects/{project.pk}/api-keys",
                          {"name": "ci", "services": [chat["alpha"].pk], "expires": expires.isoformat()},
                          content_type="application/json")
    assert created.status_code == 201, created.content
    body = created.json()
    secret, key = body["secret"], body["key"]
    assert secret.startswith(key["prefix"]) and len(secret) > len(key["prefix"])
    assert key["name"] == "ci" and key["state"] == "active" and key["revoked"] is None
    assert key["services"] == [{"id": chat["alpha"].pk, "slug": "chat"}] and key["knowledge_bases"] == []
    assert dt.datetime.fromisoformat(key["expires"]) == expires
    row = ApiKey.objects.get(pk=key["id"])
    assert row.digest == keymat.digest(secret) and row.created_by == user
    assert audits("apikey.create") == 1

    listed = client.get(f"{V1}/projects/{project.pk}/api-keys")
    assert listed.status_code == 200
    assert [k["id"] for k in listed.json()] == [key["id"]]
    assert secret not in listed.content.decode() and row.digest not in listed.content.decode()
    assert set(listed.json()[0]) == set(key)  # the same shape, no secret or digest field

    rotated = client.post(f"{V1}/api-keys/{key['id']}/rotate")
    assert rotated.status_code == 201, rotated.content
    new_secret, new = rotated.json()["secret"], rotated.json()["key"]
    assert new["id"] != key["id"] and new_secret != secret and new_secret.startswith(new["prefix"])
    assert new["services"] == key["services"]
    assert audits("apikey.rotate") == 1 and ApiKey.objects.count() == 2
    listed = client.get(f"{V1}/projects/{project.pk}/api-keys").json()
    old = next(k for k in listed if k["id"] == key["id"])
    assert old["state"] == "rotating out" and old["replaced_by"] == new["id"]
    assert new_secret not in str(listed) and secret not in str(listed)
    problem(client.post(f"{V1}/api-keys/{key['id']}/rotate"), 409, "conflict")  # rotated once only
    assert audits("apikey.rotate") == 1

    revoked = client.post(f"{V1}/api-keys/{new['id']}/revoke", {"reason": "leaked"}, content_type="application/json")
    assert revoked.status_code == 200, revoked.content
    assert revoked.json()["state"] == "revoked" and "secret" not in revoked.json()
    assert ApiKey.objects.get(pk=new["id"]).revoked is not None
    assert AuditEvent.objects.get(action="apikey.revoke").reason == "leaked"
    problem(client.post(f"{V1}/api-keys/{new['id']}/revoke", {}, content_type="application/json"), 409, "conflict")
    assert audits("apikey.revoke") == 1


def test_create_refuses_a_service_of_another_tenant_and_a_past_expiry(org, issue, chat):
    client = bearer(issue(org.people["alpha"]["admin"], "admin")[1])
    url = f"{V1}/projects/{org.projects['alpha'].pk}/api-keys"
    body = problem(client.post(url, {"name": "x", "services": [chat["beta"].pk]}, content_type="application/json"),
                   422, "validation-error")
    assert [e["field"] for e in body["errors"]] == ["services"] and "beta" not in str(body)
    past = (timezone.now() - dt.timedelta(days=1)).isoformat()
    problem(client.post(url, {"name": "x", "expires": past}, content_type="application/json"), 422, "validation-error")
    assert not ApiKey.objects.filter(project=org.projects["alpha"]).exists()
    assert audits("apikey.create") == 0


def test_another_tenants_project_or_key_is_a_404_like_a_missing_one(org, issue, beta_key):
    client = bearer(issue(org.people["alpha"]["admin"], "admin")[1])
    beta = org.projects["beta"].pk
    calls = [
        lambda pid: client.get(f"{V1}/projects/{pid}/api-keys"),
        lambda pid: client.post(f"{V1}/projects/{pid}/api-keys", {"name": "x"}, content_type="application/json"),
    ]
    for call in calls:
        foreign, absent = problem(call(beta), 404, "not-found"), problem(call(999_999), 404, "not-found")
        assert foreign["detail"] == absent["detail"]
    for action in ("rotate", "revoke"):
        foreign = problem(client.post(f"{V1}/api-keys/{beta_key.pk}/{action}", {}, content_type="application/json"),
                          404, "not-found")
        absent = problem(client.post(f"{V1}/api-keys/999999/{action}", {}, content_type="application/json"),
                         404, "not-found")
        assert foreign["detail"] == absent["detail"]
    beta_key.refresh_from_db()
    assert beta_key.revoked is None and beta_key.replaced_by_id is None
    assert ApiKey.objects.filter(project=org.projects["beta"]).count() == 1


def test_a_viewer_of_the_project_is_refused_with_403(org, issue, chat):
    key, _ = svc.create_api_key(org.people["alpha"]["admin"], project=org.projects["alpha"], name="k")
    client = bearer(issue(org.people["alpha"]["viewer"], "admin")[1])
    pid = org.projects["alpha"].pk
    problem(client.get(f"{V1}/projects/{pid}/api-keys"), 403, "forbidden")
    problem(client.post(f"{V1}/projects/{pid}/api-keys", {"name": "x"}, content_type="application/json"),
            403, "forbidden")
    problem(client.post(f"{V1}/api-keys/{key.pk}/rotate"), 403, "forbidden")
    problem(client.post(f"{V1}/api-keys/{key.pk}/revoke", {}, content_type="application/json"), 403, "forbidden")
    key.refresh_from_db()
    assert key.revoked is None and key.replaced_by_id is None
    assert ApiKey.objects.count() == 1
    # the service audits each refusal; no change event was written
    assert AuditEvent.objects.filter(action__startswith="apikey.", outcome="denied").count() == 3
    assert audits("apikey.rotate") == audits("apikey.revoke") == 0


def test_a_read_token_lists_but_cannot_change(org, issue):
    key, _ = svc.create_api_key(org.people["alpha"]["admin"], project=org.projects["alpha"], name="k")
    client = bearer(issue(org.people["alpha"]["admin"], "read")[1])
    pid = org.projects["alpha"].pk
    assert [k["id"] for k in client.get(f"{V1}/projects/{pid}/api-keys").json()] == [key.pk]
    problem(client.post(f"{V1}/projects/{pid}/api-keys", {"name": "x"}, content_type="application/json"),
            403, "insufficient-scope")
    problem(client.post(f"{V1}/api-keys/{key.pk}/rotate"), 403, "insufficient-scope")
    problem(client.post(f"{V1}/api-keys/{key.pk}/revoke", {}, content_type="application/json"),
            403, "insufficient-scope")
    key.refresh_from_db()
    assert key.revoked is None and ApiKey.objects.count() == 1
    assert audits("apikey.create") == 1  # only the fixture's own

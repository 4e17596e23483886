"""API keys are shown once and stored only as a keyed hash; key management and service
publication are audited exactly once; a published service runs as a scheduling job."""

from __future__ import annotations

import hashlib
import hmac
import re

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connection

from conftest import PASSWORD
from portal.models import AuditEvent
from scheduling.models import Job, JobState
from serving import keys as keymat
from serving import services as svc
from serving.models import ApiKey, ServiceStatus


def test_key_format_has_at_least_128_bits_and_only_the_hmac_is_stored(world):
    w = world
    secret = w.secret["alpha"]
    assert secret.startswith("atr_") and len(secret) - 4 >= 43  # 32 random bytes, urlsafe base64
    key = ApiKey.objects.get(pk=w.key["alpha"].pk)
    expected = hmac.new(keymat.server_secret(), secret.encode(), hashlib.sha256).hexdigest()
    assert key.digest == expected
    assert key.digest != hashlib.sha256(secret.encode()).hexdigest()  # keyed, not a plain hash
    with connection.cursor() as cur:
        cur.execute("SELECT * FROM serving_apikey WHERE id = %s", [key.pk])
        row = cur.fetchone()
    assert not any(secret in str(v) for v in row)
    assert key.prefix == secret[:12]
    for event in AuditEvent.objects.filter(action__startswith="apikey."):
        assert secret not in f"{event.before} {event.after} {event.target_label} {event.reason}"


def test_key_create_page_shows_the_secret_once(world, client):
    w = world
    assert client.login(username="alpha-user", password=PASSWORD)
    resp = client.post("/serving/keys/new/", {"project": w.org.projects["alpha"].pk, "name": "page key",
                                               "services": [w.service["alpha"].pk]})
    assert resp.status_code == 200
    html = resp.content.decode()
    secret = re.search(r'id="api-key-secret">(atr_[A-Za-z0-9_-]+)<', html).group(1)
    assert resp["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(name="page key")
    assert keymat.matches(secret, key.digest)
    assert AuditEvent.objects.filter(action="apikey.create", target_id=str(key.pk)).count() == 1
    for url in (f"/serving/keys/{key.pk}/", "/serving/keys/"):
        page = client.get(url)
        assert page.status_code == 200 and secret not in page.content.decode() and key.prefix in page.content.decode()


def test_key_create_rotate_revoke_write_exactly_one_audit_event_each(world):
    w = world
    user = w.org.people["alpha"]["user"]
    before = AuditEvent.objects.count()
    key, _ = svc.create_api_key(user, project=w.org.projects["alpha"], name="k")
    new, _ = svc.rotate_api_key(user, key)
    svc.revoke_api_key(user, new, reason="test")
    actions = list(AuditEvent.objects.order_by("id").values_list("action", flat=True)[before:])
    assert actions == ["apikey.create", "apikey.rotate", "apikey.revoke"]


def test_viewer_cannot_create_keys_and_other_tenant_cannot_revoke(world):
    w = world
    with pytest.raises(PermissionDenied):
        svc.create_api_key(w.org.people["alpha"]["viewer"], project=w.org.projects["alpha"], name="v")
    with pytest.raises(PermissionDenied):
        svc.revoke_api_key(w.org.people["beta"]["admin"], w.key["alpha"])
    assert ApiKey.objects.get(pk=w.key["alpha"].pk).revoked is None


def test_key_scope_cannot_name_another_tenants_service(world):
    w = world
    with pytest.raises(ValidationError):
        svc.create_api_key(w.org.people["alpha"]["user"], project=w.org.projects["alpha"], name="x",
                           services=[w.service["beta"]])


def test_publication_is_audited_once_and_runs_as_a_service_job(org, up):
    admin = org.people["alpha"]["admin"]
    service = svc.create_model_service(admin, project=org.projects["alpha"], slug="llm", name="LLM",
                                       base_model="alpha-llm", spec=org.specs["l4half"], priority_class=org.prio["batch"],
                                       upstream_url=up.base_url, replicas=2)
    assert service.status == ServiceStatus.DRAFT and service.job is None
    svc.publish_service(admin, service)
    service.refresh_from_db()
    assert service.status == ServiceStatus.PUBLISHED
    assert service.job.kind == "service" and service.job.replicas == 2 and service.job.project == org.projects["alpha"]
    assert AuditEvent.objects.filter(action="service.publish", target_id=str(service.pk)).count() == 1
    with pytest.raises(ValidationError):
        svc.publish_service(admin, service)  # not twice
    assert AuditEvent.objects.filter(action="service.publish").count() == 1
    svc.retire_service(admin, service)
    service.refresh_from_db()
    assert service.status == ServiceStatus.RETIRED
    assert Job.objects.get(pk=service.job_id).state == JobState.CANCELLED
    assert AuditEvent.objects.filter(action="service.retire").count() == 1


def test_project_user_cannot_publish_and_other_tenant_cannot_see_draft(org, up):
    user = org.people["alpha"]["user"]
    service = svc.create_model_service(user, project=org.projects["alpha"], slug="draft", name="d",
                                       base_model="m", spec=org.specs["l4half"], priority_class=org.prio["batch"],
                                       upstream_url=up.base_url)
    with pytest.raises(PermissionDenied):
        svc.publish_service(user, service)
    assert not svc.services_for_user(org.people["beta"]["admin"]).filter(pk=service.pk).exists()
    assert svc.services_for_user(org.people["alpha"]["admin"]).filter(pk=service.pk).exists()
    assert AuditEvent.objects.filter(action="service.publish", outcome="success").count() == 0


def test_chunking_keeps_every_word_and_overlaps():
    text = "\n\n".join(" ".join(f"w{p}_{i}" for i in range(70)) for p in range(6))
    chunks = svc.chunk_text(text, words=100, overlap=10)
    assert len(chunks) > 3
    seen = set(" ".join(chunks).split())
    assert seen == set(text.split())
    assert all(len(c.split()) <= 100 for c in chunks)


def test_binary_upload_is_refused(world):
    w = world
    with pytest.raises(ValidationError):
        svc.upload_document(w.org.people["alpha"]["user"], w.kb["alpha"], filename="x.bin",
                            content_type="application/octet-stream", data=b"\x00\x01\x02")

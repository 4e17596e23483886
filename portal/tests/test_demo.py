"""The demo organisation: loading it twice changes nothing, and every demo account lands on a
dashboard that shows exactly what its role may see (and nothing of the other tenants)."""

from __future__ import annotations

import pytest
from django.apps import apps
from django.core.management import call_command

from portal.management.commands.seed_demo import ACCOUNTS, DEMO_PASSWORD

TENANTS = {"vision-lab", "nlp-group", "genomics"}

# account -> tenants whose name may appear on its dashboard
SEES = {
    "platform-admin": TENANTS,
    "finance": TENANTS,
    "ops": set(),
    "security": set(),
    "auditor": set(),
    "vision-admin": {"vision-lab"},
    "vision-user": {"vision-lab"},
    "nlp-admin": {"nlp-group"},
    "nlp-user": {"nlp-group"},
    "genomics-user": {"genomics"},
    "vendor": set(),
}


def row_counts() -> dict[str, int]:
    return {m._meta.label: m._default_manager.count() for m in apps.get_models() if m._meta.managed}


@pytest.fixture
def demo(db):
    call_command("seed_demo", days=2, verbosity=0)


def test_seed_demo_twice_leaves_the_same_rows(demo):
    before = row_counts()
    assert before["tenants.Tenant"] == 3 and before["scheduling.Accelerator"] == 72
    assert before["scheduling.Job"] > 10 and before["metering.UsageRecord"] > 0
    call_command("seed_demo", verbosity=0)
    assert row_counts() == before


def test_demo_fleet_matches_the_issue(demo):
    from scheduling.models import Accelerator, Node

    pools = {p: Node.objects.filter(pool__name=p).count() for p in ("h100-train", "a100-mig", "l4-share", "mi300")}
    assert pools == {"h100-train": 4, "a100-mig": 2, "l4-share": 4, "mi300": 1}
    degraded = Accelerator.objects.exclude(health="healthy")
    assert [(c.model.short_name, c.health) for c in degraded] == [("H100", "degraded")]
    assert degraded[0].health_events.filter(kind="xid", code=79).exists()


@pytest.mark.parametrize("username", sorted(SEES))
def test_each_demo_account_sees_only_its_scope(client, demo, username):
    response = client.post("/login/", {"username": username, "password": DEMO_PASSWORD}, follow=True)
    assert response.wsgi_request.user.is_authenticated, username
    html = response.content.decode()
    assert response.request["PATH_INFO"] == "/"
    visible = {t for t in TENANTS if t in html}
    assert visible == SEES[username], f"{username} sees {visible}"
    if username == "vendor":
        assert "gpu-h100-03" in html and "gpu-h100-01" not in html
    if username in ("finance", "ops", "security", "auditor", "vendor"):
        assert "llama-70b-pretrain" not in html  # no job details for non-tenant roles


def test_expired_vendor_cannot_sign_in(client, demo):
    from portal.models import AuditEvent

    response = client.post("/login/", {"username": "vendor-expired", "password": DEMO_PASSWORD})
    assert not response.wsgi_request.user.is_authenticated
    assert "vendor access has ended" in response.content.decode()
    assert AuditEvent.objects.filter(action="vendor.login", outcome="denied", actor_label="vendor-expired").count() == 1


def test_every_account_in_the_readme_exists(demo):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for username in ACCOUNTS:
        assert f"`{username}`" in readme, f"README must list the demo account {username}"


def test_verify_audit_passes_on_the_demo_data(demo):
    from io import StringIO

    from portal.models import AuditEvent

    out = StringIO()
    call_command("verify_audit", stdout=out)
    assert AuditEvent.objects.count() > 100  # the demo went through the audited services
    assert f"intact: {AuditEvent.objects.count()} events" in out.getvalue()

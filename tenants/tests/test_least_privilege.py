"""A tenant admin manages its own tenant and nothing beyond it, through the pages and through
the services alike: it cannot raise its tenant quota, grant a platform role, or add anyone to
another tenant; inside its tenant the quota split stays within the tenant line."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.urls import reverse

from portal.models import AuditEvent, AuditOutcome
from scheduling import services as sched
from scheduling.models import Quota
from tenants import services as tenancy
from tenants.models import PlatformRoleAssignment, TenantMembership
from tenants.tests.factories import client_for


def _h100_line(org, slug, project=None):
    return Quota.objects.get(tenant=org.tenants[slug], project=project, accelerator_model=org.models["h100"])


def test_tenant_admin_cannot_raise_its_tenant_quota_through_the_service(org):
    tadmin = org.people["alpha"]["admin"]
    with pytest.raises(PermissionDenied):
        sched.set_quota(tadmin, tenant=org.tenants["alpha"], resource="gpus", accelerator_model=org.models["h100"],
                        guaranteed=8, limit=8)
    assert _h100_line(org, "alpha").limit == Decimal(4)
    refusal = AuditEvent.objects.filter(action="quota.change", outcome=AuditOutcome.DENIED).get()
    assert refusal.actor == tadmin and refusal.tenant == org.tenants["alpha"]


def test_tenant_admin_cannot_raise_its_tenant_quota_through_the_pages(org):
    tadmin = org.people["alpha"]["admin"]
    client = client_for(tadmin)
    response = client.post(reverse("platform:quota_set"), {
        "tenant": org.tenants["alpha"].pk, "resource": "gpus", "accelerator_model": org.models["h100"].pk,
        "guaranteed": "8", "limit": "8"})
    assert response.status_code == 403
    assert _h100_line(org, "alpha").limit == Decimal(4)
    # nor by giving a project more than the tenant line holds
    response = client.post(reverse("tenants:quota_split_set", args=[org.tenants["alpha"].pk]), {
        "project": org.projects["alpha"].pk, "line": _h100_line(org, "alpha").pk, "guaranteed": "2", "limit": "9"})
    assert response.status_code == 400
    # scheduling.services formats the Decimal with :g, which keeps "4.000"; accept either spelling
    assert re.search(r"the tenant&#x27;s limit is 4(\.0+)?; a project cannot exceed it", response.content.decode())
    assert _h100_line(org, "alpha", org.projects["alpha"]).limit == Decimal(4)


def test_tenant_admin_cannot_grant_platform_admin(org, make_user):
    tadmin = org.people["alpha"]["admin"]
    target = make_user("hopeful")
    with pytest.raises(PermissionDenied):
        tenancy.grant_platform_role(tadmin, target, "platform_admin")
    with pytest.raises(PermissionDenied):
        tenancy.grant_platform_role(tadmin, tadmin, "platform_admin")
    client = client_for(tadmin)
    assert client.post(reverse("platform:role_grant"), {"who": "hopeful", "role": "platform_admin"}).status_code == 403
    # the member form offers no platform role, and refuses one typed in by hand
    response = client.post(reverse("tenants:member_add", args=[org.tenants["alpha"].pk]),
                           {"who": "hopeful", "role": "platform_admin"})
    assert response.status_code == 400
    assert not PlatformRoleAssignment.objects.filter(user__in=[target, tadmin]).exists()


def test_tenant_admin_cannot_add_a_member_to_another_tenant(org, make_user):
    tadmin = org.people["alpha"]["admin"]
    target = make_user("outsider")
    beta = org.tenants["beta"]
    with pytest.raises(PermissionDenied):
        tenancy.add_tenant_member(tadmin, beta, target, "member")
    with pytest.raises(PermissionDenied):
        tenancy.add_project_member(tadmin, org.projects["beta"], target, "user")
    client = client_for(tadmin)
    response = client.post(reverse("tenants:member_add", args=[beta.pk]), {"who": "outsider", "role": "member"})
    assert response.status_code == 404  # beta does not exist for alpha's admin
    # nor by naming beta's project in alpha's form
    response = client.post(reverse("tenants:member_add", args=[org.tenants["alpha"].pk]),
                           {"who": "outsider", "role": "user", "project": org.projects["beta"].pk})
    assert response.status_code == 400
    assert not TenantMembership.objects.filter(user=target).exists()


def test_project_admin_cannot_grant_a_tenant_role_it_does_not_hold(org, make_user):
    padm = make_user("p-admin")
    tenancy.add_project_member(org.admin, org.projects["alpha"], padm, "project_admin")
    target = make_user("friend")
    with pytest.raises(PermissionDenied):
        tenancy.add_tenant_member(padm, org.tenants["alpha"], target, "tenant_admin")
    # inside its project it may hand out what it holds
    tenancy.add_project_member(padm, org.projects["alpha"], target, "user")
    assert target.project_memberships.get().role == "user"


def test_tenant_admin_adds_a_member_by_sso_subject_and_changes_the_role(org, make_user):
    from tenants.models import ExternalIdentity

    tadmin = org.people["alpha"]["admin"]
    person = make_user("sso-person")
    ExternalIdentity.objects.create(user=person, issuer="https://idp.example", subject="a1b2-c3")
    client = client_for(tadmin)
    url = reverse("tenants:member_add", args=[org.tenants["alpha"].pk])
    response = client.post(url, {"who": "a1b2-c3", "role": "finance_viewer"})
    assert response.status_code == 302
    membership = TenantMembership.objects.get(user=person, tenant=org.tenants["alpha"])
    assert membership.role == "finance_viewer"
    response = client.post(reverse("tenants:membership_role", args=[membership.pk]), {"role": "member"})
    assert response.status_code == 302
    membership.refresh_from_db()
    assert membership.role == "member"
    change = AuditEvent.objects.filter(action="membership.change").get()
    assert change.before["role"] == "finance_viewer" and change.after["role"] == "member"
    page = client.get(reverse("tenants:member_list", args=[org.tenants["alpha"].pk])).content.decode()
    assert "sso-person" in page and "beta" not in page


def test_quota_split_page_shows_what_is_left_and_the_refusal_on_its_field(org):
    tadmin = org.people["alpha"]["admin"]
    alpha = org.tenants["alpha"]
    project2 = tenancy.create_project(tadmin, alpha, slug="alpha-q", name="second", project_class="research")
    client = client_for(tadmin)
    response = client.get(reverse("tenants:quota_split", args=[alpha.pk]))
    rows = {row["line"]: row for row in response.context["table"].data.data}
    # H100 line: the tenant guarantees 2 and alpha-p holds 2, so nothing is left to guarantee
    assert rows["H100 GPUs"] == {"line": "H100 GPUs", "guaranteed": "2", "limit": "4", "split": "2", "left": "0"}
    assert "Left to split" in response.content.decode()
    response = client.post(reverse("tenants:quota_split_set", args=[alpha.pk]), {
        "project": project2.pk, "line": _h100_line(org, "alpha").pk, "guaranteed": "1", "limit": "2"})
    assert response.status_code == 400
    html = response.content.decode()
    assert re.search(r"only 0(\.0+)? of the tenant&#x27;s guaranteed 2(\.0+)? is left to split", html)
    assert 'class="field has-error"' in html
    with pytest.raises(ValidationError):
        sched.set_quota(tadmin, tenant=alpha, project=project2, resource="gpus", accelerator_model=org.models["h100"],
                        guaranteed=1, limit=2)
    # a share without a guarantee fits
    response = client.post(reverse("tenants:quota_split_set", args=[alpha.pk]), {
        "project": project2.pk, "line": _h100_line(org, "alpha").pk, "guaranteed": "0", "limit": "2"})
    assert response.status_code == 302
    assert _h100_line(org, "alpha", project2).limit == Decimal(2)

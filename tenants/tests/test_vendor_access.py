"""Vendor access: ops opens a work order and requests a grant, someone else approves it in
sudo mode, the vendor sees only that work order's hardware, and revocation ends the session
at the next request."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.urls import reverse
from django.utils import timezone

from conftest import PASSWORD
from portal import context
from portal.models import AuditEvent, AuditOutcome
from portal.services import SudoRequired
from tenants import services as tenancy
from tenants.tests.factories import client_for


@pytest.fixture
def order(org):
    return tenancy.open_work_order(org.ops, title="RMA", reason="ECC errors", nodes=[org.nodes[0]])


def _request(org, order, vendor, hours=8):
    now = timezone.now()
    return tenancy.request_vendor_grant(org.ops, work_order=order, vendor=vendor, starts=now,
                                        expires=now + dt.timedelta(hours=hours))


def test_the_requester_cannot_approve_their_own_request(org, order, make_user, sudo):
    both = make_user("ops-and-security")
    tenancy.grant_platform_role(org.admin, both, "ops_engineer", bootstrap=True)
    tenancy.grant_platform_role(org.admin, both, "security_admin", bootstrap=True)
    vendor = make_user("acme")
    now = timezone.now()
    grant = tenancy.request_vendor_grant(both, work_order=order, vendor=vendor, starts=now,
                                         expires=now + dt.timedelta(hours=2))
    with pytest.raises(PermissionDenied):
        tenancy.approve_vendor_grant(both, grant)
    grant.refresh_from_db()
    assert grant.approved_by is None
    refusal = AuditEvent.objects.get(action="vendor.grant.approve")
    assert refusal.outcome == AuditOutcome.DENIED and "own request" in refusal.reason


def test_approval_needs_a_recent_reauthentication(org, order, make_user):
    grant = _request(org, order, make_user("acme"))
    with context.bound(sudo=False), pytest.raises(SudoRequired):
        tenancy.approve_vendor_grant(org.security, grant)
    grant.refresh_from_db()
    assert grant.approved_by is None
    # through the page: sent to re-authenticate, then back to the grants page
    response = client_for(org.security).post(reverse("platform:grant_approve", args=[grant.pk]))
    assert response.status_code == 302
    assert response["Location"] == reverse("reauthenticate") + "?next=%2Fplatform%2Fvendor-grants%2F"
    grant.refresh_from_db()
    assert grant.approved_by is None


def test_only_plain_vendor_accounts_get_grants_and_ops_cannot_approve(org, order, make_user):
    with pytest.raises(ValidationError):
        _request(org, order, org.people["alpha"]["user"])  # holds roles: would mix reach
    grant = _request(org, order, make_user("acme"))
    with pytest.raises(PermissionDenied):
        tenancy.approve_vendor_grant(org.ops, grant)


def test_vendor_sees_only_the_work_order_and_revocation_ends_the_session(org, order, make_user, sudo):
    vendor = make_user("acme")
    grant = _request(org, order, vendor)
    client = client_for(None)
    # not approved yet: the vendor cannot sign in
    response = client.post(reverse("login"), {"username": "acme", "password": PASSWORD})
    assert response.status_code == 200 and "_auth_user_id" not in client.session
    tenancy.approve_vendor_grant(org.security, grant)
    response = client.post(reverse("login"), {"username": "acme", "password": PASSWORD})
    assert response.status_code == 302
    assert client.get(reverse("scheduling:node_detail", args=[org.nodes[0].pk])).status_code == 200
    assert client.get(reverse("scheduling:node_detail", args=[org.nodes[1].pk])).status_code == 404
    home = client.get(reverse("home")).content.decode()
    assert "alpha" not in home and "beta" not in home and org.nodes[0].name in home
    tenancy.revoke_vendor_grant(org.ops, grant, reason="work done")
    response = client.get(reverse("scheduling:node_detail", args=[org.nodes[0].pk]))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))
    assert "_auth_user_id" not in client.session


def test_ops_opens_work_order_and_requests_a_grant_through_the_pages(org, make_user):
    make_user("acme")
    client = client_for(org.ops)
    response = client.post(reverse("platform:workorder_create"),
                           {"title": "Fans", "reason": "thermal", "nodes": [org.nodes[1].pk]})
    assert response.status_code == 302
    order = org.nodes[1].work_orders.get()
    response = client.post(reverse("platform:grant_request", args=[order.pk]), {"vendor": "acme", "hours": "4"})
    assert response.status_code == 302
    grant = order.grants.get()
    assert grant.requested_by == org.ops and grant.approved_by is None
    assert round((grant.expires - grant.starts).total_seconds()) == 4 * 3600
    # a work order without hardware is refused on the form
    response = client.post(reverse("platform:workorder_create"), {"title": "Nothing", "reason": "?"})
    assert response.status_code == 400
    assert "name at least one node or card" in response.content.decode()

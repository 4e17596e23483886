"""Test helpers: the demo organisation (the `org` fixture) completed with everything the page
matrix needs — a pure tenant member and a project admin of alpha, a job in each tenant, a
work order with a valid vendor, an expired vendor and a pending grant — all made through the
services, so the rows are exactly what the application itself would have written.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from django.test import Client
from django.utils import timezone

from portal import context
from portal.middleware import SUDO_SESSION_KEY


@dataclass
class World:
    org: object
    users: dict = field(default_factory=dict)  # matrix role -> user (None: anonymous)
    own: dict = field(default_factory=dict)  # object kind -> alpha's (or the in-reach) object
    other: dict = field(default_factory=dict)  # object kind -> beta's (or the out-of-reach) object
    jobs: dict = field(default_factory=dict)


def build_world(org, make_user) -> World:
    from scheduling import services as sched
    from scheduling.models import Quota
    from tenants import services as tenancy
    from tenants.models import PlatformRoleAssignment, ProjectMembership, TenantMembership, VendorGrant

    w = World(org=org)
    alpha, beta = org.tenants["alpha"], org.tenants["beta"]
    ap, bp = org.projects["alpha"], org.projects["beta"]
    member = make_user("alpha-member")
    tenancy.add_tenant_member(org.admin, alpha, member, "member")
    padm = make_user("alpha-padm")
    tenancy.add_project_member(org.admin, ap, padm, "project_admin")
    make_user("newcomer")
    vendor2 = make_user("vendor-two")
    vendor = make_user("vendor")
    expired = make_user("vendor-expired")

    with context.bound(sudo=True):
        for slug, project in (("alpha", ap), ("beta", bp)):
            w.jobs[slug] = sched.submit_job(
                org.people[slug]["user"], project=project, spec=org.specs["h1"], priority_class=org.prio["batch"],
                name=f"{slug}-secret-job", image="busybox", command=["sleep", "60"],
            )
        order = tenancy.open_work_order(org.ops, title="Fan tray on h-0", reason="thermal alarms",
                                        nodes=[org.nodes[0]])
        now = timezone.now()
        grant = tenancy.request_vendor_grant(org.ops, work_order=order, vendor=vendor,
                                             starts=now - dt.timedelta(hours=1), expires=now + dt.timedelta(days=1))
        tenancy.approve_vendor_grant(org.security, grant)
        # an ended grant cannot be requested through the service (it refuses the past); write the
        # row as history would have left it
        VendorGrant.objects.create(vendor=expired, work_order=order, requested_by=org.ops, approved_by=org.security,
                                   starts=now - dt.timedelta(days=10), expires=now - dt.timedelta(days=3))
        pending = tenancy.request_vendor_grant(org.ops, work_order=order, vendor=vendor2, starts=now,
                                               expires=now + dt.timedelta(hours=8))

    people = org.people["alpha"]
    w.users = {
        "anonymous": None,
        "platform_admin": org.admin, "ops_engineer": org.ops, "security_admin": org.security,
        "finance": org.finance, "auditor": org.auditor,
        "tenant_admin": people["admin"], "member": member, "finance_viewer": people["finance"],
        "project_admin": padm, "project_user": people["user"], "project_viewer": people["viewer"],
        "vendor": vendor, "vendor_expired": expired,
    }
    h0_card = org.nodes[0].accelerators.order_by("index").first()
    h1_card = org.nodes[1].accelerators.order_by("index").first()
    w.own = {
        "tenant": alpha, "project": ap, "job": w.jobs["alpha"],
        "membership": TenantMembership.objects.get(user=people["finance"], tenant=alpha),
        "project_membership": ProjectMembership.objects.get(user=people["viewer"], project=ap),
        "quota_line": Quota.objects.get(tenant=alpha, project=None, accelerator_model=org.models["h100"]),
        "h100": org.models["h100"],
        "node": org.nodes[0], "card": h0_card, "work_order": order, "grant": pending,
        "platform_role": PlatformRoleAssignment.objects.get(user=org.auditor),
    }
    bpeople = org.people["beta"]
    w.other = {
        "tenant": beta, "project": bp, "job": w.jobs["beta"],
        "membership": TenantMembership.objects.get(user=bpeople["finance"], tenant=beta),
        "project_membership": ProjectMembership.objects.get(user=bpeople["viewer"], project=bp),
        "quota_line": Quota.objects.get(tenant=beta, project=None, accelerator_model=org.models["h100"]),
        "node": org.nodes[1], "card": h1_card,
    }
    return w


def client_for(user, **client_kwargs) -> Client:
    """A browser signed in as `user`, without the sudo window a fresh sign-in opens."""
    client = Client(**client_kwargs)
    if user is not None:
        client.force_login(user)
        session = client.session
        session.pop(SUDO_SESSION_KEY, None)
        session.save()
    return client

"""The audit log: every sensitive action writes exactly one event with the right action,
actor, tenant and target; the table is append-only (ORM and PostgreSQL trigger); and
`manage.py verify_audit` catches a row changed behind the application's back.

Not covered yet because the features do not exist in this codebase: model service
publication and API key create/rotate/revoke (serving/).
"""

from __future__ import annotations

import datetime as dt
import io

import pytest
from django.core.exceptions import PermissionDenied
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction
from django.urls import reverse
from django.utils import timezone

from conftest import PASSWORD
from portal.models import AuditEvent, AuditOutcome
from scheduling import services as sched
from tenants import services as tenancy
from tenants.tests.factories import client_for


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def last_id() -> int:
    return AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0


def one(since: int, action: str) -> AuditEvent:
    """The single event `action` written after event `since` (fails on none or several)."""
    new = list(AuditEvent.objects.filter(id__gt=since).order_by("id"))
    matching = [e for e in new if e.action == action]
    assert len(matching) == 1, f"{len(matching)} {action!r} events; new events: {[e.action for e in new]}"
    return matching[0]


def target_of(event: AuditEvent, obj) -> bool:
    return event.target_type == obj._meta.label_lower and event.target_id == str(obj.pk)


def _job(org, slug="alpha", prio="batch", spec="h1", name="j"):
    return sched.submit_job(org.people[slug]["user"], project=org.projects[slug], spec=org.specs[spec],
                            priority_class=org.prio[prio], name=name, image="busybox", command=["true"])


# --- sign-in ------------------------------------------------------------------------------


def test_login_logout_and_failed_login_are_audited_once(org, client):
    user = org.people["alpha"]["user"]
    since = last_id()
    client.post(reverse("login"), {"username": user.username, "password": PASSWORD})
    login = one(since, "auth.login")
    assert login.actor == user and login.target_id == str(user.pk) and login.tenant is None
    assert login.source_ip == "127.0.0.1"
    since = last_id()
    client.post(reverse("logout"))
    logout = one(since, "auth.logout")
    assert logout.actor == user and logout.target_id == str(user.pk)
    since = last_id()
    client.post(reverse("login"), {"username": user.username, "password": "wrong"})
    failed = one(since, "auth.login_failed")
    assert failed.actor is None and failed.outcome == AuditOutcome.FAILED and failed.target_label == user.username


def test_vendor_grant_approval_and_vendor_login_are_audited_once(org, make_user, sudo):
    vendor = make_user("acme")
    since = last_id()
    order = tenancy.open_work_order(org.ops, title="RMA", reason="ECC", nodes=[org.nodes[0]])
    opened = one(since, "workorder.open")
    assert opened.actor == org.ops and target_of(opened, order) and opened.tenant is None
    since = last_id()
    now = timezone.now()
    grant = tenancy.request_vendor_grant(org.ops, work_order=order, vendor=vendor, starts=now,
                                         expires=now + dt.timedelta(hours=2))
    requested = one(since, "vendor.grant.request")
    assert requested.actor == org.ops and target_of(requested, grant)
    since = last_id()
    tenancy.approve_vendor_grant(org.security, grant)
    approved = one(since, "vendor.grant.approve")
    assert approved.actor == org.security and target_of(approved, grant) and approved.sudo is True
    assert approved.after["work_order"] == order.pk
    since = last_id()
    client_for(None).post(reverse("login"), {"username": "acme", "password": PASSWORD})
    login = one(since, "vendor.login")
    assert login.actor == vendor and f"work order {order.pk}" in login.reason
    since = last_id()
    tenancy.revoke_vendor_grant(org.security, grant, reason="done")
    revoked = one(since, "vendor.grant.revoke")
    assert revoked.actor == org.security and target_of(revoked, grant) and revoked.reason == "done"


# --- refusals ----------------------------------------------------------------------------


def test_failed_authorization_is_audited_once(org):
    viewer = org.people["alpha"]["viewer"]
    since = last_id()
    with pytest.raises(PermissionDenied):
        sched.submit_job(viewer, project=org.projects["alpha"], spec=org.specs["h1"], priority_class=org.prio["batch"],
                         name="nope", image="busybox", command=["true"])
    refused = one(since, "job.submit")
    assert refused.outcome == AuditOutcome.DENIED and refused.actor == viewer
    assert refused.tenant == org.tenants["alpha"] and target_of(refused, org.projects["alpha"])


def test_a_page_refusal_is_audited_once(org):
    tadmin = org.people["alpha"]["admin"]
    since = last_id()
    assert client_for(tadmin).get(reverse("platform:tenant_list")).status_code == 403
    refused = one(since, "tenant.view")
    assert refused.outcome == AuditOutcome.DENIED and refused.actor == tadmin


# --- policy and quotas --------------------------------------------------------------------


def test_quota_change_is_audited_once(org):
    tadmin = org.people["alpha"]["admin"]
    since = last_id()
    quota = sched.set_quota(tadmin, tenant=org.tenants["alpha"], project=org.projects["alpha"], resource="gpus",
                            accelerator_model=org.models["h100"], guaranteed=1, limit=3)
    event = one(since, "quota.change")
    assert event.actor == tadmin and event.tenant == org.tenants["alpha"] and event.project == org.projects["alpha"]
    assert target_of(event, quota) and event.before == {"guaranteed": "2.000", "limit": "4.000"}


def test_priority_change_is_audited_once(org, sudo):
    since = last_id()
    pc = sched.save_priority_class(org.admin, name="batch", value=150, preemptible=True,
                                   allowed_project_classes=[], allowed_roles=[])
    event = one(since, "priority.change")
    assert event.actor == org.admin and target_of(event, pc) and event.tenant is None
    assert event.before["value"] == 100 and event.after["value"] == 150 and event.sudo is True


# --- jobs ---------------------------------------------------------------------------------


def test_job_submission_is_audited_once(org):
    since = last_id()
    job = _job(org, name="audited")
    event = one(since, "job.submit")
    assert event.actor == org.people["alpha"]["user"] and target_of(event, job)
    assert event.tenant == org.tenants["alpha"] and event.project == org.projects["alpha"]


def test_manual_cancel_is_audited_once(org):
    job = _job(org, name="to-cancel")
    since = last_id()
    sched.cancel_job(org.people["alpha"]["admin"], job, reason="wrong data")
    event = one(since, "job.cancel")
    assert event.actor == org.people["alpha"]["admin"] and target_of(event, job)
    assert event.tenant == org.tenants["alpha"] and event.reason == "wrong data"


def test_preemption_is_audited_once(org, sudo):
    from scheduling.cycle import run_cycle
    from scheduling.models import Job, JobState

    # alpha may borrow the whole H100 fleet while it is idle, and does with two batch jobs
    h100, alpha = org.models["h100"], org.tenants["alpha"]
    sched.set_quota(org.admin, tenant=alpha, resource="gpus", accelerator_model=h100, guaranteed=2, limit=8)
    sched.set_quota(org.admin, tenant=alpha, project=org.projects["alpha"], resource="gpus", accelerator_model=h100,
                    guaranteed=2, limit=8)
    victims = [_job(org, "alpha", "batch", "h4", f"alpha-batch-{i}") for i in range(2)]
    run_cycle()
    assert set(Job.objects.filter(pk__in=[v.pk for v in victims]).values_list("state", flat=True)) <= {
        JobState.ADMITTED, JobState.RUNNING}
    # beta's production project needs one card of its guarantee back
    urgent = _job(org, "beta", "production", "h1", "beta-urgent")
    since = last_id()
    outcome = run_cycle()
    urgent.refresh_from_db()
    assert urgent.pk in outcome.admitted and len(outcome.preempted) == 1, urgent.wait_message
    event = one(since, "job.preempt")
    victim = Job.objects.get(pk=outcome.preempted[0])
    assert target_of(event, victim) and event.actor is None and event.actor_label == "service:scheduler"
    assert event.tenant == victim.tenant and event.after["by_job"] == str(urgent.pk)


# --- memberships and roles ----------------------------------------------------------------


def test_membership_changes_are_audited_once(org, make_user):
    tadmin, alpha = org.people["alpha"]["admin"], org.tenants["alpha"]
    person = make_user("joiner")
    since = last_id()
    membership = tenancy.add_tenant_member(tadmin, alpha, person, "member")
    granted = one(since, "membership.grant")
    assert granted.actor == tadmin and granted.tenant == alpha and target_of(granted, alpha)
    assert granted.after == {"user": "joiner", "role": "member", "source": "local"}
    since = last_id()
    tenancy.change_tenant_member_role(tadmin, membership, "finance_viewer")
    changed = one(since, "membership.change")
    assert changed.tenant == alpha and changed.before["role"] == "member" and changed.after["role"] == "finance_viewer"
    since = last_id()
    tenancy.remove_tenant_member(tadmin, membership)
    revoked = one(since, "membership.revoke")
    assert revoked.actor == tadmin and revoked.tenant == alpha and revoked.before["user"] == "joiner"


def test_platform_role_grant_is_audited_once(org, make_user, sudo):
    person = make_user("new-auditor")
    since = last_id()
    tenancy.grant_platform_role(org.security, person, "auditor")
    event = one(since, "platform_role.grant")
    assert event.actor == org.security and event.target_type == "auth.user" and event.target_id == str(person.pk)
    assert event.tenant is None and event.sudo is True and event.after["role"] == "auditor"


# --- hardware -----------------------------------------------------------------------------


def test_card_quarantine_and_release_are_audited_once(org):
    card = org.nodes[0].accelerators.first()
    since = last_id()
    sched.set_card_health(org.ops, card, "quarantined", reason="ECC storm")
    event = one(since, "card.quarantine")
    assert event.actor == org.ops and target_of(event, card) and event.after == {"health": "quarantined"}
    since = last_id()
    sched.set_card_health(org.ops, card, "healthy", reason="reseated")
    event = one(since, "card.release")
    assert event.actor == org.ops and target_of(event, card) and event.before == {"health": "quarantined"}


# --- append-only and the hash chain -------------------------------------------------------


def test_orm_cannot_update_or_delete_an_event(org):
    event = AuditEvent.objects.order_by("id").first()
    with pytest.raises(PermissionError):
        AuditEvent.objects.filter(pk=event.pk).update(reason="x")
    with pytest.raises(PermissionError):
        AuditEvent.objects.filter(pk=event.pk).delete()
    event.reason = "x"
    with pytest.raises(PermissionError):
        event.save()
    with pytest.raises(PermissionError):
        event.delete()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the trigger is PostgreSQL's")
def test_the_database_refuses_update_and_delete(org):
    event_id = last_id()
    for sql in ("UPDATE portal_auditevent SET reason = 'x' WHERE id = %s", "DELETE FROM portal_auditevent WHERE id = %s"):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic(), connection.cursor() as cur:
            cur.execute(sql, [event_id])
    assert AuditEvent.objects.get(pk=event_id).reason == ""


def test_verify_audit_reports_an_intact_chain(org):
    out = io.StringIO()
    call_command("verify_audit", stdout=out)
    assert out.getvalue().strip() == f"audit chain intact: {AuditEvent.objects.count()} events"


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the trigger is PostgreSQL's")
def test_verify_audit_names_a_row_changed_behind_the_apps_back(org):
    ids = list(AuditEvent.objects.order_by("id").values_list("id", flat=True))
    tampered = ids[len(ids) // 2]
    with connection.cursor() as cur:
        # the test transaction still holds deferred foreign-key checks, which ALTER TABLE refuses
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
        # what someone with the table owner's rights could do: the trigger is off for a moment
        cur.execute("ALTER TABLE portal_auditevent DISABLE TRIGGER atrium_audit_append_only")
        cur.execute("UPDATE portal_auditevent SET reason = 'nothing happened' WHERE id = %s", [tampered])
        cur.execute("ALTER TABLE portal_auditevent ENABLE TRIGGER atrium_audit_append_only")
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_info:
        call_command("verify_audit", stdout=io.StringIO(), stderr=err)
    assert exit_info.value.code == 1
    assert f"audit chain broken at event {tampered}: its content does not match its hash" in err.getvalue()
    assert f"({ids.index(tampered)} events before it are intact)" in err.getvalue()

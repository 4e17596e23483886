"""Card health and node failure through the database: the health policy, no new binding on a
card that is not healthy, jobs on a failed or quarantined card requeued with their tenant
alarmed, ops quarantine and release by hand (audited), a node going down requeues exactly the
jobs the bindings name, and the recovery policy (same pool, not on a node down in the last
hour) decides where they go again.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse
from django.utils import timezone

from conftest import PASSWORD
from portal.models import AuditEvent
from scheduling import cycle, queries, services
from scheduling.backends.simulated import SimulatedCluster
from scheduling.models import Binding, BindingEnd, Health, HealthEvent, Job, JobEvent, JobState, NodeState


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def submit(org, slug, spec="h1", n=1, prio="batch"):
    return [
        services.submit_job(org.people[slug]["user"], project=org.projects[slug], spec=org.specs[spec],
                            priority_class=org.prio[prio], name=f"{slug}-{i}", image="img:1", command=["run"])
        for i in range(n)
    ]


def node(org, name):
    return next(n for n in org.nodes if n.name == name)


@pytest.mark.parametrize(("kind", "code", "health"), [
    ("xid", 48, Health.QUARANTINED),     # double-bit ECC reported as XID 48
    ("xid", 13, Health.DEGRADED),        # graphics engine exception: suspicious, keeps running
    ("xid", 999, Health.HEALTHY),        # unknown XIDs do not take a card away
    ("ecc_dbe", None, Health.QUARANTINED),
    ("thermal", None, Health.DEGRADED),
    ("missing", None, Health.FAILED),
])
def test_health_policy_maps_each_signal_to_a_health(kind, code, health):
    assert services.health_policy(kind, code) == health


@pytest.mark.django_db
def test_no_new_binding_on_a_degraded_card(org):
    h0 = node(org, "h-0")
    sick = h0.accelerators.get(index=0)
    SimulatedCluster().inject_fault(sick, kind="thermal", message="thermal slowdown at 90 C")
    assert sick.__class__.objects.get(pk=sick.pk).health == Health.DEGRADED
    # four alpha + four beta single cards: the fleet has 7 healthy H100 left, so one waits
    jobs = submit(org, "alpha", n=4) + submit(org, "beta", n=4)
    cycle.run_cycle()
    assert not Binding.objects.filter(accelerator=sick).exists()
    assert Job.objects.filter(pk__in=[j.pk for j in jobs], state=JobState.ADMITTED).count() == 7
    waiting = Job.objects.get(pk__in=[j.pk for j in jobs], state=JobState.PENDING)
    assert waiting.wait_reason in ("capacity", "priority", "health")


@pytest.mark.django_db
@pytest.mark.parametrize(("kind", "health"), [("ecc_dbe", Health.QUARANTINED), ("missing", Health.FAILED)])
def test_jobs_on_a_failed_card_are_requeued_and_their_tenant_alarmed(org, kind, health):
    (job,) = submit(org, "beta")
    (other,) = submit(org, "alpha")
    cycle.run_cycle()
    SimulatedCluster().tick()
    binding = Binding.objects.get(job=job)
    card = binding.accelerator
    SimulatedCluster().inject_fault(card, kind=kind, message=f"simulated {kind}")

    job = Job.objects.get(pk=job.pk)
    assert job.state == JobState.PENDING and job.wait_reason == "health"
    assert str(card) in job.wait_message
    binding.refresh_from_db()
    assert binding.end is not None and binding.end_reason == BindingEnd.CARD_FAILED
    assert JobEvent.objects.filter(job=job, kind="alarm").count() == 1
    alarm = AuditEvent.objects.get(action="alarm.job_requeued", target_id=str(job.pk))
    assert alarm.tenant_id == org.tenants["beta"].pk and alarm.project_id == org.projects["beta"].pk
    assert AuditEvent.objects.filter(action="card.quarantine", target_id=str(card.pk)).count() == 1
    # the job on another card is untouched, and the other tenant gets no alarm
    assert Job.objects.get(pk=other.pk).state == JobState.RUNNING
    assert not AuditEvent.objects.filter(action="alarm.job_requeued", tenant=org.tenants["alpha"]).exists()
    # the next cycle places it again, never on the sick card
    cycle.run_cycle()
    assert Job.objects.get(pk=job.pk).state == JobState.ADMITTED
    assert Binding.objects.get(job=job, end__isnull=True).accelerator_id != card.pk
    assert HealthEvent.objects.get(accelerator=card).resulting_health == health


@pytest.mark.django_db
def test_ops_quarantine_and_release_by_hand_through_the_page_with_audit(client, org):
    card = node(org, "h-0").accelerators.get(index=2)
    url = reverse("scheduling:card_health", args=[card.pk])

    # a tenant admin may not touch inventory; nothing changes and nothing is audited as done
    client.login(username="alpha-admin", password=PASSWORD)
    assert client.post(url, {"health": "quarantined", "reason": "looks odd"}).status_code in (403, 404)
    card.refresh_from_db()
    assert card.health == Health.HEALTHY
    client.logout()

    client.login(username=org.ops.username, password=PASSWORD)
    assert client.get(url).status_code == 405  # changes only by POST
    response = client.post(url, {"health": "quarantined", "reason": "fan noise, RMA check"})
    assert response.status_code == 302
    card.refresh_from_db()
    assert card.health == Health.QUARANTINED and card.health_reason == "fan noise, RMA check"
    assert AuditEvent.objects.filter(action="card.quarantine", target_id=str(card.pk), actor=org.ops).count() == 1
    # quarantined: the next cycle never binds to it
    submit(org, "alpha", n=4)
    submit(org, "beta", n=4)
    cycle.run_cycle()
    assert not Binding.objects.filter(accelerator=card).exists()

    assert client.post(url, {"health": "healthy", "reason": ""}).status_code == 302  # no reason: refused
    card.refresh_from_db()
    assert card.health == Health.QUARANTINED
    client.post(url, {"health": "healthy", "reason": "fan replaced"})
    card.refresh_from_db()
    assert card.health == Health.HEALTHY
    assert AuditEvent.objects.filter(action="card.release", target_id=str(card.pk)).count() == 1
    cycle.run_cycle()
    assert Binding.objects.filter(accelerator=card, end__isnull=True).count() == 1  # the waiting job got it


@pytest.mark.django_db
def test_node_down_requeues_the_jobs_its_bindings_name_and_recovery_stays_in_the_pool(org, settings):
    settings.ATRIUM_RECOVERY_SAME_POOL = True
    settings.ATRIUM_RECOVERY_HOLD_MINUTES = 60
    # a spare H100 node in another pool: allowed for the spec, not for recovering jobs
    spare_pool = services.create_pool(org.admin, name="spare")
    spare = services.register_node(org.ops, pool=spare_pool, name="s-0", cpu_milli=128_000,
                                   memory_mib=1024 * 1024, model=org.models["h100"], cards=4)
    h0, h1 = node(org, "h-0"), node(org, "h-1")
    services.set_node_state(org.ops, h1, NodeState.CORDONED, reason="maintenance")
    services.set_node_state(org.ops, spare, NodeState.CORDONED, reason="held back")
    jobs = submit(org, "alpha", n=2) + submit(org, "beta", n=1)
    cycle.run_cycle()
    SimulatedCluster().tick()
    assert all(b.accelerator.node_id == h0.pk for b in Binding.objects.filter(end__isnull=True))
    services.set_node_state(org.ops, spare, NodeState.READY, reason="available")

    affected = queries.affected_by_node(h0)
    assert {j.pk for j in affected["jobs"]} == {j.pk for j in jobs}
    assert [t.slug for t in affected["tenants"]] == ["alpha", "beta"]

    down_at = timezone.now()
    services.set_node_state(org.ops, h0, NodeState.DOWN, reason="PSU failure")
    for job in jobs:
        job = Job.objects.get(pk=job.pk)
        assert job.state == JobState.PENDING and job.wait_reason == "health"
        assert Binding.objects.get(job=job).end_reason == BindingEnd.NODE_DOWN
    assert AuditEvent.objects.filter(action="alarm.job_requeued").count() == 3
    assert set(AuditEvent.objects.filter(action="alarm.job_requeued").values_list("tenant__slug", flat=True)) == {
        "alpha", "beta"}

    # same pool only: s-0 (pool spare) is free and ready, but the recovering jobs wait
    cycle.run_cycle(now=down_at + dt.timedelta(minutes=1))
    assert all(Job.objects.get(pk=j.pk).state == JobState.PENDING for j in jobs)
    assert not Binding.objects.filter(accelerator__node=spare).exists()
    # h-0 back up at once, but it was down within the hour: still held
    services.set_node_state(org.ops, h0, NodeState.READY, reason="PSU replaced")
    cycle.run_cycle(now=timezone.now() + dt.timedelta(minutes=5))
    assert all(Job.objects.get(pk=j.pk).state == JobState.PENDING for j in jobs)
    assert Job.objects.get(pk=jobs[0].pk).wait_reason == "health"
    # an hour later the hold is over: they run in their own pool again
    cycle.run_cycle(now=timezone.now() + dt.timedelta(minutes=61))
    for job in jobs:
        assert Job.objects.get(pk=job.pk).state == JobState.ADMITTED
        assert Binding.objects.get(job=job, end__isnull=True).accelerator.node_id == h0.pk


@pytest.mark.django_db
def test_a_fresh_job_may_use_another_pool_only_recovering_jobs_are_pinned(org, settings):
    settings.ATRIUM_RECOVERY_SAME_POOL = True
    spare_pool = services.create_pool(org.admin, name="spare")
    spare = services.register_node(org.ops, pool=spare_pool, name="s-0", cpu_milli=128_000,
                                   memory_mib=1024 * 1024, model=org.models["h100"], cards=4)
    for n in org.nodes[:2]:
        services.set_node_state(org.ops, n, NodeState.CORDONED, reason="maintenance")
    (job,) = submit(org, "alpha")
    cycle.run_cycle()
    assert Binding.objects.get(job=job).accelerator.node_id == spare.pk

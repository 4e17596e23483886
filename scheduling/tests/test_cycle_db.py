"""The scheduling cycle through the database: every wait reason a person can meet, written on
the job by run_cycle; submission never admits; preemption as issue 4 states it (production
never preempted, borrowed capacity first, the smallest set of victims, the victim back in the
queue with its reason, its bindings ended and one audit event).

Fleet of the `org` fixture: train pool h-0, h-1 (4 x H100 each, one NVLink domain), share
pool l-0 (2 x L4). Quotas: each tenant and project H100 guaranteed 2 / limit 4, L4 1 / 2.
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from portal.models import AuditEvent
from scheduling import cycle, services
from scheduling.models import Binding, BindingEnd, Job, JobEvent, JobState, NodeState


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    """The org fixture makes a dozen users: the default password hasher would dominate."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

def submit(org, slug, spec, prio="batch", n=1, name="job", **extra):
    jobs = []
    for i in range(n):
        jobs.append(services.submit_job(
            org.people[slug]["user"], project=org.projects[slug], spec=org.specs[spec],
            priority_class=org.prio[prio], name=f"{name}-{i}", image="img:1", command=["run"], **extra,
        ))
    return jobs


def fresh(job) -> Job:
    return Job.objects.get(pk=job.pk)


def cordon(org, name):
    node = next(n for n in org.nodes if n.name == name)
    services.set_node_state(org.ops, node, NodeState.CORDONED, reason="test: out of the way")


@pytest.mark.django_db
def test_submission_never_admits_a_job_is_pending_until_a_cycle_runs(org):
    (job,) = submit(org, "alpha", "h1")
    job = fresh(job)
    assert job.state == JobState.PENDING and job.wait_reason == "queued"
    assert not Binding.objects.filter(job=job).exists()
    assert list(job.events.values_list("kind", flat=True)) == ["submitted"]
    cycle.run_cycle()
    job = fresh(job)
    assert job.state == JobState.ADMITTED and job.wait_reason == ""
    assert Binding.objects.filter(job=job, end__isnull=True).count() == 1


@pytest.mark.django_db
def test_quota_reason_gives_the_numbers_of_project_and_tenant(org):
    jobs = submit(org, "alpha", "h1", n=5)
    cycle.run_cycle()
    states = [fresh(j).state for j in jobs]
    assert states.count(JobState.ADMITTED) == 4
    waiting = fresh(jobs[4])
    assert waiting.state == JobState.PENDING and waiting.wait_reason == "quota"
    assert "project alpha-p: 4 of 4" in waiting.wait_message
    assert "tenant alpha: 4 of 4" in waiting.wait_message
    assert "needs 1" in waiting.wait_message
    assert waiting.queue_position == 1
    assert waiting.events.filter(kind="waiting:quota").count() == 1


@pytest.mark.django_db
def test_capacity_reason_when_quota_allows_but_no_card_is_free(org):
    # four half L4 shares fill the two L4 cards; beta has L4 quota left but no card
    alpha = submit(org, "alpha", "l4half", n=4)
    cycle.run_cycle()
    assert all(fresh(j).state == JobState.ADMITTED for j in alpha)
    (beta,) = submit(org, "beta", "l4half")
    cycle.run_cycle()
    beta = fresh(beta)
    assert beta.state == JobState.PENDING and beta.wait_reason == "capacity"
    assert "no healthy L4-24GB card with 50% free" in beta.wait_message


@pytest.mark.django_db
def test_priority_reason_when_higher_priority_jobs_took_the_room(org):
    # same cycle: two training shares (beta) go first, alpha's batch shares get what is left
    batch = submit(org, "alpha", "l4half", prio="batch", n=3)
    training = submit(org, "beta", "l4half", prio="training", n=2)
    cycle.run_cycle()
    assert all(fresh(j).state == JobState.ADMITTED for j in training)
    states = [fresh(j).state for j in batch]
    assert states.count(JobState.ADMITTED) == 2
    waiting = next(fresh(j) for j in batch if fresh(j).state == JobState.PENDING)
    assert waiting.wait_reason == "priority"
    assert "2 of them higher-priority" in waiting.wait_message
    assert waiting.queue_position == 1


@pytest.mark.django_db
def test_health_reason_when_only_unhealthy_cards_could_fit(org):
    # one thermal-degraded card on each H100 node: no node has 4 healthy H100 left
    for node in org.nodes[:2]:
        card = node.accelerators.get(index=1)
        services.record_health_event(org.ops, card, kind="thermal", message="85 C, clocks throttled")
    (job,) = submit(org, "alpha", "h4")
    cycle.run_cycle()
    job = fresh(job)
    assert job.state == JobState.PENDING and job.wait_reason == "health"
    assert "2 nodes" in job.wait_message and "degraded" in job.wait_message


@pytest.mark.django_db
def test_spec_unsatisfiable_when_the_only_nodes_able_to_host_it_are_retired(org):
    (job,) = submit(org, "alpha", "h4")
    for node in org.nodes[:2]:  # data setup: retiring nodes has no service yet
        node.retired = timezone.now()
        node.save(update_fields=["retired"])
    cycle.run_cycle()
    job = fresh(job)
    assert job.state == JobState.PENDING and job.wait_reason == "spec-unsatisfiable"
    assert "h100 x4" in job.wait_message and "healthy or not" in job.wait_message


@pytest.mark.django_db
def test_budget_reason_when_metering_says_the_budget_is_spent(org, monkeypatch):
    # budgets belong to metering and do not exist yet: cycle.budget_blocked_projects is the
    # one place the cycle asks; here it answers as metering will
    project = org.projects["alpha"]
    monkeypatch.setattr(cycle, "budget_blocked_projects", lambda ids, now: {project.pk} & set(ids))
    (blocked,) = submit(org, "alpha", "h1")
    (other,) = submit(org, "beta", "h1")
    cycle.run_cycle()
    blocked, other = fresh(blocked), fresh(other)
    assert blocked.state == JobState.PENDING and blocked.wait_reason == "budget"
    assert "budget" in blocked.wait_message
    assert other.state == JobState.ADMITTED


# --- preemption --------------------------------------------------------------------------


def _critical(org):
    org.prio["critical"] = services.save_priority_class(org.admin, name="critical", value=2000, preemptible=False,
                                                        allowed_project_classes=[], allowed_roles=[])


def _h100_quota(org, slug, guaranteed, limit):
    h100 = org.models["h100"]
    services.set_quota(org.admin, tenant=org.tenants[slug], resource="gpus", accelerator_model=h100,
                       guaranteed=guaranteed, limit=limit)
    services.set_quota(org.admin, tenant=org.tenants[slug], project=org.projects[slug], resource="gpus",
                       accelerator_model=h100, guaranteed=guaranteed, limit=limit)


@pytest.mark.django_db
def test_preemption_takes_borrowed_capacity_first_and_only_one_victim(org):
    cordon(org, "h-1")  # only h-0's four H100 remain
    guaranteed = submit(org, "alpha", "h1", prio="batch", n=2, name="guaranteed")
    cycle.run_cycle()
    borrowed = submit(org, "alpha", "h1", prio="training", n=2, name="borrowed")
    cycle.run_cycle()
    assert [fresh(j).borrowed for j in guaranteed + borrowed] == [False, False, True, True]
    assert all(fresh(j).state == JobState.ADMITTED for j in guaranteed + borrowed)

    (prod,) = submit(org, "beta", "h1", prio="production", name="prod")
    outcome = cycle.run_cycle()
    prod = fresh(prod)
    assert prod.state == JobState.ADMITTED
    # exactly one victim, and a borrowed one although the guaranteed jobs have lower priority
    assert len(outcome.preempted) == 1
    victim = fresh(next(j for j in borrowed if j.pk == outcome.preempted[0]))
    assert all(fresh(j).state == JobState.ADMITTED for j in guaranteed)
    assert victim.state == JobState.PREEMPTED and victim.wait_reason == "preempted"
    assert f"preempted by job {prod.pk}" in victim.wait_message
    assert victim.preemptions == 1
    ended = Binding.objects.get(job=victim)
    assert ended.end is not None and ended.end_reason == BindingEnd.PREEMPTED
    assert Binding.objects.get(job=prod).accelerator_id == ended.accelerator_id
    assert AuditEvent.objects.filter(action="job.preempt", target_id=str(victim.pk)).count() == 1
    assert JobEvent.objects.filter(job=victim, kind="preempted").count() == 1
    # back in the queue: the next cycle sees it again (here it waits: its room is gone)
    cycle.run_cycle()
    assert fresh(victim).state in (JobState.PREEMPTED, JobState.PENDING)
    assert fresh(victim).wait_reason in ("quota", "capacity", "priority", "preempted")


@pytest.mark.django_db
def test_production_jobs_are_never_preempted(org, settings):
    _critical(org)
    cordon(org, "h-1")
    _h100_quota(org, "beta", 6, 8)  # beta may hold more, all of it guaranteed
    prod = submit(org, "beta", "h1", prio="production", n=4, name="prod")
    cycle.run_cycle()
    assert all(fresh(j).state == JobState.ADMITTED for j in prod)
    (urgent,) = submit(org, "beta", "h1", prio="critical", name="urgent")
    outcome = cycle.run_cycle()
    assert outcome.preempted == []
    assert all(fresh(j).state == JobState.ADMITTED for j in prod)
    urgent = fresh(urgent)
    assert urgent.state == JobState.PENDING and urgent.wait_reason == "capacity"
    assert not AuditEvent.objects.filter(action="job.preempt").exists()


@pytest.mark.django_db
def test_preemption_stops_the_fewest_jobs_even_if_they_hold_more_cards(org):
    """h-0 runs one 4-card batch job; h-1 runs four 1-card batch jobs; nobody borrows. A
    2-card production job needs room on one node: one victim (the 4-card job) beats two."""
    org.specs["h2"] = services.create_spec(org.admin, name="h100 x2", models=[org.models["h100"]], gpu_count=2,
                                           cpu_milli=16_000, memory_mib=128 * 1024)
    _h100_quota(org, "alpha", 4, 4)
    _h100_quota(org, "beta", 6, 6)
    (big,) = submit(org, "alpha", "h4", prio="batch", name="big")
    cycle.run_cycle()
    small = submit(org, "beta", "h1", prio="batch", n=4, name="small")
    cycle.run_cycle()
    assert fresh(big).state == JobState.ADMITTED and not fresh(big).borrowed
    assert all(fresh(j).state == JobState.ADMITTED and not fresh(j).borrowed for j in small)
    (prod,) = submit(org, "beta", "h2", prio="production", name="prod")
    outcome = cycle.run_cycle()
    assert fresh(prod).state == JobState.ADMITTED
    assert outcome.preempted == [big.pk]
    assert all(fresh(j).state == JobState.ADMITTED for j in small)


@pytest.mark.django_db
def test_a_job_cancelled_while_queued_is_not_admitted(org):
    (job,) = submit(org, "alpha", "h1")
    services.cancel_job(org.people["alpha"]["user"], job, reason="changed my mind")
    outcome = cycle.run_cycle(now=timezone.now() + dt.timedelta(seconds=1))
    assert outcome.skipped and fresh(job).state == JobState.CANCELLED
    assert not Binding.objects.filter(job=job).exists()

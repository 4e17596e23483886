"""Interference on shared cards: the pure policy (who is an offender, and who never is) and the
whole path through the database on the `org` fixture's shared L4 (pool "share", spec l4half):
samples from the simulated cluster, one ops alarm plus one alarm per owner project (not one per
tick), one audit event, and the configured policy (warn keeps the job running, requeue puts the
offender back in the queue while the job it slowed keeps running).
"""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from metering.models import Alarm
from metering.services import open_alarms
from portal.models import AuditEvent
from scheduling import cycle, services
from scheduling.backends.simulated import SimulatedCluster
from scheduling.interference import Policy, Sample, Share, find_offenders
from scheduling.models import (
    Binding,
    BindingEnd,
    Health,
    HealthEvent,
    HealthEventKind,
    Job,
    JobState,
    UtilisationSample,
)

T0 = dt.datetime(2026, 3, 2, 9, 0, tzinfo=dt.UTC)


def m(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def share(binding_id, job_id, share_milli=500, used=None, start=0, end=None, minutes=range(16), card=1):
    samples = tuple(Sample(m(t), used if used is not None else share_milli) for t in minutes)
    return Share(binding_id, job_id, card, share_milli, m(start), None if end is None else m(end), samples)


# --- the pure policy ----------------------------------------------------------------------


def test_a_share_over_factor_for_the_whole_window_beside_another_job_is_an_offender():
    greedy, victim = share(1, 10, used=980), share(2, 20)
    assert find_offenders([greedy, victim], now=m(9)) == []  # 9 minutes: not yet persistent
    (off,) = find_offenders([greedy, victim], now=m(10))
    assert (off.job_id, off.card_id, off.share_milli, off.threshold_milli) == (10, 1, 500, 750)
    assert off.used_milli == 980 and off.since == m(0) and off.samples == 11 and off.victims == (20,)


def test_within_the_allowed_factor_nobody_is_an_offender():
    # 740 of a 500 share is within 1.5x; 760 is not
    assert find_offenders([share(1, 10, used=740), share(2, 20)], now=m(15)) == []
    assert [o.job_id for o in find_offenders([share(1, 10, used=760), share(2, 20)], now=m(15))] == [10]
    # the factor and the window are the policy's: a stricter factor catches 740
    strict = Policy(factor=1.2, window=dt.timedelta(minutes=5))
    assert [o.job_id for o in find_offenders([share(1, 10, used=740), share(2, 20)], now=m(5), policy=strict)] == [10]


def test_a_job_alone_on_its_card_may_use_the_idle_capacity():
    alone = share(1, 10, used=1000, minutes=range(61))
    assert find_offenders([alone], now=m(60)) == []
    # a co-tenant arrives at minute 50: the hour alone does not count, ten minutes beside it do
    late = share(2, 20, start=50, minutes=range(50, 61))
    assert find_offenders([alone, late], now=m(59)) == []
    assert [o.job_id for o in find_offenders([alone, late], now=m(60))] == [10]
    # once the co-tenant has left there is no victim, whatever the history
    gone = share(2, 20, start=30, end=45, minutes=range(30, 45))
    assert find_offenders([alone, gone], now=m(60)) == []


def test_two_shares_of_one_job_never_interfere_with_each_other():
    assert find_offenders([share(1, 10, used=1000), share(2, 10, used=0)], now=m(15)) == []


def test_a_dip_under_the_limit_restarts_the_window_and_stale_samples_accuse_nobody():
    samples = tuple(Sample(m(t), 400 if t == 8 else 990) for t in range(16))
    dipped = Share(1, 10, 1, 500, m(0), None, samples)
    assert find_offenders([dipped, share(2, 20)], now=m(15)) == []  # run since minute 9: 6 minutes
    assert [o.since for o in find_offenders([dipped, share(2, 20, minutes=range(21))], now=m(19))] == [m(9)]
    # the backend stopped reporting at minute 15: at minute 40 nobody is accused on old data
    assert find_offenders([share(1, 10, used=990), share(2, 20)], now=m(40)) == []
    # too few samples, however long apart, are not "persistently"
    sparse = share(1, 10, used=990, minutes=(0, 10))
    assert find_offenders([sparse, share(2, 20)], now=m(10)) == []


def test_cards_are_judged_separately():
    greedy = share(1, 10, used=1000, card=1)
    other_card = share(2, 20, card=2)
    assert find_offenders([greedy, other_card], now=m(15)) == []


# --- through the database -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def start(org):
    """Both L4 halves on l-0/gpu0 (gpu1 quarantined so placement has no choice), running from T."""
    l0 = next(n for n in org.nodes if n.name == "l-0")
    services.set_card_health(org.ops, l0.accelerators.get(index=1), Health.QUARANTINED, reason="test: keep one card")
    card = l0.accelerators.get(index=0)
    t = timezone.now().replace(minute=0, second=0, microsecond=0) + dt.timedelta(hours=1)

    def submit(slug, name):
        return services.submit_job(org.people[slug]["user"], project=org.projects[slug], spec=org.specs["l4half"],
                                   priority_class=org.prio["batch"], name=name, image="img:1", command=["run"],
                                   expected_minutes=600)

    def go(*jobs):
        cycle.run_cycle(now=t)
        SimulatedCluster().tick(t)
        for job in jobs:
            assert Binding.objects.get(job=job, end__isnull=True).accelerator_id == card.pk
        return t

    return card, submit, go


def tick(t, minutes):
    cluster = SimulatedCluster()
    for k in minutes:
        cluster.tick(t + dt.timedelta(minutes=k))


def interference_alarms():
    return Alarm.objects.filter(kind="interference")


@pytest.mark.django_db
def test_shares_report_their_share_by_default_and_nobody_is_alarmed(org, start):
    card, submit, go = start
    a, b = submit("alpha", "fair-a"), submit("beta", "fair-b")
    t = go(a, b)
    tick(t, range(1, 16))
    used = set(UtilisationSample.objects.filter(binding__accelerator=card).values_list("used_milli", flat=True))
    assert used == {500}
    assert UtilisationSample.objects.filter(binding__job=a).count() == 16  # one a tick, T..T+15
    assert not interference_alarms().exists()


@pytest.mark.django_db
def test_a_greedy_share_alarms_ops_and_each_owner_project_once_and_keeps_running_on_warn(org, start, settings):
    settings.ATRIUM_INTERFERENCE_POLICY = "warn"
    card, submit, go = start
    greedy, victim = submit("alpha", "greedy"), submit("beta", "victim")
    t = go(greedy, victim)
    made_greedy = SimulatedCluster().inject_fault(card, kind="interference", code=98, job=greedy,
                                                  now=t + dt.timedelta(minutes=1))
    assert made_greedy == greedy

    tick(t, range(1, 11))  # greedy since T+1: nine minutes of it is not yet "persistently"
    assert not interference_alarms().exists()
    assert SimulatedCluster().tick(t + dt.timedelta(minutes=11))["interference"] == [greedy.pk]
    tick(t, range(12, 30))  # still greedy, same hour: nothing new

    ops = interference_alarms().get(tenant__isnull=True)
    assert ops.project is None and f"Job {greedy.pk}" in ops.message and "98%" in ops.message
    assert f"job {victim.pk}" in ops.message
    by_project = {a.project.slug: a for a in interference_alarms().filter(project__isnull=False)}
    assert set(by_project) == {org.projects["alpha"].slug, org.projects["beta"].slug}
    assert interference_alarms().count() == 3
    # the victim's owners learn their job may be slow, not whose job or tenant slowed it
    told_victim = by_project[org.projects["beta"].slug]
    assert str(victim.pk) in told_victim.message
    assert "alpha" not in told_victim.message and "greedy" not in told_victim.message
    assert "greedy" in by_project[org.projects["alpha"].slug].message
    # each sees only their own alarm; ops see theirs
    assert set(open_alarms(org.people["beta"]["user"]).filter(kind="interference")) == {told_victim}
    assert ops in set(open_alarms(org.ops))

    (event,) = AuditEvent.objects.filter(action="job.interference")
    assert event.target_id == str(greedy.pk) and event.project_id == org.projects["alpha"].pk
    assert event.after["policy"] == "warn" and event.after["used_milli"] == 980
    assert HealthEvent.objects.filter(accelerator=card, kind=HealthEventKind.INTERFERENCE).count() == 1
    assert Job.objects.get(pk=greedy.pk).state == JobState.RUNNING
    assert Job.objects.get(pk=victim.pk).state == JobState.RUNNING
    card.refresh_from_db()
    assert card.health == Health.HEALTHY  # interference is not a fault of the card

    # still at it in the next hour: reminded once more, not on every tick
    tick(t, range(30, 70))
    assert interference_alarms().filter(tenant__isnull=True).count() == 2
    assert AuditEvent.objects.filter(action="job.interference").count() == 2


@pytest.mark.django_db
def test_within_the_allowed_factor_nothing_happens(org, start, settings):
    settings.ATRIUM_INTERFERENCE_FACTOR = 1.5
    card, submit, go = start
    busy, other = submit("alpha", "busy"), submit("beta", "other")
    t = go(busy, other)
    assert SimulatedCluster().set_utilisation(busy, 0.74, now=t + dt.timedelta(minutes=1)) == 1
    tick(t, range(1, 25))
    assert not interference_alarms().exists()
    assert not AuditEvent.objects.filter(action="job.interference").exists()
    assert not HealthEvent.objects.filter(kind=HealthEventKind.INTERFERENCE).exists()
    # the same load with a stricter factor is interference
    settings.ATRIUM_INTERFERENCE_FACTOR = 1.2
    tick(t, range(25, 27))
    assert interference_alarms().filter(tenant__isnull=True).count() == 1


@pytest.mark.django_db
def test_requeue_policy_requeues_the_offender_and_the_victim_keeps_running(org, start, settings):
    settings.ATRIUM_INTERFERENCE_POLICY = "requeue"
    card, submit, go = start
    victim, greedy = submit("beta", "victim"), submit("alpha", "greedy")
    t = go(victim, greedy)
    assert SimulatedCluster().inject_fault(card, kind="interference", job=greedy,
                                           now=t + dt.timedelta(minutes=1)) == greedy
    tick(t, range(1, 20))

    greedy = Job.objects.get(pk=greedy.pk)
    assert greedy.state == JobState.PENDING and greedy.wait_reason == "interference"
    assert "interference" in greedy.wait_message and str(card) in greedy.wait_message
    assert greedy.events.filter(kind="requeued", message__contains="interference").count() == 1
    (ended,) = Binding.objects.filter(job=greedy)
    assert ended.end == t + dt.timedelta(minutes=11) and ended.end_reason == BindingEnd.INTERFERENCE
    assert Job.objects.get(pk=victim.pk).state == JobState.RUNNING
    assert Binding.objects.get(job=victim).end is None

    assert interference_alarms().count() == 3  # ops + alpha-p + beta-p, once
    assert "requeued" in interference_alarms().get(tenant__isnull=True).action
    (event,) = AuditEvent.objects.filter(action="job.interference")
    assert event.before == {"state": "running"} and event.after["state"] == "pending"
    assert event.after["policy"] == "requeue"
    # its own alarm says what happened: no second, generic "lost its cards" alarm or audit event
    assert not Alarm.objects.filter(kind="job_requeued").exists()
    assert not AuditEvent.objects.filter(action="alarm.job_requeued").exists()


@pytest.mark.django_db
def test_a_greedy_job_alone_on_its_card_is_never_an_offender(org, start):
    card, submit, go = start
    (alone,) = [submit("alpha", "alone")]
    t = go(alone)
    # the simulated fault picks the share that has held the card longest: the only one here
    assert SimulatedCluster().inject_fault(card, kind="interference", now=t) == alone
    tick(t, range(1, 31))
    assert not interference_alarms().exists()
    assert set(UtilisationSample.objects.filter(binding__job=alone).values_list("used_milli", flat=True)) == {1000}

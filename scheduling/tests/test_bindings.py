"""The binding history answers both ways at a past instant: who was on card X at time T
(`queries.occupants`) and which cards job Y held and when (`queries.cards_of`), with bindings
made on the simulated clock (run_cycle(now=t), SimulatedCluster().tick(now=t))."""

from __future__ import annotations

import datetime as dt

import pytest

from scheduling import cycle, queries, services
from scheduling.backends.simulated import SimulatedCluster
from scheduling.models import BindingEnd, JobState, NodeState

T0 = dt.datetime(2025, 3, 3, 9, 0, tzinfo=dt.UTC)


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


@pytest.mark.django_db
def test_occupants_and_cards_of_at_past_instants(org):
    services.set_node_state(org.ops, org.nodes[1], NodeState.CORDONED, reason="only h-0 in this test")
    alpha = [
        services.submit_job(org.people["alpha"]["user"], project=org.projects["alpha"], spec=org.specs["h1"],
                            priority_class=org.prio["batch"], name=f"a{i}", image="i", command=["x"],
                            expected_minutes=60, submitted=at(0))
        for i in range(4)
    ]
    cluster = SimulatedCluster()
    cycle.run_cycle(now=at(0))
    cluster.tick(now=at(0))
    late = services.submit_job(org.people["beta"]["user"], project=org.projects["beta"], spec=org.specs["h1"],
                               priority_class=org.prio["batch"], name="late", image="i", command=["x"],
                               expected_minutes=30, submitted=at(10))
    cycle.run_cycle(now=at(10))  # h-0 is full: the late job waits
    late.refresh_from_db()
    assert late.state == JobState.PENDING and late.wait_reason == "capacity"

    cluster.tick(now=at(60))  # the alpha jobs finish exactly at minute 60
    cycle.run_cycle(now=at(60))
    cluster.tick(now=at(60))
    late.refresh_from_db()
    assert late.state == JobState.RUNNING
    (late_binding,) = queries.cards_of(late)
    card = late_binding.accelerator
    first = next(j for j in alpha if queries.cards_of(j).get().accelerator_id == card.pk)

    # card -> who, at a past time: the alpha job at minute 30, the beta job at minute 70
    (b,) = queries.occupants(card, at(30))
    assert b.job_id == first.pk and b.tenant.slug == "alpha" and b.project.slug == "alpha-p"
    (b,) = queries.occupants(card, at(70))
    assert b.job_id == late.pk and b.tenant.slug == "beta"
    # [start, end): at minute 60 the card already belongs to the next holder only
    assert [b.job_id for b in queries.occupants(card, at(60))] == [late.pk]
    assert list(queries.occupants(card, at(-1))) == []
    # after the late job finishes the card is idle; now, too
    cluster.tick(now=at(90))
    assert list(queries.occupants(card, at(95))) == []
    assert list(queries.occupants(card)) == []

    # job -> which cards and when
    (mine,) = queries.cards_of(first)
    assert (mine.start, mine.end, mine.end_reason) == (at(0), at(60), BindingEnd.COMPLETED)
    assert [b.accelerator_id for b in queries.cards_of(first, at(59))] == [card.pk]
    assert list(queries.cards_of(first, at(61))) == []
    assert list(queries.cards_of(late, at(30))) == []
    assert [(b.start, b.end) for b in queries.cards_of(late)] == [(at(60), at(90))]
    # every alpha job held exactly one distinct card of h-0 over [0, 60)
    held = {queries.cards_of(j, at(30)).get().accelerator_id for j in alpha}
    assert len(held) == 4 and all(c.node_id == org.nodes[0].pk for c in org.nodes[0].accelerators.filter(pk__in=held))


@pytest.mark.django_db
def test_a_preempted_and_rescheduled_job_shows_both_bindings(org):
    services.set_node_state(org.ops, org.nodes[1], NodeState.CORDONED, reason="only h-0 in this test")
    user = org.people["alpha"]["user"]
    batch = [services.submit_job(user, project=org.projects["alpha"], spec=org.specs["h1"],
                                 priority_class=org.prio["batch"], name=f"b{i}", image="i", command=["x"],
                                 submitted=at(0)) for i in range(4)]
    cycle.run_cycle(now=at(0))
    prod = services.submit_job(org.people["beta"]["user"], project=org.projects["beta"], spec=org.specs["h1"],
                               priority_class=org.prio["production"], name="p", image="i", command=["x"],
                               expected_minutes=20, submitted=at(5))
    out = cycle.run_cycle(now=at(5))
    (victim_id,) = out.preempted
    cluster = SimulatedCluster()
    cluster.tick(now=at(5))
    cluster.tick(now=at(25))  # prod finishes at minute 25
    cycle.run_cycle(now=at(25))
    bindings = list(queries.cards_of(victim_id))
    assert [(b.start, b.end, b.end_reason) for b in bindings] == [
        (at(0), at(5), BindingEnd.PREEMPTED), (at(25), None, ""),
    ]
    assert [b.job_id for b in queries.occupants(bindings[0].accelerator, at(10))] == [prod.pk]
    assert {j.pk for j in batch} >= {victim_id}

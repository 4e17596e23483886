"""Accrual from bindings: hour, day and month cuts, fractions, MIG slices, preemption."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import pytest
from django.db.models import Sum

from metering import services
from metering.models import Granularity, UsageRecord, UsageRollup
from metering.tests.conftest import t

H = 3_600_000  # milli-card-seconds in a card-hour


def ledger(**filters) -> dict:
    return dict(UsageRecord.objects.filter(**filters).order_by("hour").values_list("hour", "milli_card_seconds"))


@pytest.mark.django_db
def test_job_across_midnight_is_cut_at_the_hour_and_the_day(org, bind):
    b = bind("alpha", t(2025, 3, 4, 23, 0), t(2025, 3, 5, 1, 30))
    services.accrue(until=t(2025, 3, 6))
    assert ledger(binding=b) == {t(2025, 3, 4, 23): H, t(2025, 3, 5, 0): H, t(2025, 3, 5, 1): H // 2}
    services.rollup(t(2025, 3, 4).date(), t(2025, 3, 5).date(), accrue_first=False)
    days = dict(UsageRollup.objects.filter(granularity=Granularity.DAY).values_list("period", "milli_card_seconds"))
    assert days == {t(2025, 3, 4).date(): H, t(2025, 3, 5).date(): 3 * H // 2}


@pytest.mark.django_db
def test_job_across_month_end_lands_in_both_months(org, bind):
    bind("alpha", t(2025, 1, 31, 23, 30), t(2025, 2, 1, 0, 45))
    services.rollup(t(2025, 1, 31).date(), t(2025, 2, 1).date(), now=t(2025, 2, 2))
    months = dict(UsageRollup.objects.filter(granularity=Granularity.MONTH).values_list("period", "milli_card_seconds"))
    assert months == {t(2025, 1, 1).date(): H // 2, t(2025, 2, 1).date(): H * 3 // 4}


@pytest.mark.django_db
def test_quarter_card_for_four_hours_is_one_card_hour(org, bind):
    bind("alpha", t(2025, 3, 4, 10, 17), t(2025, 3, 4, 14, 17), share_milli=250)
    services.accrue(until=t(2025, 3, 5))
    assert UsageRecord.objects.aggregate(s=Sum("milli_card_seconds"))["s"] == H
    assert UsageRecord.objects.count() == 5  # 10:17-11, 11, 12, 13, 14-14:17


@pytest.mark.django_db
def test_mig_3g40gb_slice_counts_exactly_three_sevenths_of_an_a100(org, bind):
    from scheduling import services as sched

    a100 = sched.create_accelerator_model(org.admin, name="A100-SXM4-80GB", short_name="A100", vendor="nvidia",
                                          memory_gib=80, mig_profiles=["3g.40gb"])
    node = sched.register_node(org.ops, pool=org.nodes[0].pool, name="a-0", cpu_milli=64_000,
                               memory_mib=512 * 1024, model=a100, cards=1)
    card = node.accelerators.get()
    # the scheduler stores 428/1000 for 3/7; metering must use the profile, not the rounded share
    b = bind("alpha", t(2025, 3, 4, 0, 0), t(2025, 3, 4, 7, 0), card=card, share_milli=428, mig_profile="3g.40gb")
    one = bind("beta", t(2025, 3, 4, 0, 0), t(2025, 3, 4, 1, 0), card=card, share_milli=428, mig_profile="3g.40gb")
    services.accrue(until=t(2025, 3, 5))
    assert services.binding_share(b) == Fraction(3, 7)
    assert UsageRecord.objects.filter(binding=b).aggregate(s=Sum("milli_card_seconds"))["s"] == 3 * H
    assert ledger(binding=one) == {t(2025, 3, 4, 0): round(Fraction(3 * H, 7))}
    assert UsageRecord.objects.filter(binding=b).first().accelerator_model == a100


@pytest.mark.django_db
def test_preempted_then_resumed_job_accrues_nothing_while_queued(org, bind):
    first = bind("alpha", t(2025, 3, 4, 10, 0), t(2025, 3, 4, 11, 0))
    bind("alpha", t(2025, 3, 4, 13, 0), t(2025, 3, 4, 14, 0), job=first.job)  # resumed after 2 h in the queue
    services.accrue(until=t(2025, 3, 5))
    assert ledger(job=first.job) == {t(2025, 3, 4, 10): H, t(2025, 3, 4, 13): H}


@pytest.mark.django_db
def test_running_job_is_accrued_to_now_and_continued_without_overlap_or_gap(org, bind):
    b = bind("alpha", t(2025, 3, 4, 10, 20))  # still running
    services.accrue(until=t(2025, 3, 4, 11, 40))
    assert ledger(binding=b) == {t(2025, 3, 4, 10): 40 * 60_000, t(2025, 3, 4, 11): 40 * 60_000}
    services.accrue(until=t(2025, 3, 4, 12, 10), since=t(2025, 3, 4, 11, 40))
    b.end = t(2025, 3, 4, 12, 10)
    b.save()
    services.accrue(until=t(2025, 3, 5), since=t(2025, 3, 4, 11))
    assert ledger(binding=b) == {t(2025, 3, 4, 10): 40 * 60_000, t(2025, 3, 4, 11): H, t(2025, 3, 4, 12): 10 * 60_000}


@pytest.mark.django_db
def test_accruing_and_rolling_up_twice_gives_the_same_totals(org, bind, prices):
    bind("alpha", t(2025, 3, 4, 10, 0, 0, 123456), t(2025, 3, 6, 2, 59, 59, 1), share_milli=333)
    bind("beta", t(2025, 3, 4, 0, 0), t(2025, 3, 5, 0, 0))
    for _ in range(2):
        services.rollup(t(2025, 3, 4).date(), t(2025, 3, 6).date(), now=t(2025, 3, 7))
        totals = [
            UsageRecord.objects.aggregate(s=Sum("milli_card_seconds"))["s"],
            UsageRollup.objects.filter(granularity=Granularity.DAY).aggregate(s=Sum("milli_card_seconds"))["s"],
            UsageRollup.objects.filter(granularity=Granularity.MONTH).aggregate(s=Sum("milli_card_seconds"))["s"],
        ]
        assert len(set(totals)) == 1
    from scheduling.models import Binding

    assert totals[0] == sum(services.binding_mcs(b, t(2025, 3, 7)) for b in Binding.objects.all())
    cost = UsageRollup.objects.filter(granularity=Granularity.MONTH).aggregate(s=Sum("cost"))["s"]
    assert abs(cost - Decimal(2 * totals[0]) / H) < Decimal("0.0001")  # H100 at 2.00 per card-hour


@pytest.mark.django_db
def test_idle_capacity_is_per_pool_and_faulty_time_is_apart(org, bind, prices):
    from metering.models import PoolCapacity
    from scheduling.models import Accelerator, Health, HealthEvent

    cards = list(Accelerator.objects.filter(model=org.models["h100"]).order_by("pk"))  # 8 cards in pool train
    bind("alpha", t(2025, 3, 4, 0), t(2025, 3, 5, 0), card=cards[0])
    HealthEvent.objects.create(accelerator=cards[1], time=t(2025, 3, 4, 12), kind="xid", message="xid 79",
                               resulting_health=Health.QUARANTINED)
    services.rollup(t(2025, 3, 4).date(), t(2025, 3, 4).date(), now=t(2025, 3, 6))
    cap = PoolCapacity.objects.get(granularity=Granularity.DAY, pool=org.nodes[0].pool,
                                   accelerator_model=org.models["h100"])
    assert cap.faulty_milli_card_seconds == 12 * H
    assert cap.healthy_milli_card_seconds == 8 * 24 * H - 12 * H
    assert cap.used_milli_card_seconds == 24 * H
    assert cap.idle_milli_card_seconds == 8 * 24 * H - 12 * H - 24 * H
    assert cap.idle_cost == 2 * (8 * 24 - 12 - 24)

"""Budgets: one alarm per threshold crossing, block vs warn (in metering and through a real
scheduling cycle), and alarm idempotence."""

from __future__ import annotations

import pytest
import time_machine
from django.core.exceptions import PermissionDenied

from metering import services
from metering.models import Alarm, AlarmKind, AlarmSeverity, BudgetMode, BudgetUnit
from metering.tests.conftest import t
from portal.models import AuditEvent

NOW = t(2025, 3, 20, 12)


@pytest.mark.django_db
def test_raising_an_alarm_twice_makes_one_and_resolving_then_raising_reopens_it():
    kw = dict(kind=AlarmKind.CARD_QUARANTINED, severity=AlarmSeverity.CRITICAL, message="card 3 quarantined",
              action="open a work order", dedupe_key="card:3:quarantined")
    a = services.raise_alarm(**kw)
    assert services.raise_alarm(**kw).pk == a.pk
    assert Alarm.objects.count() == 1
    assert services.resolve_alarm("card:3:quarantined") is True
    assert services.resolve_alarm("card:3:quarantined") is False
    again = services.raise_alarm(**kw)
    assert again.pk == a.pk and again.resolved is None and Alarm.objects.count() == 1


@pytest.mark.django_db
def test_crossing_80_percent_raises_one_alarm_however_often_budgets_are_checked(org, bind, prices):
    services.set_budget(org.admin, tenant=org.tenants["alpha"], unit=BudgetUnit.CARD_HOURS, amount=10)
    bind("alpha", t(2025, 3, 3, 0), t(2025, 3, 3, 8, 30))  # 8.5 of 10 card-hours
    services.accrue(until=NOW)
    for _ in range(3):
        services.check_budgets(NOW)
    alarms = Alarm.objects.filter(kind=AlarmKind.BUDGET_THRESHOLD)
    assert alarms.count() == 1
    alarm = alarms.get()
    assert alarm.tenant == org.tenants["alpha"] and alarm.severity == AlarmSeverity.WARNING
    assert "85 %" in alarm.message
    # next month starts at zero: last month's alarm is resolved, no new one
    services.check_budgets(t(2025, 4, 2))
    alarm.refresh_from_db()
    assert alarm.resolved is not None and Alarm.objects.filter(resolved__isnull=True).count() == 0


def block_alpha_warn_beta(org):
    """A 16.00 money budget on each project: alpha's blocks, beta's only warns."""
    alpha, beta = org.projects["alpha"], org.projects["beta"]
    services.set_budget(org.admin, tenant=alpha.tenant, project=alpha, unit=BudgetUnit.MONEY, amount=16,
                        mode=BudgetMode.BLOCK)
    services.set_budget(org.admin, tenant=beta.tenant, project=beta, unit=BudgetUnit.MONEY, amount=16,
                        mode=BudgetMode.WARN)
    return alpha, beta


@pytest.mark.django_db
def test_block_budget_at_100_percent_blocks_its_scope_and_warn_budget_does_not(org, bind, prices):
    alpha, beta = block_alpha_warn_beta(org)
    for slug in ("alpha", "beta"):
        bind(slug, t(2025, 3, 3, 0), t(2025, 3, 3, 7))  # 7 h x 2.00 = 14.00, 87.5 %
    services.accrue(until=NOW)
    assert services.blocked_scopes(NOW) == (set(), set())
    for slug in ("alpha", "beta"):
        bind(slug, t(2025, 3, 4, 0), t(2025, 3, 4, 1))  # 16.00 = 100 %
    services.accrue(until=NOW)
    assert services.blocked_scopes(NOW) == (set(), {alpha.pk})
    assert services.budget_blocked_projects({alpha.pk, beta.pk}, NOW) == {alpha.pk}
    services.check_budgets(NOW)
    critical = Alarm.objects.get(project=alpha, severity=AlarmSeverity.CRITICAL)
    assert "budget" in critical.action
    assert Alarm.objects.filter(project=beta).count() == 2  # 80 % and 100 %, warn only
    # a month is a month: on the 1st of April nothing is blocked any more
    assert services.blocked_scopes(t(2025, 4, 1, 0, 1)) == (set(), set())


@pytest.mark.django_db
def test_a_real_cycle_holds_a_spent_block_budget_with_reason_budget_and_admits_a_spent_warn_budget(org, bind, prices):
    """No stand-in: budgets set through the service, usage accrued from bindings, new jobs
    submitted and one scheduling cycle run on the org fixture's fleet, in the budgets' month."""
    from scheduling import cycle
    from scheduling import services as sched
    from scheduling.models import Job, JobState

    alpha, beta = block_alpha_warn_beta(org)
    for slug in ("alpha", "beta"):
        bind(slug, t(2025, 3, 3, 0), t(2025, 3, 3, 8))  # 8 h x 2.00 = 16.00 = 100 % of each budget
    Job.objects.update(state=JobState.SUCCEEDED, finished=t(2025, 3, 3, 8))
    services.accrue(until=NOW)
    with time_machine.travel(NOW, tick=True):
        jobs = {slug: sched.submit_job(org.people[slug]["user"], project=org.projects[slug], spec=org.specs["h1"],
                                       priority_class=org.prio["batch"], name="after-budget", image="img:1",
                                       command=["run"]) for slug in ("alpha", "beta")}
        cycle.run_cycle()
    held, admitted = (Job.objects.get(pk=jobs[slug].pk) for slug in ("alpha", "beta"))
    assert held.state == JobState.PENDING and held.wait_reason == "budget", (held.state, held.wait_reason)
    assert "budget" in held.wait_message
    assert admitted.state == JobState.ADMITTED  # warn: the same spend, nothing held


@pytest.mark.django_db
def test_tenant_block_budget_holds_every_project_of_the_tenant(org, bind, prices):
    services.set_budget(org.admin, tenant=org.tenants["beta"], unit=BudgetUnit.CARD_HOURS, amount=1,
                        mode=BudgetMode.BLOCK)
    bind("beta", t(2025, 3, 3, 0), t(2025, 3, 3, 1))
    services.accrue(until=NOW)
    assert services.blocked_scopes(NOW) == ({org.tenants["beta"].pk}, set())
    ids = {org.projects["alpha"].pk, org.projects["beta"].pk}
    assert services.budget_blocked_projects(ids, NOW) == {org.projects["beta"].pk}


@pytest.mark.django_db
def test_budget_rights_tenant_admin_sets_project_budgets_of_own_tenant_only(org):
    alpha_admin = org.people["alpha"]["admin"]
    b = services.set_budget(alpha_admin, tenant=org.tenants["alpha"], project=org.projects["alpha"], amount=100)
    assert AuditEvent.objects.filter(action="metering.budget.set", outcome="success").count() == 1
    assert b.updated_by == alpha_admin
    with pytest.raises(PermissionDenied):
        services.set_budget(alpha_admin, tenant=org.tenants["alpha"], amount=100)  # the tenant line: platform only
    with pytest.raises(PermissionDenied):
        services.set_budget(alpha_admin, tenant=org.tenants["beta"], project=org.projects["beta"], amount=100)
    with pytest.raises(PermissionDenied):
        services.set_budget(org.people["alpha"]["user"], tenant=org.tenants["alpha"], project=org.projects["alpha"],
                            amount=5)


@pytest.mark.django_db
def test_a_money_budget_prices_its_token_rows_with_a_fixed_number_of_queries(org, prices, django_assert_num_queries):
    """budget_spent runs for every budget on every check and every scheduling cycle: the token
    rows of the month are priced at the price of their hour without a query each."""
    from decimal import Decimal

    from metering.models import Budget, TokenPrice, TokenUsage

    alpha = org.projects["alpha"]
    TokenPrice.objects.create(model_name="demo-llm", per_million_input=Decimal("1.0000"),
                              per_million_output=Decimal("2.0000"), effective_from=t(2020, 1, 1))
    TokenPrice.objects.create(model_name="demo-llm", per_million_input=Decimal("3.0000"),
                              per_million_output=Decimal("4.0000"), effective_from=t(2025, 3, 10))
    budget = services.set_budget(org.admin, tenant=alpha.tenant, project=alpha, unit=BudgetUnit.MONEY, amount=100)
    budget = Budget.objects.get(pk=budget.pk)

    def add(day):
        TokenUsage.objects.create(hour=t(2025, 3, day, 10), tenant=alpha.tenant, project=alpha, api_key="atr_x",
                                  model_service="chat", model_name="demo-llm", input_tokens=1_000_000,
                                  output_tokens=500_000, requests=1)

    add(5)  # before the price change: 1.00 + 1.00
    with django_assert_num_queries(4) as few:
        assert services.budget_spent(budget, NOW) == Decimal(2)
    for day in range(11, 19):  # eight more rows after it: 3.00 + 2.00 each
        add(day)
    with django_assert_num_queries(len(few.captured_queries)):
        assert services.budget_spent(budget, NOW) == Decimal(2) + 8 * Decimal(5)

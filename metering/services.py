"""Metering operations: accrual, rollups, prices, budgets, alarms and reports.

Accrual cuts every binding interval exactly at UTC hour boundaries and upserts one row per
(binding, hour). A row holds the difference of the binding's cumulative card time (rounded
to the milli-card-second) at the two ends of its piece of the hour, so the rows of a binding
always add up to its whole duration x share, whatever the hour cuts. Rows are recomputed from
the binding, never incremented: accruing twice, or again after a crash, gives the same
ledger. Rollups are recomputed from the ledger by upsert on their unique keys.

This module is the only writer of metering state; it never changes scheduling state (the
scheduler asks `blocked_scopes`/`budget_blocked_projects` and acts itself).
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from decimal import Decimal
from fractions import Fraction

from django.conf import settings
from django.db import transaction
from django.db.models import Case, DecimalField, ExpressionWrapper, F, Q, Sum, Value, When
from django.utils import timezone

from metering.models import (
    Alarm,
    AlarmKind,
    AlarmSeverity,
    Budget,
    BudgetMode,
    BudgetUnit,
    Granularity,
    PoolCapacity,
    Price,
    Report,
    ReportStatus,
    TokenPrice,
    TokenUsage,
    UsageRecord,
    UsageRollup,
)
from portal import audit
from portal.services import deny, require_sudo
from scheduling.engine import mig
from scheduling.models import Accelerator, Binding, Health, HealthEvent
from tenants import access

HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)
MCS_PER_CARD_HOUR = 3_600_000  # milli-card-seconds in one card-hour
COST_PLACES = Decimal("0.000001")
FAULTY = (Health.QUARANTINED, Health.FAILED, Health.DEGRADED)
UTC = dt.UTC


def _batch() -> int:
    # a test lowers it to make a rollup long enough to be killed half-way
    return getattr(settings, "ATRIUM_METERING_BATCH", 2000)


# --- time helpers ------------------------------------------------------------------------


def hour_floor(t: dt.datetime) -> dt.datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def day_start(d: dt.date) -> dt.datetime:
    return dt.datetime(d.year, d.month, d.day, tzinfo=UTC)


def month_start(d: dt.date) -> dt.date:
    return d.replace(day=1)


def next_month(d: dt.date) -> dt.date:
    return (d.replace(day=28) + dt.timedelta(days=4)).replace(day=1)


def split_by_hour(start: dt.datetime, end: dt.datetime):
    """Yield (hour start, piece start, piece end) for the interval [start, end), cut at hours."""
    hour = hour_floor(start)
    while hour < end:
        lo, hi = max(start, hour), min(end, hour + HOUR)
        if hi > lo:
            yield hour, lo, hi
        hour += HOUR


# --- accrual -----------------------------------------------------------------------------


def binding_share(binding: Binding) -> Fraction:
    """The exact share of the card a binding holds: a MIG slice is compute slices / 7.

    share_milli is in thousandths and cannot hold 3/7; the profile is the documented truth.
    """
    if binding.mig_profile:
        profile = mig.profile(binding.accelerator.model.name, binding.mig_profile)
        if profile is not None:
            return Fraction(profile.compute, mig.COMPUTE_SLICES)
    return Fraction(binding.share_milli, 1000)


def _cumulative_mcs(binding_start: dt.datetime, t: dt.datetime, share: Fraction) -> int:
    micros = (t - binding_start) // dt.timedelta(microseconds=1)
    return round(Fraction(micros, 1_000_000) * share * 1000)


def binding_mcs(binding: Binding, until: dt.datetime) -> int:
    """Milli-card-seconds of a binding from its start to min(end, until): what the ledger must hold."""
    end = min(binding.end or until, until)
    if end <= binding.start:
        return 0
    return _cumulative_mcs(binding.start, end, binding_share(binding))


def accrue(until: dt.datetime | None = None, since: dt.datetime | None = None, batch: int | None = None) -> int:
    """Upsert ledger rows for every binding overlapping [since, until); returns rows written."""
    until = until or timezone.now()
    batch = batch or _batch()
    bindings = (
        Binding.objects.filter(start__lt=until)
        .select_related("accelerator__node", "accelerator__model")
        .order_by("pk")
    )
    if since is not None:
        # whole hours only: a row always holds its binding's full share of that hour
        since = hour_floor(since)
        bindings = bindings.filter(Q(end__isnull=True) | Q(end__gt=since))
    written = 0
    rows: list[UsageRecord] = []
    for b in bindings.iterator(chunk_size=batch):
        share = binding_share(b)
        start = max(b.start, since) if since else b.start
        end = min(b.end or until, until)
        for hour, lo, hi in split_by_hour(start, end):
            mcs = _cumulative_mcs(b.start, hi, share) - _cumulative_mcs(b.start, lo, share)
            rows.append(UsageRecord(
                hour=hour, tenant_id=b.tenant_id, project_id=b.project_id,
                accelerator_model_id=b.accelerator.model_id, pool_id=b.accelerator.node.pool_id,
                job_id=b.job_id, binding=b, milli_card_seconds=mcs,
            ))
            if len(rows) >= batch:
                written += _upsert(rows)
                rows = []
    written += _upsert(rows)
    return written


def _upsert(rows: list[UsageRecord]) -> int:
    if not rows:
        return 0
    with transaction.atomic():
        UsageRecord.objects.bulk_create(
            rows, update_conflicts=True, unique_fields=["binding", "hour"], update_fields=["milli_card_seconds"],
        )
    return len(rows)


# --- prices ------------------------------------------------------------------------------


def price_case(field: str = "hour") -> Case:
    """A SQL expression: the card-hour price of each ledger row at its own hour (0 when none).

    One CASE over the (few) price rows keeps the price join inside a single scan of the ledger.
    """
    whens = []
    by_model: dict[int, list[Price]] = defaultdict(list)
    for p in Price.objects.order_by("accelerator_model_id", "effective_from"):
        by_model[p.accelerator_model_id].append(p)
    for model_id, prices in by_model.items():
        for i, p in enumerate(prices):
            cond = Q(accelerator_model_id=model_id, **{f"{field}__gte": p.effective_from})
            if i + 1 < len(prices):
                cond &= Q(**{f"{field}__lt": prices[i + 1].effective_from})
            whens.append(When(cond, then=Value(p.per_card_hour)))
    return Case(*whens, default=Value(Decimal(0)), output_field=DecimalField(max_digits=10, decimal_places=4))


def price_at(accelerator_model_id: int, at: dt.datetime) -> Decimal:
    p = (Price.objects.filter(accelerator_model_id=accelerator_model_id, effective_from__lte=at)
         .order_by("-effective_from").first())
    return p.per_card_hour if p else Decimal(0)


def token_prices():
    """The token price list, read once: the returned function answers (per million input,
    per million output) for (model, time), the price in effect then (0 without one)."""
    by_model: dict[str, list[TokenPrice]] = defaultdict(list)
    for p in TokenPrice.objects.order_by("model_name", "effective_from"):
        by_model[p.model_name].append(p)

    def at(model_name: str, when: dt.datetime) -> tuple[Decimal, Decimal]:
        found = None
        for p in by_model.get(model_name, ()):
            if p.effective_from > when:
                break
            found = p
        return (found.per_million_input, found.per_million_output) if found else (Decimal(0), Decimal(0))

    return at


def _cost_sum():
    return Sum(ExpressionWrapper(F("milli_card_seconds") * price_case(),
                                 output_field=DecimalField(max_digits=24, decimal_places=4)))


def _to_cost(raw) -> Decimal:
    return (Decimal(raw or 0) / MCS_PER_CARD_HOUR).quantize(COST_PLACES)


def _require_policy(actor, action: str, **target) -> None:
    if not access.has_platform_perm(actor, "manage_policy"):
        deny(actor, action, "only platform admins change price lists", **target)
    require_sudo(actor, action, **target)


def _check_not_past(actor, action, effective_from, used_since: bool, label: str) -> None:
    # A price applies from its date on; backdating it would move cost already accrued.
    if effective_from < timezone.now() - dt.timedelta(minutes=1) and used_since:
        deny(actor, action, "a price cannot start before usage already accrued (past cost does not move)",
             target_label=label)


def set_price(actor, *, accelerator_model, per_card_hour, effective_from: dt.datetime | None = None) -> Price:
    """Add a card-hour price for an accelerator model, effective from a date (sudo, audited)."""
    action = "metering.price.set"
    label = f"{accelerator_model.name} from {effective_from or 'now'}"
    _require_policy(actor, action, target_label=label)
    effective_from = effective_from or timezone.now()
    per_card_hour = Decimal(str(per_card_hour))
    if per_card_hour < 0:
        deny(actor, action, "a price cannot be negative", target_label=label)
    used = UsageRecord.objects.filter(accelerator_model=accelerator_model, hour__gte=hour_floor(effective_from)).exists()
    _check_not_past(actor, action, effective_from, used, label)
    with transaction.atomic():
        before = Price.objects.filter(accelerator_model=accelerator_model, effective_from__lte=effective_from).first()
        price, _ = Price.objects.update_or_create(
            accelerator_model=accelerator_model, effective_from=effective_from,
            defaults={"per_card_hour": per_card_hour},
        )
        audit.record(action, actor=actor, target=price,
                     before={"per_card_hour": before.per_card_hour if before else None},
                     after={"per_card_hour": per_card_hour, "effective_from": effective_from,
                            "currency": settings.ATRIUM_CURRENCY})
    return price


def set_token_price(actor, *, model_name: str, per_million_input, per_million_output,
                    effective_from: dt.datetime | None = None) -> TokenPrice:
    """Add a per-million-token price for a served model, effective from a date (sudo, audited)."""
    action = "metering.token_price.set"
    _require_policy(actor, action, target_label=model_name)
    effective_from = effective_from or timezone.now()
    used = TokenUsage.objects.filter(model_name=model_name, hour__gte=hour_floor(effective_from)).exists()
    _check_not_past(actor, action, effective_from, used, model_name)
    with transaction.atomic():
        price, _ = TokenPrice.objects.update_or_create(
            model_name=model_name, effective_from=effective_from,
            defaults={"per_million_input": Decimal(str(per_million_input)),
                      "per_million_output": Decimal(str(per_million_output))},
        )
        audit.record(action, actor=actor, target=price,
                     after={"per_million_input": per_million_input, "per_million_output": per_million_output,
                            "effective_from": effective_from, "currency": settings.ATRIUM_CURRENCY})
    return price


# --- rollups -----------------------------------------------------------------------------


def rollup_day(day: dt.date) -> int:
    """Recompute the daily usage rollup and pool capacity of one UTC day from the ledger."""
    lo = day_start(day)
    hi = lo + DAY
    rows = list(
        UsageRecord.objects.filter(hour__gte=lo, hour__lt=hi)
        .values("tenant_id", "project_id", "accelerator_model_id", "pool_id")
        .annotate(mcs=Sum("milli_card_seconds"), raw=_cost_sum())
        .order_by()
    )
    objs = [
        UsageRollup(granularity=Granularity.DAY, period=day, tenant_id=r["tenant_id"], project_id=r["project_id"],
                    accelerator_model_id=r["accelerator_model_id"], pool_id=r["pool_id"],
                    milli_card_seconds=r["mcs"], cost=_to_cost(r["raw"]))
        for r in rows
    ]
    capacity = pool_capacity(lo, hi)
    with transaction.atomic():
        _replace_rollup(Granularity.DAY, day, objs)
        _replace_capacity(Granularity.DAY, day, capacity)
    return len(objs)


def _replace_rollup(granularity: str, period: dt.date, objs: list[UsageRollup]) -> None:
    keys = ["granularity", "period", "tenant", "project", "accelerator_model", "pool"]
    if objs:
        # rows upserted in key order, so two rollups of overlapping days lock them in one order
        objs = sorted(objs, key=lambda o: (o.tenant_id, o.project_id or 0, o.accelerator_model_id or 0, o.pool_id or 0))
        UsageRollup.objects.bulk_create(objs, update_conflicts=True, unique_fields=keys,
                                        update_fields=["milli_card_seconds", "cost"])
    present = {(o.tenant_id, o.project_id, o.accelerator_model_id, o.pool_id) for o in objs}
    stale = [
        pk for pk, *key in UsageRollup.objects.filter(granularity=granularity, period=period)
        .values_list("pk", "tenant_id", "project_id", "accelerator_model_id", "pool_id")
        if tuple(key) not in present
    ]
    if stale:
        UsageRollup.objects.filter(pk__in=stale).delete()


def _replace_capacity(granularity: str, period: dt.date, objs: list[PoolCapacity]) -> None:
    fields = ["healthy_milli_card_seconds", "used_milli_card_seconds", "idle_milli_card_seconds",
              "faulty_milli_card_seconds", "idle_cost", "faulty_cost"]
    for o in objs:
        o.granularity, o.period = granularity, period
    if objs:
        PoolCapacity.objects.bulk_create(objs, update_conflicts=True,
                                         unique_fields=["granularity", "period", "pool", "accelerator_model"],
                                         update_fields=fields)
    present = {(o.pool_id, o.accelerator_model_id) for o in objs}
    for pk, pool_id, model_id in PoolCapacity.objects.filter(granularity=granularity, period=period).values_list(
            "pk", "pool_id", "accelerator_model_id"):
        if (pool_id, model_id) not in present:
            PoolCapacity.objects.filter(pk=pk).delete()


def card_health_intervals(lo: dt.datetime, hi: dt.datetime) -> dict[int, list[tuple[dt.datetime, dt.datetime, str]]]:
    """Per card, its health over [lo, hi) as (from, to, health), from the health event history."""
    cards = list(Accelerator.objects.filter(Q(retired__isnull=True) | Q(retired__gt=lo)).values("pk", "health", "retired"))
    events: dict[int, list[tuple[dt.datetime, str]]] = defaultdict(list)
    for card_id, time, health in HealthEvent.objects.filter(time__lt=hi).order_by("time", "pk").values_list(
            "accelerator_id", "time", "resulting_health"):
        events[card_id].append((time, health))
    out = {}
    for c in cards:
        end = min(hi, c["retired"]) if c["retired"] else hi
        evs = events.get(c["pk"], [])
        # health before the window: the last event before it, healthy when none
        state = Health.HEALTHY
        for time, health in evs:
            if time <= lo:
                state = health
        pieces, t = [], lo
        for time, health in evs:
            if lo < time < end:
                pieces.append((t, time, state))
                t, state = time, health
        if t < end:
            pieces.append((t, end, state))
        out[c["pk"]] = pieces
    return out


def pool_capacity(lo: dt.datetime, hi: dt.datetime) -> list[PoolCapacity]:
    """Healthy, used, idle and faulty card time per (pool, model) over [lo, hi) with its cost."""
    card_pool = {pk: (pool, model) for pk, pool, model in Accelerator.objects.values_list("pk", "node__pool_id", "model_id")}
    healthy: dict[tuple[int, int], int] = defaultdict(int)
    faulty: dict[tuple[int, int], int] = defaultdict(int)
    for card_id, pieces in card_health_intervals(lo, hi).items():
        key = card_pool[card_id]
        for a, b, health in pieces:
            mcs = (b - a) // dt.timedelta(milliseconds=1)  # one card for one second = 1000 mcs
            if health in FAULTY:
                faulty[key] += mcs
            else:
                healthy[key] += mcs
    used = {
        (r["pool_id"], r["accelerator_model_id"]): r["mcs"]
        for r in UsageRecord.objects.filter(hour__gte=lo, hour__lt=hi)
        .values("pool_id", "accelerator_model_id").annotate(mcs=Sum("milli_card_seconds")).order_by()
    }
    out = []
    for key in sorted(set(healthy) | set(faulty) | set(used)):
        pool_id, model_id = key
        price = price_at(model_id, lo)
        idle = max(0, healthy.get(key, 0) - used.get(key, 0))
        out.append(PoolCapacity(
            pool_id=pool_id, accelerator_model_id=model_id, healthy_milli_card_seconds=healthy.get(key, 0),
            used_milli_card_seconds=used.get(key, 0), idle_milli_card_seconds=idle,
            faulty_milli_card_seconds=faulty.get(key, 0),
            idle_cost=(price * idle / MCS_PER_CARD_HOUR).quantize(COST_PLACES),
            faulty_cost=(price * faulty.get(key, 0) / MCS_PER_CARD_HOUR).quantize(COST_PLACES),
        ))
    return out


def rollup_month(month: dt.date) -> int:
    """Recompute the monthly rollups of a month from its daily rollups (which must be current)."""
    month = month_start(month)
    end = next_month(month)
    rows = list(
        UsageRollup.objects.filter(granularity=Granularity.DAY, period__gte=month, period__lt=end)
        .values("tenant_id", "project_id", "accelerator_model_id", "pool_id")
        .annotate(mcs=Sum("milli_card_seconds"), total=Sum("cost")).order_by()
    )
    objs = [UsageRollup(granularity=Granularity.MONTH, period=month, tenant_id=r["tenant_id"], project_id=r["project_id"],
                        accelerator_model_id=r["accelerator_model_id"], pool_id=r["pool_id"],
                        milli_card_seconds=r["mcs"], cost=r["total"]) for r in rows]
    cap = [
        PoolCapacity(pool_id=r["pool_id"], accelerator_model_id=r["accelerator_model_id"],
                     healthy_milli_card_seconds=r["h"], used_milli_card_seconds=r["u"], idle_milli_card_seconds=r["i"],
                     faulty_milli_card_seconds=r["f"], idle_cost=r["ic"], faulty_cost=r["fc"])
        for r in PoolCapacity.objects.filter(granularity=Granularity.DAY, period__gte=month, period__lt=end)
        .values("pool_id", "accelerator_model_id")
        .annotate(h=Sum("healthy_milli_card_seconds"), u=Sum("used_milli_card_seconds"),
                  i=Sum("idle_milli_card_seconds"), f=Sum("faulty_milli_card_seconds"),
                  ic=Sum("idle_cost"), fc=Sum("faulty_cost")).order_by()
    ]
    with transaction.atomic():
        _replace_rollup(Granularity.MONTH, month, objs)
        _replace_capacity(Granularity.MONTH, month, cap)
    return len(objs)


def collect_tokens(since: dt.datetime, until: dt.datetime) -> int:
    """Bring the gateway's hourly token counts into the metering ledger; returns rows written.

    The gateway (serving) meters every successful request into its own hourly row per (hour,
    key, service) at request time; reports and budgets read metering's TokenUsage. This copies
    the gateway's rows of [since, until) over by upsert on the ledger's unique key, setting the
    absolute counts (never adding), so running it twice, or after a crash, gives the same ledger.
    """
    from serving.models import TokenUsage as GatewayUsage

    rows: dict[tuple, TokenUsage] = {}
    for g in (GatewayUsage.objects.filter(hour__gte=hour_floor(since), hour__lt=until)
              .select_related("api_key", "service").order_by("hour", "pk")):
        key = (g.hour, g.api_key.prefix, g.project_id, g.service.slug)
        row = rows.get(key)
        if row is None:  # two keys of one project could share a prefix: one ledger row, summed
            rows[key] = TokenUsage(hour=g.hour, tenant_id=g.tenant_id, project_id=g.project_id, api_key=g.api_key.prefix,
                                   model_service=g.service.slug, model_name=g.base_model, input_tokens=g.input_tokens,
                                   output_tokens=g.output_tokens, requests=g.requests)
        else:
            row.input_tokens += g.input_tokens
            row.output_tokens += g.output_tokens
            row.requests += g.requests
    TokenUsage.objects.bulk_create(
        list(rows.values()), batch_size=_batch(), update_conflicts=True,
        unique_fields=["hour", "api_key", "project", "model_service"],
        update_fields=["tenant", "model_name", "input_tokens", "output_tokens", "requests"],
    )
    return len(rows)


def rollup(since: dt.date, until: dt.date, *, accrue_first: bool = True, now: dt.datetime | None = None) -> dict:
    """Accrue the ledger (card time from bindings, tokens from the gateway), then recompute
    daily rollups of [since, until] and their months.

    Each day is its own transaction; a crash leaves finished days correct and the rest as
    before, and a retry recomputes everything from the ledger, so totals never double.
    """
    now = now or timezone.now()
    written = accrue(until=now, since=day_start(since)) if accrue_first else 0
    if accrue_first:
        written += collect_tokens(day_start(since), now)
    days, months = 0, set()
    d = since
    while d <= until:
        rollup_day(d)
        months.add(month_start(d))
        days += 1
        d += DAY
    for m in sorted(months):
        rollup_month(m)
    return {"ledger_rows": written, "days": days, "months": len(months)}


# --- alarms ------------------------------------------------------------------------------


def raise_alarm(
    *, kind: str, severity: str, message: str, action: str = "", tenant=None, project=None, dedupe_key: str,
) -> Alarm:
    """Raise the alarm named `dedupe_key` once: raising it again while open changes nothing.

    Callers put the condition's identity in the key (e.g. ``budget:12:2026-11:80``), so a
    condition seen on every cycle stays one alarm. A resolved alarm raised again is reopened
    (same row), so the dashboard shows it once, with the latest raise time.
    """
    if project is not None and tenant is None:
        tenant = project.tenant
    defaults = dict(
        kind=kind, severity=severity, message=message, action=action, tenant=tenant, project=project,
        raised=timezone.now(),
    )
    with transaction.atomic():
        # ON CONFLICT DO NOTHING, then read back: two cycles racing still make one row
        Alarm.objects.bulk_create([Alarm(dedupe_key=dedupe_key, **defaults)], ignore_conflicts=True)
        alarm = Alarm.objects.select_for_update().get(dedupe_key=dedupe_key)
        if alarm.resolved is not None:
            for field, value in defaults.items():
                setattr(alarm, field, value)
            alarm.resolved = None
            alarm.save()
    return alarm


def resolve_alarm(dedupe_key: str, at: dt.datetime | None = None) -> bool:
    """Mark the alarm resolved; True when an open alarm was resolved by this call."""
    return bool(Alarm.objects.filter(dedupe_key=dedupe_key, resolved__isnull=True).update(resolved=at or timezone.now()))


def open_alarms(user):
    """The open alarms `user` may see, newest first (for dashboards)."""
    return access.visible_to(user, Alarm.objects.filter(resolved__isnull=True)).select_related("tenant", "project")


# --- budgets -----------------------------------------------------------------------------


def _budget_actor_may(actor, tenant, project) -> bool:
    if access.has_platform_perm(actor, "manage_tenants"):
        return True
    # a tenant admin divides the tenant's money among its projects as it divides quota
    return project is not None and access.can(actor, "split_tenant_quota", tenant)


def set_budget(actor, *, tenant, project=None, unit: str = BudgetUnit.MONEY, amount, mode: str = BudgetMode.WARN,
               thresholds: list[int] | None = None) -> Budget:
    """Create or change the monthly budget of a tenant or project (audited)."""
    action = "metering.budget.set"
    if project is not None and project.tenant_id != tenant.pk:
        deny(actor, action, "the project is not in that tenant", tenant=tenant, project=project)
    if not _budget_actor_may(actor, tenant, project):
        deny(actor, action, "you may not set this budget", tenant=tenant, project=project)
    thresholds = sorted({int(t) for t in (thresholds or [80, 100])})
    if not thresholds or any(t <= 0 or t > 1000 for t in thresholds):
        deny(actor, action, "thresholds are percentages between 1 and 1000", tenant=tenant, project=project)
    amount = Decimal(str(amount))
    if amount <= 0:
        deny(actor, action, "a budget must be positive", tenant=tenant, project=project)
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        existing = (Budget.objects.select_for_update().filter(tenant=tenant, project=project, unit=unit)
                    .order_by("pk").first())
        before = ({"amount": existing.amount, "mode": existing.mode, "thresholds": existing.thresholds}
                  if existing else None)
        budget = existing or Budget(tenant=tenant, project=project, unit=unit)
        budget.amount, budget.mode, budget.thresholds, budget.updated_by = amount, mode, thresholds, actor
        budget.full_clean()
        budget.save()
        audit.record(action, actor=actor, target=budget, tenant=tenant, project=project, before=before,
                     after={"amount": amount, "unit": unit, "mode": mode, "thresholds": thresholds})
    return budget


def delete_budget(actor, budget: Budget) -> None:
    action = "metering.budget.delete"
    if not _budget_actor_may(actor, budget.tenant, budget.project):
        deny(actor, action, "you may not remove this budget", tenant=budget.tenant, project=budget.project)
    with transaction.atomic():
        audit.record(action, actor=actor, target=budget, tenant=budget.tenant, project=budget.project,
                     before={"amount": budget.amount, "unit": budget.unit, "mode": budget.mode})
        budget.delete()


def month_bounds(now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    first = month_start(now.astimezone(UTC).date())
    return day_start(first), day_start(next_month(first))


def budget_spent(budget: Budget, now: dt.datetime) -> Decimal:
    """What the budget's scope has used this calendar month, in the budget's unit."""
    lo, hi = month_bounds(now)
    scope = Q(project_id=budget.project_id) if budget.project_id else Q(tenant_id=budget.tenant_id)
    if budget.unit == BudgetUnit.TOKENS:
        agg = TokenUsage.objects.filter(scope, hour__gte=lo, hour__lt=hi).aggregate(
            t=Sum(F("input_tokens") + F("output_tokens")))
        return Decimal(agg["t"] or 0)
    ledger = UsageRecord.objects.filter(scope, hour__gte=lo, hour__lt=hi)
    if budget.unit == BudgetUnit.CARD_HOURS:
        return Decimal(ledger.aggregate(m=Sum("milli_card_seconds"))["m"] or 0) / MCS_PER_CARD_HOUR
    money = _to_cost(ledger.aggregate(raw=_cost_sum())["raw"])
    price_at = token_prices()  # one query for the prices, not one per token row
    for t in TokenUsage.objects.filter(scope, hour__gte=lo, hour__lt=hi).values(
            "model_name", "hour", "input_tokens", "output_tokens"):
        pin, pout = price_at(t["model_name"], t["hour"])
        money += (pin * t["input_tokens"] + pout * t["output_tokens"]) / 1_000_000
    return money


def check_budgets(now: dt.datetime | None = None) -> list[Alarm]:
    """Raise one alarm per budget, month and crossed threshold; resolve last month's."""
    now = now or timezone.now()
    month = now.astimezone(UTC).strftime("%Y-%m")
    raised = []
    for budget in Budget.objects.select_related("tenant", "project"):
        prefix = f"budget:{budget.pk}:"
        for alarm in Alarm.objects.filter(dedupe_key__startswith=prefix, resolved__isnull=True).exclude(
                dedupe_key__startswith=f"{prefix}{month}:"):
            resolve_alarm(alarm.dedupe_key, at=now)
        spent = budget_spent(budget, now)
        pct = spent * 100 / budget.amount
        for threshold in budget.thresholds:
            if pct < threshold:
                continue
            blocking = budget.mode == BudgetMode.BLOCK and threshold >= 100
            raised.append(raise_alarm(
                kind=AlarmKind.BUDGET_THRESHOLD,
                severity=AlarmSeverity.CRITICAL if threshold >= 100 else AlarmSeverity.WARNING,
                message=(f"{budget.scope_label} has used {pct:.0f} % of its {budget.amount} "
                         f"{_unit_label(budget.unit)} budget for {month} (threshold {threshold} %)."),
                action=("New jobs of this scope wait with reason 'budget' until next month or until the budget is raised."
                        if blocking else "Review the usage report or ask an administrator to raise the budget."),
                tenant=budget.tenant, project=budget.project, dedupe_key=f"{prefix}{month}:{threshold}",
            ))
    return raised


def _unit_label(unit: str) -> str:
    return settings.ATRIUM_CURRENCY if unit == BudgetUnit.MONEY else BudgetUnit(unit).label


def blocked_scopes(now: dt.datetime | None = None) -> tuple[set[int], set[int]]:
    """(tenant ids, project ids) whose `block` budget is spent this month: their new jobs wait.

    A month is a month: nothing decays; the block lifts when the month ends or the budget
    is raised. The scheduler sets PendingJob.budget_blocked from this.
    """
    now = now or timezone.now()
    tenants, projects = set(), set()
    for budget in Budget.objects.filter(mode=BudgetMode.BLOCK):
        if budget_spent(budget, now) >= budget.amount:
            if budget.project_id:
                projects.add(budget.project_id)
            else:
                tenants.add(budget.tenant_id)
    return tenants, projects


def budget_blocked_projects(project_ids: set[int], now: dt.datetime | None = None) -> set[int]:
    """The subset of `project_ids` held by a spent `block` budget of the project or its tenant."""
    from tenants.models import Project

    tenants, projects = blocked_scopes(now)
    if not tenants and not projects:
        return set()
    held = {pid for pid in project_ids if pid in projects}
    if tenants:
        held |= set(Project.objects.filter(pk__in=project_ids, tenant_id__in=tenants).values_list("pk", flat=True))
    return held


# --- reports -----------------------------------------------------------------------------


def report_scopes(user) -> dict:
    """What report scopes `user` may ask for: every tenant, some tenants, some projects."""
    from tenants.models import Project, Tenant

    everything = access.has_platform_perm(user, "view_all_usage")
    return {
        "all": everything,
        "tenants": Tenant.objects.all() if everything else Tenant.objects.filter(
            pk__in=access.tenant_ids(user, "view_tenant_usage")),
        "projects": Project.objects.select_related("tenant") if everything else Project.objects.filter(
            Q(pk__in=access.project_ids(user, "view_project_usage"))).select_related("tenant"),
    }


def request_report(actor, *, period_start: dt.date, period_end: dt.date, grouping: str, mode: str,
                   tenant=None, project=None, enqueue: bool = True) -> Report:
    """Ask for a report over [period_start, period_end) within the actor's reach; built by RQ."""
    action = "metering.report.request"
    everything = access.has_platform_perm(actor, "view_all_usage")
    if project is not None:
        tenant = project.tenant
        allowed = everything or project.pk in access.project_ids(actor, "view_project_usage")
    elif tenant is not None:
        allowed = everything or tenant.pk in access.tenant_ids(actor, "view_tenant_usage")
    else:
        allowed = everything
    if not allowed:
        deny(actor, action, "outside your usage scope", tenant=tenant, project=project)
    if period_end <= period_start:
        raise ValueError("the period must end after it starts")
    with transaction.atomic():
        report = Report.objects.create(
            requested_by=actor, tenant=tenant, project=project, period_start=period_start, period_end=period_end,
            grouping=grouping, mode=mode, currency=settings.ATRIUM_CURRENCY,
        )
        audit.record(action, actor=actor, target=report, tenant=tenant, project=project,
                     after={"period": f"{period_start}..{period_end}", "grouping": grouping, "mode": mode})
        if enqueue:
            from metering import jobs

            transaction.on_commit(lambda: jobs.enqueue_report(report.pk))
    return report


def report_build_lost(report_id: int, error: str) -> None:
    """A build that will not be retried any more (its worker died, or it failed every time):
    the report says it failed, unless a build did finish."""
    Report.objects.filter(pk=report_id).exclude(status=ReportStatus.DONE).update(
        status=ReportStatus.FAILED, error=error or "the worker building this report stopped", finished=timezone.now())


def build_report(report_id: int) -> Report:
    """Build a report's lines and files (the RQ job body); running it again rebuilds it whole."""
    from metering import exports

    report = Report.objects.select_related("requested_by", "tenant", "project").get(pk=report_id)
    Report.objects.filter(pk=report.pk).update(status=ReportStatus.RUNNING, progress=0, error="")
    try:
        def progress(pct: int) -> None:
            Report.objects.filter(pk=report.pk).update(progress=min(99, pct))

        lines = exports.report_lines(report, progress)
        exports.write_files(report, lines)
        report.status, report.progress, report.finished = ReportStatus.DONE, 100, timezone.now()
        report.lines = len(lines.rows)
        report.total_cost = lines.total_cost
        report.total_card_hours = lines.total_card_hours
        report.save()
    except Exception as exc:
        Report.objects.filter(pk=report.pk).update(status=ReportStatus.FAILED, error=str(exc)[:2000],
                                                   finished=timezone.now())
        raise
    return report

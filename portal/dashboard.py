"""What the dashboard shows: for one scope (a project, a tenant, or the whole platform), the
quota panel, the queue with wait reasons, card-hours / tokens / cost charts and the active
alarms, each computed by a small, fixed number of SQL queries whatever the number of jobs,
projects or usage rows.

Every row shown comes from a tenants.access.visible_to() queryset, and the scope itself is
resolved through it, so another tenant's scope answers 404 and a viewer never sees a job,
project, cost or alarm outside their reach. Numbers that are aggregates of a scope the viewer
may see (counts, allocated cards, the shared fleet's healthy capacity) never carry a job name
or command: that is how platform finance sees every tenant and no job detail. This module only
reads; it must never change a row.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal

from django.apps import apps
from django.db import connection
from django.db.models import Case, Count, F, FloatField, Func, IntegerField, Prefetch, Q, Sum, Value, When
from django.db.models.functions import Coalesce, Greatest, Least, TruncDay
from django.http import Http404
from django.urls import reverse
from django.utils import timezone

from portal.prepared import Statement
from tenants import access

PANELS = ("alarms", "quota", "queue", "usage")
PLATFORM_SCOPE_PERMS = ("view_all_tenants", "view_all_usage")
QUEUE_ROWS = 25  # jobs listed per queue table; the rest are one click away in the job list
ALARM_ROWS = 20
USAGE_DAYS = 30


# --- scope ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    kind: str  # "project", "tenant" or "platform"
    tenant: object = None
    project: object = None

    @property
    def value(self) -> str:
        if self.kind == "platform":
            return "platform"
        obj = self.project if self.kind == "project" else self.tenant
        return f"{self.kind}:{obj.pk}"

    @property
    def label(self) -> str:
        if self.kind == "platform":
            return "Platform: every tenant"
        if self.kind == "tenant":
            return f"Tenant {self.tenant.name} ({self.tenant.slug})"
        return f"Project {self.project.name} ({self.tenant.slug}/{self.project.slug})"

    def q(self, tenant_field: str = "tenant", project_field: str = "project") -> Q:
        """Rows of this scope, for a model with `tenant` and `project` foreign keys."""
        if self.kind == "project":
            return Q(**{f"{project_field}_id": self.project.pk})
        if self.kind == "tenant":
            return Q(**{f"{tenant_field}_id": self.tenant.pk})
        return Q()


def has_platform_scope(user) -> bool:
    perms = access.platform_perms(user)
    return any(p in perms for p in PLATFORM_SCOPE_PERMS)


def _tenant_choices(user):
    from tenants.models import Tenant

    tenants = access.visible_to(user, Tenant).order_by("slug")
    if not has_platform_scope(user):
        # the tenant view is for those who see the tenant's usage: tenant admins, finance viewers
        tenants = tenants.filter(pk__in=access.tenant_ids(user, "view_tenant_usage"))
    return tenants


def _project_choices(user):
    from tenants.models import Project

    return (access.visible_to(user, Project)
            .filter(pk__in=access.project_ids(user, "view_project"), archived__isnull=True)
            .select_related("tenant").order_by("tenant__slug", "slug"))


def scope_choices(user) -> dict:
    """What the header switcher offers: only scopes the user may open."""
    return {
        "platform": has_platform_scope(user),
        "tenants": list(_tenant_choices(user)),
        "projects": list(_project_choices(user)),
    }


def default_scope(user, choices: dict) -> Scope | None:
    """The user's first project (a direct membership), else the platform view for a platform
    role, else the first tenant."""
    direct = set(user.project_memberships.values_list("project_id", flat=True))
    for project in choices["projects"]:
        if project.pk in direct:
            return Scope("project", tenant=project.tenant, project=project)
    if choices["platform"]:
        return Scope("platform")
    if choices["tenants"]:
        return Scope("tenant", tenant=choices["tenants"][0])
    if choices["projects"]:
        project = choices["projects"][0]
        return Scope("project", tenant=project.tenant, project=project)
    return None


_SCOPE_RE = re.compile(r"^(project|tenant):(\d{1,18})$")


def resolve_scope(user, raw: str | None) -> Scope:
    """The scope named in the query string, or 404 exactly as if it did not exist."""
    from tenants.models import Project

    if raw == "platform":
        if not has_platform_scope(user):
            raise Http404("No such scope.")
        return Scope("platform")
    match = _SCOPE_RE.match(raw or "")
    if not match:
        raise Http404("No such scope.")
    kind, pk = match.group(1), int(match.group(2))
    if kind == "tenant":
        tenant = _tenant_choices(user).filter(pk=pk).first()
        if tenant is None:
            raise Http404("No such scope.")
        return Scope("tenant", tenant=tenant)
    project = access.get_visible_or_404(user, Project.objects.select_related("tenant"), pk=pk)
    return Scope("project", tenant=project.tenant, project=project)


# --- shared pieces ---------------------------------------------------------------------------


class Prices:
    """Price per card-hour of each accelerator model, as of any instant (one query, small table)."""

    def __init__(self):
        from metering.models import Price

        self._by_model: dict[int, list[tuple[dt.datetime, Decimal]]] = defaultdict(list)
        for model_id, when, price in Price.objects.order_by("effective_from").values_list(
                "accelerator_model_id", "effective_from", "per_card_hour"):
            self._by_model[model_id].append((when, price))

    def __bool__(self) -> bool:
        return bool(self._by_model)

    def at(self, model_id: int, when: dt.datetime) -> Decimal | None:
        found = None
        for start, price in self._by_model.get(model_id, ()):
            if start <= when:
                found = price
            else:
                break
        return found


def _mig_slices(profile: str) -> int:
    return int(profile.split("g.", 1)[0]) if "g." in profile else 7


def _mig_memory_gib(profile: str, model_memory: int) -> float:
    match = re.search(r"\.(\d+)gb", profile)
    return float(match.group(1)) if match else float(model_memory)


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x - round(x)) < 0.005 else f"{x:,.2f}"


def _epoch_seconds(expr):
    return Func(expr, template="EXTRACT(EPOCH FROM %(expressions)s)", output_field=FloatField())


# --- quota panel -----------------------------------------------------------------------------

DIMENSION_ORDER = ["gpus", "gpu_memory_gib", "cpu_cores", "memory_gib", "jobs", "card_hours_month"]


def _allocated(flt: Q, group: str | None, now: dt.datetime) -> dict:
    """Usage per quota key, per group value (project or tenant id; None when not grouped).

    Three grouped SQL aggregates: open bindings (cards and GPU memory per model), active jobs
    (CPU, memory, count) and this month's card-hours from bindings, the same measures the
    scheduling cycle admits against."""
    from scheduling.cycle import month_start
    from scheduling.models import ACTIVE_STATES, Binding, Job

    grp = [group] if group else []
    out: dict = defaultdict(lambda: defaultdict(float))
    cards = (Binding.objects.filter(flt, end__isnull=True, job__state__in=ACTIVE_STATES)
             .values(*grp, "accelerator__model_id", "accelerator__model__memory_gib", "mig_profile")
             .annotate(milli=Sum("share_milli"), n=Count("id")).order_by())
    for row in cards:
        key = row[group] if group else None
        model_id, memory, profile = row["accelerator__model_id"], row["accelerator__model__memory_gib"], row["mig_profile"]
        if profile:
            amount = row["n"] * _mig_slices(profile) / 7
            gmem = row["n"] * _mig_memory_gib(profile, memory)
        else:
            amount = row["milli"] / 1000
            gmem = amount * memory
        out[key][f"gpus:{model_id}"] += amount
        out[key]["gpu_memory_gib"] += gmem
    jobs = (Job.objects.filter(flt, state__in=ACTIVE_STATES).values(*grp)
            .annotate(cpu=Sum(F("spec__cpu_milli") * F("replicas")), mem=Sum(F("spec__memory_mib") * F("replicas")),
                      n=Count("id")).order_by())
    for row in jobs:
        key = row[group] if group else None
        out[key]["cpu_cores"] += (row["cpu"] or 0) / 1000
        out[key]["memory_gib"] += (row["mem"] or 0) / 1024
        out[key]["jobs"] += row["n"]
    start = month_start(now)
    month = Binding.objects.filter(flt, start__lt=now).filter(Q(end__isnull=True) | Q(end__gt=start))
    if connection.vendor == "postgresql":
        seconds = _epoch_seconds(Least(Coalesce("end", Value(now)), Value(now)) - Greatest("start", Value(start)))
        for row in month.values(*grp).annotate(ms=Sum(seconds * F("share_milli"))).order_by():
            key = row[group] if group else None
            out[key]["card_hours_month"] += max(row["ms"] or 0, 0) / 1000 / 3600
    else:  # SQLite (the one-machine default): the same sum, in Python
        for row in month.values(*grp, "start", "end", "share_milli"):
            key = row[group] if group else None
            seconds = (min(row["end"] or now, now) - max(row["start"], start)).total_seconds()
            out[key]["card_hours_month"] += max(seconds, 0) * row["share_milli"] / 1000 / 3600
    return out


def _healthy_free_sql() -> str:
    from scheduling.models import Accelerator, Binding, Node

    card, node, binding = Accelerator._meta.db_table, Node._meta.db_table, Binding._meta.db_table
    return (
        f"SELECT a.model_id, COUNT(*), COALESCE(SUM(u.milli), 0) FROM {card} a "  # noqa: S608 # nosec B608 # table names from model metadata, values are parameters
        f"JOIN {node} n ON n.id = a.node_id "
        f'LEFT JOIN (SELECT accelerator_id, SUM(share_milli) AS milli FROM {binding} WHERE "end" IS NULL '
        "GROUP BY accelerator_id) u ON u.accelerator_id = a.id "
        "WHERE a.retired IS NULL AND a.health = %(healthy)s AND n.retired IS NULL AND n.state = %(ready)s "
        "GROUP BY a.model_id"
    )


_HEALTHY_FREE = Statement(_healthy_free_sql)


def _healthy_free() -> dict[int, tuple[float, float]]:
    """(healthy cards, of which free) per accelerator model, over the whole shared fleet.

    An aggregate of the shared hardware (no tenant, job or card named), so every viewer's
    "available" is bounded by capacity that can actually run work. Hand-written and prepared
    (portal.prepared): every quota panel runs it, and the ORM's version (distinct cards over a
    join of every card with its open bindings) sorted the whole fleet, ~6 ms for 5,000 cards."""
    from scheduling.models import Health, NodeState

    rows = _HEALTHY_FREE.fetchall({"healthy": Health.HEALTHY.value, "ready": NodeState.READY.value})
    return {model_id: (float(n), max(float(n) - float(used or 0) / 1000, 0.0)) for model_id, n, used in rows}


def _bar(guaranteed: float, limit: float, allocated: float, available: float) -> dict:
    scale = max(limit, allocated, 1e-9)
    within = min(allocated, guaranteed)
    borrowed = max(allocated - guaranteed, 0.0)
    return {
        "within_pct": round(100 * within / scale, 1),
        "borrowed_pct": round(100 * borrowed / scale, 1),
        "guaranteed_pct": round(100 * guaranteed / scale, 1),
        "within": _num(within), "borrowed": _num(borrowed),
        "over": allocated > limit + 1e-9,
        "nearly": allocated >= 0.9 * limit and limit > 0,
    }


def quota_panel(user, scope: Scope, now: dt.datetime) -> dict:
    from scheduling.models import Quota, QuotaResource

    quotas = access.visible_to(user, Quota).select_related("accelerator_model")
    if scope.kind == "project":
        lines = list(quotas.filter(Q(project_id=scope.project.pk)
                                   | Q(tenant_id=scope.tenant.pk, project__isnull=True)))
        usage = _allocated(Q(tenant_id=scope.tenant.pk), "project_id", now)
        mine = usage.get(scope.project.pk, {})
        tenant_total: dict = defaultdict(float)
        for per in usage.values():
            for k, v in per.items():
                tenant_total[k] += v
        tenant_lines = {(q.resource, q.accelerator_model_id): q for q in lines if q.project_id is None}
        own = [q for q in lines if q.project_id is not None]
    elif scope.kind == "tenant":
        own = list(quotas.filter(tenant_id=scope.tenant.pk, project__isnull=True))
        mine = _allocated(Q(tenant_id=scope.tenant.pk), None, now).get(None, {})
        tenant_lines, tenant_total = {}, {}
    else:
        # every tenant's line summed: what the platform has promised, against what runs
        own = []
        for row in (quotas.filter(project__isnull=True).values("resource", "accelerator_model_id",
                                                                "accelerator_model__short_name")
                    .annotate(g=Sum("guaranteed"), lim=Sum("limit")).order_by()):
            q = Quota(resource=row["resource"], accelerator_model_id=row["accelerator_model_id"],
                      guaranteed=row["g"], limit=row["lim"])
            q.model_short = row["accelerator_model__short_name"]
            own.append(q)
        mine = _allocated(Q(), None, now).get(None, {})
        tenant_lines, tenant_total = {}, {}
    healthy = _healthy_free()
    rows = []
    for q in own:
        res = QuotaResource(q.resource)
        key = f"gpus:{q.accelerator_model_id}" if res == QuotaResource.GPUS else q.resource
        allocated = float(mine.get(key, 0.0))
        limit, guaranteed = float(q.limit), float(q.guaranteed)
        available = max(limit - allocated, 0.0)
        notes = []
        parent = tenant_lines.get((q.resource, q.accelerator_model_id))
        if parent is not None:
            tenant_left = max(float(parent.limit) - float(tenant_total.get(key, 0.0)), 0.0)
            if tenant_left < available:
                available = tenant_left
                notes.append("bounded by the tenant's limit")
        if res == QuotaResource.GPUS:
            cards, free = healthy.get(q.accelerator_model_id, (0.0, 0.0))
            if free < available:
                available = free
                notes.append(f"{_num(free)} of {_num(cards)} healthy cards free")
            model = getattr(q, "model_short", None) or q.accelerator_model.short_name
            label = f"{model} GPUs"
        else:
            label = res.label[:1].upper() + res.label[1:]
        rows.append({
            "key": key, "label": label, "resource": q.resource,
            "authorized": _num(limit), "guaranteed": _num(guaranteed), "allocated": _num(allocated),
            "available": _num(available), "notes": "; ".join(notes), "bar": _bar(guaranteed, limit, allocated, available),
        })
    rows.sort(key=lambda r: (DIMENSION_ORDER.index(r["resource"]), r["label"]))
    return {"quota_rows": rows}


# --- queue panel -----------------------------------------------------------------------------


def _job_cost(job, prices: Prices, now: dt.datetime) -> Decimal | None:
    if not prices:
        return None
    total = Decimal(0)
    priced = False
    for b in job.open_bindings:
        price = prices.at(b.accelerator.model_id, b.start)
        if price is None:
            continue
        priced = True
        hours = Decimal(max((now - b.start).total_seconds(), 0) / 3600)
        if b.mig_profile:
            share = Decimal(_mig_slices(b.mig_profile)) / 7
        else:
            share = Decimal(b.share_milli) / 1000
        total += hours * share * price
    return total.quantize(Decimal("0.01")) if priced else None


def _elapsed(since: dt.datetime | None, now: dt.datetime) -> str:
    if since is None:
        return ""
    minutes = int(max((now - since).total_seconds(), 0) // 60)
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    return (f"{days} d " if days else "") + f"{hours} h {minutes:02d} min"


def queue_panel(user, scope: Scope, now: dt.datetime, prices: Prices | None = None) -> dict:
    from scheduling.cycle import QUEUED_STATES
    from scheduling.models import ACTIVE_STATES, Binding, Job

    counts = Job.objects.filter(scope.q()).aggregate(
        running=Count("id", filter=Q(state__in=ACTIVE_STATES)),
        pending=Count("id", filter=Q(state__in=QUEUED_STATES)),
    )
    jobs = access.visible_to(user, Job).filter(scope.q()).annotate(
        mine=Case(When(submitter_id=user.pk, then=Value(0)), default=Value(1), output_field=IntegerField())
    ).select_related("spec", "project__tenant", "submitter")
    running = list(
        jobs.filter(state__in=ACTIVE_STATES)
        .prefetch_related(Prefetch("bindings", to_attr="open_bindings", queryset=Binding.objects.filter(
            end__isnull=True).select_related("accelerator__node", "accelerator__model").order_by("replica", "id")))
        .order_by("mine", F("started").asc(nulls_last=True), "pk")[:QUEUE_ROWS]
    )
    prices = prices if prices is not None else Prices()
    currency = _currency()
    for job in running:
        job.elapsed = _elapsed(job.started or job.admitted, now)
        job.cost = _job_cost(job, prices, now)
        nodes: dict[str, list[str]] = defaultdict(list)
        for b in job.open_bindings:
            nodes[b.accelerator.node.name].append(
                f"{b.accelerator.index}" + (f" ({b.mig_profile})" if b.mig_profile
                                            else "" if b.share_milli == 1000 else f" ({b.share_milli / 10:.0f}%)"))
        job.placement = "; ".join(f"{node} gpu {', '.join(idx)}" for node, idx in nodes.items())
        job.cards = _num(sum((_mig_slices(b.mig_profile) / 7 if b.mig_profile else b.share_milli / 1000)
                             for b in job.open_bindings))
    pending = list(jobs.filter(state__in=QUEUED_STATES)
                   .order_by("mine", F("queue_position").asc(nulls_last=True), "submitted", "pk")[:QUEUE_ROWS])
    ctx = {
        "running": running, "pending": pending, "counts": counts, "currency": currency,
        "shows_jobs": _shows_jobs(user, scope), "job_list_url": reverse("scheduling:job_list"),
    }
    if scope.kind == "platform":
        ctx["per_tenant"] = list(
            Job.objects.filter(state__in=(*ACTIVE_STATES, *QUEUED_STATES)).values("tenant__slug", "tenant__name")
            .annotate(running=Count("id", filter=Q(state__in=ACTIVE_STATES)),
                      pending=Count("id", filter=Q(state__in=QUEUED_STATES)))
            .order_by("tenant__slug")
        )
    return ctx


def _shows_jobs(user, scope: Scope) -> bool:
    """Whether the viewer sees job rows here, or only counts (finance roles)."""
    if access.has_platform_perm(user, "view_all_tenants"):
        return True
    ids = access.project_ids(user, "view_project_jobs")
    if scope.kind == "project":
        return scope.project.pk in ids
    return bool(ids)


def _currency() -> str:
    from django.conf import settings

    return getattr(settings, "ATRIUM_CURRENCY", "EUR")


# --- usage panel -----------------------------------------------------------------------------


# What plotly's "none" template serialises to: the figure needs no other template data.
_NONE_TEMPLATE = {"data": {"scatter": [{"type": "scatter"}]}}


def _figure(traces: list[dict], *, title: str, y_title: str, stacked: bool = True) -> dict:
    """A plotly bar-chart figure as the plain dict plotly.js reads.

    Built directly, not through plotly.graph_objects: its validation of every property cost
    more than all the dashboard's SQL. The dict is exactly what go.Figure(...).to_plotly_json()
    gave for these traces (portal/tests/test_dashboard.py checks it against plotly)."""
    return {
        "data": [{**t, "type": "bar"} for t in traces],
        "layout": {
            "barmode": "stack" if stacked else "group", "height": 300,
            "legend": {"orientation": "h", "y": -0.2},
            "margin": {"b": 48, "l": 56, "r": 16, "t": 44},
            "template": _NONE_TEMPLATE,
            "title": {"font": {"size": 15}, "text": title},
            "xaxis": {"type": "date"},
            "yaxis": {"rangemode": "tozero", "title": {"text": y_title}},
        },
    }


def usage_panel(user, scope: Scope, now: dt.datetime, prices: Prices | None = None) -> dict:
    from scheduling.cycle import month_start

    first_day = (now - dt.timedelta(days=USAGE_DAYS - 1)).replace(hour=0, minute=0, second=0, microsecond=0)
    start = min(first_day, month_start(now))
    rows = list(
        access.visible_to(user, "metering.UsageRecord").filter(scope.q(), hour__gte=start, hour__lt=now)
        .annotate(day=TruncDay("hour"))
        .values("day", "accelerator_model_id", "accelerator_model__short_name")
        .annotate(mcs=Sum("milli_card_seconds")).order_by("day", "accelerator_model__short_name")
    )
    prices = prices if prices is not None else Prices()
    month = month_start(now)
    days = [(first_day + dt.timedelta(days=i)).date().isoformat() for i in range(USAGE_DAYS)]
    by_model: dict[str, dict[str, float]] = defaultdict(dict)
    cost_by_day: dict[str, float] = defaultdict(float)
    month_hours, month_cost, window_hours = 0.0, Decimal(0), 0.0
    for row in rows:
        hours = row["mcs"] / 1000 / 3600
        day = row["day"].date().isoformat()
        price = prices.at(row["accelerator_model_id"], row["day"] + dt.timedelta(hours=12))
        if row["day"] >= first_day:
            by_model[row["accelerator_model__short_name"]][day] = hours
            window_hours += hours
            if price is not None:
                cost_by_day[day] += float(price) * hours
        if row["day"] >= month:
            month_hours += hours
            if price is not None:
                month_cost += price * Decimal(hours)
    ctx = {
        "month_hours": _num(month_hours), "window_hours": _num(window_hours), "usage_days": USAGE_DAYS,
        "has_prices": bool(prices), "month_cost": f"{month_cost:,.2f}", "currency": _currency(),
        "usage_table": [
            {"day": d, "cells": [_num(by_model[m].get(d, 0.0)) for m in sorted(by_model)],
             "cost": f"{cost_by_day.get(d, 0.0):,.2f}"}
            for d in days if any(d in by_model[m] for m in by_model)
        ],
        "usage_models": sorted(by_model),
    }
    if by_model:
        ctx["hours_chart"] = _figure(
            [{"x": days, "y": [round(by_model[m].get(d, 0.0), 3) for d in days], "name": m} for m in sorted(by_model)],
            title=f"Card-hours per day, last {USAGE_DAYS} days", y_title="card-hours",
        )
    if prices and cost_by_day:
        ctx["cost_chart"] = _figure(
            [{"x": days, "y": [round(cost_by_day.get(d, 0.0), 2) for d in days], "name": "estimated cost"}],
            title=f"Estimated cost per day ({ctx['currency']})", y_title=ctx["currency"],
        )
    ctx.update(_tokens(user, scope, first_day, now, days))
    return ctx


def _tokens(user, scope: Scope, first_day: dt.datetime, now: dt.datetime, days: list[str]) -> dict:
    """Tokens by model service, once serving records them (the panel shows only with data)."""
    try:
        model = apps.get_model("serving", "TokenUsage")
        qs = access.visible_to(user, model)
    except LookupError:
        return {}
    rows = list(qs.filter(scope.q(), hour__gte=first_day, hour__lt=now).annotate(day=TruncDay("hour"))
                .values("day", "service__name").annotate(tokens=Sum(F("input_tokens") + F("output_tokens")))
                .order_by("day"))
    if not rows:
        return {}
    by_service: dict[str, dict[str, float]] = defaultdict(dict)
    for row in rows:
        by_service[row["service__name"]][row["day"].date().isoformat()] = row["tokens"]
    return {"tokens_chart": _figure(
        [{"x": days, "y": [by_service[s].get(d, 0) for d in days], "name": s} for s in sorted(by_service)],
        title="Tokens per day by model service", y_title="tokens",
    )}


# --- alarms panel ----------------------------------------------------------------------------


def alarms_panel(user, scope: Scope, now: dt.datetime) -> dict:
    try:
        alarms = access.visible_to(user, "metering.Alarm")
    except LookupError:  # metering's Alarm not installed in this build
        return {"alarms": None}
    alarms = alarms.filter(resolved__isnull=True)
    if scope.kind == "project":
        alarms = alarms.filter(Q(project_id=scope.project.pk) | Q(tenant_id=scope.tenant.pk, project__isnull=True))
    elif scope.kind == "tenant":
        alarms = alarms.filter(tenant_id=scope.tenant.pk)
    rows = list(alarms.select_related("tenant", "project").order_by(
        Case(When(severity="critical", then=Value(0)), When(severity="warning", then=Value(1)), default=Value(2),
             output_field=IntegerField()), "-raised", "-id")[:ALARM_ROWS + 1])
    return {"alarms": rows[:ALARM_ROWS], "alarms_more": len(rows) > ALARM_ROWS}


PANEL_BUILDERS = {
    "alarms": alarms_panel,
    "quota": quota_panel,
    "queue": queue_panel,
    "usage": usage_panel,
}


def panel_context(user, scope: Scope, panel: str, now: dt.datetime | None = None) -> dict:
    now = now or timezone.now()
    return {"scope": scope, "now": now, **PANEL_BUILDERS[panel](user, scope, now)}


def scoped_context(user, scope: Scope, now: dt.datetime | None = None) -> dict:
    """Every panel for the full page; prices are read once and shared."""
    now = now or timezone.now()
    prices = Prices()
    ctx = {"scope": scope, "now": now}
    ctx.update(alarms_panel(user, scope, now))
    ctx.update(quota_panel(user, scope, now))
    ctx.update(queue_panel(user, scope, now, prices))
    ctx.update(usage_panel(user, scope, now, prices))
    return ctx


# --- what every user sees besides the scoped panels ------------------------------------------


def home_context(user) -> dict:
    """The parts that do not depend on a scope: platform roles, the fleet for inventory roles,
    the work order's nodes for a vendor."""
    from scheduling.models import Node

    perms = access.platform_perms(user)
    ctx: dict = {"platform_roles": sorted(user.platform_roles.values_list("role", flat=True))}
    if "view_inventory" in perms:
        ctx["inventory"] = Node.objects.aggregate(
            nodes=Count("id", distinct=True),
            cards=Count("accelerators", distinct=True),
            unhealthy=Count("accelerators", filter=~Q(accelerators__health="healthy"), distinct=True),
        )
    if access.is_vendor_only(user):
        ctx["vendor_nodes"] = list(access.visible_to(user, Node).prefetch_related("accelerators"))
    return ctx

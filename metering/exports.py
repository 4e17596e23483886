"""Report lines and the three report files: CSV, XLSX and FOCUS 1.2 CSV.

Every file is written from the same "atoms" (usage per day-or-period, tenant, project,
accelerator model, pool, model service) whose costs are rounded once, to the micro-unit of
the currency, before any grouping. Lines are exact sums of atoms, so the lines of every
format add up to the same total, to the last digit. Rows are read through the requester's
visibility (tenants.access), never around it; this module writes files, never domain state.

PostgreSQL does the per-row work (one GROUP BY over the ledger, the price of each hour picked
inside that scan); Python only sees grouped rows, a few thousand for a month of every tenant,
and never runs a query per row, tenant or project.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal

from django.conf import settings
from django.core.files import File
from django.db import connections, transaction
from django.db.models import BigIntegerField, Case, Q, Sum, Value, When
from django.db.models.functions import Cast, TruncDay
from openpyxl import Workbook
from openpyxl.styles import Font
from openpyxl.utils import get_column_letter

from metering import services
from metering.models import (
    Granularity,
    PoolCapacity,
    Price,
    Report,
    ReportGrouping,
    ReportMode,
    TokenPrice,
    TokenUsage,
    UsageRecord,
)
from tenants import access

ZERO = Decimal(0)
Q6 = services.COST_PLACES
ZERO6 = ZERO.quantize(Q6)
NO_SERVICE = "(batch jobs)"
IDLE = "(idle capacity)"
FAULTY = "(faulty capacity)"  # quarantined or failed cards: nobody's use, and not idle either
SPOOL_BYTES = 8 * 1024 * 1024  # files larger than this go to a temporary file, not memory


@dataclass(slots=True)
class Atom:
    day: dt.date | None
    tenant_id: int | None
    project_id: int | None
    accelerator_model_id: int | None
    pool_id: int | None
    model_service: str
    mcs: int = 0
    list_cost: Decimal = ZERO
    idle_share: Decimal = ZERO
    tokens_in: int = 0
    tokens_out: int = 0

    @property
    def cost(self) -> Decimal:
        return self.list_cost + self.idle_share

    @property
    def card_hours(self) -> Decimal:
        return Decimal(self.mcs) / services.MCS_PER_CARD_HOUR


@dataclass(slots=True)
class Names:
    """What the files call things, read once per report as plain values (no model instances)."""

    tenant: dict[int, str]  # pk -> slug
    project: dict[int, tuple[int, str]]  # pk -> (tenant pk, slug)
    model: dict[int, tuple[str, str]]  # pk -> (name, short name)
    pool: dict[int, str]  # pk -> name

    @classmethod
    def load(cls) -> Names:
        from scheduling.models import AcceleratorModel, ResourcePool
        from tenants.models import Project, Tenant

        return cls(
            tenant=dict(Tenant.objects.values_list("pk", "slug")),
            project={pk: (tenant_id, slug) for pk, tenant_id, slug in Project.objects.values_list("pk", "tenant_id", "slug")},
            model={pk: (name, short) for pk, name, short in AcceleratorModel.objects.values_list("pk", "name", "short_name")},
            pool=dict(ResourcePool.objects.values_list("pk", "name")),
        )


@dataclass
class Lines:
    columns: list[str]
    rows: list[dict]
    atoms: list[Atom]
    names: Names | None = None
    total_cost: Decimal = ZERO
    total_card_hours: Decimal = ZERO
    totals: dict = field(default_factory=dict)


def within_usage_reach(user, qs):
    """Rows with tenant/project columns (tokens, rollups) narrowed by the usage ledger's own rule."""
    rule = access.RULES[("metering.usagerecord", "view")]
    if any(p in access.platform_perms(user) for p in rule.platform):
        return qs
    cond = Q(pk__in=[])
    if rule.project_perm:
        cond |= Q(project_id__in=access.project_ids(user, rule.project_perm))
    if rule.tenant_perm:
        cond |= Q(tenant_id__in=access.tenant_ids(user, rule.tenant_perm))
    return qs.filter(cond)


def _chunks(lo: dt.datetime, hi: dt.datetime):
    """Calendar-month pieces of the period, one ledger query each, so a long report shows
    progress. The price: over all 14 months of atrium_scale the 14 queries take 7.7 s where one
    query over the whole period takes 3.7 s (psql, JIT off, load ~6); a monthly report is one
    piece and pays nothing. Smaller pieces than a month would cost more still."""
    t = lo
    while t < hi:
        end = min(hi, services.day_start(services.next_month(t.date())))
        yield t, end
        t = end


def _price_segments(prices, key_field: str, lo: dt.datetime, hi: dt.datetime):
    """Which price row applies to each ledger row of [lo, hi), for price rows ordered by
    (key, effective_from): (the one price row of each key whose price holds over the whole
    period, a CASE giving the price row's pk for the keys whose price changes inside it or
    None; NULL for every other row, whose price is then the constant one). The CASE is
    evaluated inside the one scan and becomes a GROUP BY key, so a price change costs one
    more group, not a query; most months need no CASE at all."""
    by_key: dict = defaultdict(list)
    for p in prices:
        by_key[getattr(p, key_field)].append(p)
    constant, whens = {}, []
    for key, rows in by_key.items():
        live = [(p, rows[i + 1].effective_from if i + 1 < len(rows) else None) for i, p in enumerate(rows)]
        live = [(p, until) for p, until in live if p.effective_from < hi and (until is None or until > lo)]
        if len(live) == 1 and live[0][0].effective_from <= lo:
            constant[key] = live[0][0]
            continue
        for p, until in live:  # hours before the first price of a key cost nothing (CASE default)
            cond = Q(**{key_field: key, "hour__gte": p.effective_from})
            if until is not None:
                cond &= Q(hour__lt=until)
            whens.append(When(cond, then=Value(p.pk)))
    case = Case(*whens, default=Value(None), output_field=BigIntegerField()) if whens else None
    return constant, case, {p.pk: p for p in prices}


def _micro(n: int, d: int) -> Decimal:
    """n / d currency micro-units as money, rounded half to even like Decimal.quantize(Q6):
    money is summed as exact integers and becomes a Decimal once per atom."""
    q, r = divmod(n, d)
    if 2 * r > d or (2 * r == d and q & 1):
        q += 1
    return Decimal(q).scaleb(-6) if q else ZERO6


def _units(value: Decimal, places: int) -> int:
    """A price or an amount with at most `places` decimals as an exact integer."""
    return int(value.scaleb(places))


@contextmanager
def _without_jit(using: str):
    """Run the enclosed queries with PostgreSQL's JIT off. The planner turns JIT on for a scan of
    a month of ledger rows, and compiling it (in every parallel worker, again for every query)
    takes longer than it saves: on atrium_scale 14 monthly chunks took 14.4 s with JIT and 7.7 s
    without, one month about 0.1 s less. SET LOCAL lasts until the end of this transaction."""
    conn = connections[using]
    if conn.vendor != "postgresql":
        yield
        return
    with transaction.atomic(using=using):
        with conn.cursor() as cur:
            cur.execute("SET LOCAL jit = off")
        yield


def _grouped(qs, keys: list[str], sums: dict, by_day: bool, case):
    """(day or None, *keys, price pk or None, *sums) per group: the GROUP BY runs in PostgreSQL."""
    group = list(keys)
    if by_day:
        qs = qs.annotate(day=TruncDay("hour", tzinfo=dt.UTC))
        group.insert(0, "day")
    if case is not None:
        qs = qs.annotate(price_pk=case)
        group.append("price_pk")
    # integer sums stay integers (SUM(bigint) is numeric in PostgreSQL, a Decimal per row in Python)
    sums = {name: Cast(agg, BigIntegerField()) for name, agg in sums.items()}
    query = qs.values(*group).annotate(**sums).values_list(*group, *sums).order_by()
    with _without_jit(query.db):
        rows = list(query)
    n = len(keys)
    for r in rows:
        if by_day:
            day, r = r[0].date(), r[1:]
        else:
            day = None
        yield day, r[:n], (r[n] if case is not None else None), r[-len(sums):]


def report_lines(report: Report, progress=lambda pct: None) -> Lines:
    lo, hi = services.day_start(report.period_start), services.day_start(report.period_end)
    by_day = report.grouping == ReportGrouping.DAY
    scope = report.scope_filter
    user = report.requested_by
    names = Names.load()
    project = names.project
    atoms: dict[tuple, Atom] = {}
    raw: dict[tuple, int] = defaultdict(int)  # price in 1/10,000 x milli-card-seconds, exact; rounded once below
    chunks = list(_chunks(lo, hi))
    prices = list(Price.objects.order_by("accelerator_model_id", "effective_from"))
    price_e4 = {p.pk: _units(p.per_card_hour, 4) for p in prices}  # the field has 4 decimal places
    progress(5)
    # card time of a model service's replicas is the service's: its job is the ledger row's job
    service_of_job = _service_jobs()

    def add_card_time(qs, group: list[str], constant, case, by_pk) -> None:
        for day, keys, price_pk, (mcs,) in _grouped(qs, group, {"mcs": Sum("milli_card_seconds")}, by_day, case):
            project_id, model_id, pool_id = keys[:3]
            price = by_pk[price_pk] if price_pk is not None else constant.get(model_id)
            key = (day, project[project_id][0], project_id, model_id, pool_id,
                   service_of_job[keys[3]] if len(keys) > 3 else "")
            atom = atoms.get(key)
            if atom is None:
                atom = atoms[key] = Atom(*key)
            atom.mcs += mcs
            if price is not None:
                raw[key] += price_e4[price.pk] * mcs

    # a project names its tenant, so the GROUP BY is the narrower (project, model, pool)
    group = ["project_id", "accelerator_model_id", "pool_id"]
    for i, (a, b) in enumerate(chunks):
        qs = access.visible_to(user, UsageRecord.objects.filter(scope, hour__gte=a, hour__lt=b))
        segments = _price_segments(prices, "accelerator_model_id", a, b)
        if service_of_job:
            add_card_time(qs.filter(job_id__in=service_of_job), [*group, "job_id"], *segments)
            qs = qs.exclude(job_id__in=service_of_job)
        add_card_time(qs, group, *segments)
        progress(5 + int(75 * (i + 1) / len(chunks)))
    # price/10^4 x mcs / 3.6e6 card-hours, in micro-units: raw x 10^6 / (10^4 x 3.6e6) = raw / 36,000
    per_micro = 10_000 * services.MCS_PER_CARD_HOUR // 1_000_000
    for key, value in raw.items():
        atoms[key].list_cost = _micro(value, per_micro)

    _tokens(user, atoms, scope, lo, hi, by_day)
    _idle(report, atoms, lo, hi, by_day)
    progress(90)
    return _group(report, list(atoms.values()), names)


def _service_jobs() -> dict[int, str]:
    """{scheduling job id: model service slug} of every published (or retired) model service."""
    from serving.models import ModelService

    return dict(ModelService.objects.filter(job__isnull=False).values_list("job_id", "slug"))


def _tokens(user, atoms: dict, scope: Q, lo, hi, by_day: bool) -> None:
    """Tokens per (day, tenant, project, model service), each priced piece rounded once."""
    prices = list(TokenPrice.objects.order_by("model_name", "effective_from"))
    constant, case, by_pk = _price_segments(prices, "model_name", lo, hi)
    qs = within_usage_reach(user, TokenUsage.objects.filter(scope, hour__gte=lo, hour__lt=hi))
    sums = {"tin": Sum("input_tokens"), "tout": Sum("output_tokens")}
    for day, (tenant_id, project_id, service, model_name), price_pk, (tin, tout) in _grouped(
            qs, ["tenant_id", "project_id", "model_service", "model_name"], sums, by_day, case):
        price = by_pk[price_pk] if price_pk is not None else constant.get(model_name)
        key = (day, tenant_id, project_id, None, None, service)
        atom = atoms.get(key)
        if atom is None:
            atom = atoms[key] = Atom(*key)
        atom.tokens_in += tin
        atom.tokens_out += tout
        if price is not None:  # 4-decimal prices per million tokens: micro-units = (p x 10^4 x tokens) / 10^4
            cost = _units(price.per_million_input, 4) * tin + _units(price.per_million_output, 4) * tout
            atom.list_cost += _micro(cost, 10_000)


def _idle(report: Report, atoms: dict, lo, hi, by_day: bool) -> None:
    """Idle and faulty capacity (PoolCapacity, per pool and accelerator model).

    Chargeback: each pool's idle cost is shared among its users by their card time (like
    OpenCost's share-idle). A report of every tenant also shows, on lines of their own and with
    their card-hours (so a FOCUS row's quantity x unit price is its cost): in showback all idle
    capacity, in chargeback the idle capacity of pools nobody used in the period (no use to
    share it by), and in both modes faulty card time, which is nobody's use and not idle cost.
    A tenant's or a project's report has neither."""
    days = PoolCapacity.objects.filter(granularity=Granularity.DAY, period__gte=lo.date(), period__lt=hi.date())
    cap = {
        (r["pool_id"], r["accelerator_model_id"]): r
        for r in days.values("pool_id", "accelerator_model_id")
        .annotate(idle=Sum("idle_cost"), idle_mcs=Sum("idle_milli_card_seconds"), used=Sum("used_milli_card_seconds"),
                  faulty=Sum("faulty_cost"), faulty_mcs=Sum("faulty_milli_card_seconds")).order_by()
    }
    if report.mode == ReportMode.CHARGEBACK:  # only usage atoms exist yet
        # each atom's share of its pool's idle cost, by its card time: idle x mcs / used
        share = {k: (_units(c["idle"], 6), c["used"]) for k, c in cap.items() if c["used"] and c["idle"] is not None}
        for atom in atoms.values():
            c = share.get((atom.pool_id, atom.accelerator_model_id))
            if c and atom.mcs:
                atom.idle_share = _micro(c[0] * atom.mcs, c[1])
    if report.tenant_id or report.project_id:
        return
    idle_apart = set(cap) if report.mode == ReportMode.SHOWBACK else {k for k, c in cap.items() if not c["used"]}
    if by_day:
        parts = [((r["period"], r["pool_id"], r["accelerator_model_id"]), r["idle_cost"], r["idle_milli_card_seconds"],
                  r["faulty_cost"], r["faulty_milli_card_seconds"])
                 for r in days.values("period", "pool_id", "accelerator_model_id", "idle_cost", "idle_milli_card_seconds",
                                      "faulty_cost", "faulty_milli_card_seconds")]
    else:
        parts = [((None, pool_id, model_id), c["idle"], c["idle_mcs"], c["faulty"], c["faulty_mcs"])
                 for (pool_id, model_id), c in cap.items()]
    for (day, pool_id, model_id), idle, idle_mcs, faulty, faulty_mcs in parts:
        if idle and (pool_id, model_id) in idle_apart:
            key = (day, None, None, model_id, pool_id, IDLE)
            atoms[key] = Atom(*key, mcs=idle_mcs or 0, list_cost=idle.quantize(Q6))
        if faulty:
            key = (day, None, None, model_id, pool_id, FAULTY)
            atoms[key] = Atom(*key, mcs=faulty_mcs or 0, list_cost=faulty.quantize(Q6))


def _group(report: Report, atoms: list[Atom], names: Names) -> Lines:
    g = report.grouping
    tenants, projects, models = names.tenant, names.project, names.model

    def label(a: Atom) -> tuple:
        tenant = tenants[a.tenant_id] if a.tenant_id else a.model_service  # IDLE or FAULTY
        if g == ReportGrouping.TENANT:
            return (tenant,)
        if g == ReportGrouping.PROJECT:
            return (tenant, projects[a.project_id][1] if a.project_id else a.model_service)
        if g == ReportGrouping.ACCELERATOR_MODEL:
            return (models[a.accelerator_model_id][1] if a.accelerator_model_id else "(tokens)",)
        if g == ReportGrouping.MODEL_SERVICE:
            return (a.model_service or NO_SERVICE,)
        return (a.day.isoformat() if a.day else "",)

    label_cols = {"tenant": ["tenant"], "project": ["tenant", "project"], "accelerator_model": ["accelerator_model"],
                  "model_service": ["model_service"], "day": ["day"]}[g]
    # [milli-card-seconds, input tokens, output tokens, list cost, idle share] per line
    grouped: dict[tuple, list] = {}
    for a in atoms:
        acc = grouped.get(k := label(a))
        if acc is None:
            acc = grouped[k] = [0, 0, 0, ZERO, ZERO]
        acc[0] += a.mcs
        acc[1] += a.tokens_in
        acc[2] += a.tokens_out
        acc[3] += a.list_cost
        acc[4] += a.idle_share
    rows = []
    for k in sorted(grouped):
        mcs, tin, tout, list_cost, idle = grouped[k]
        rows.append({**dict(zip(label_cols, k, strict=True)),
                     "card_hours": (Decimal(mcs) / services.MCS_PER_CARD_HOUR).quantize(Q6),
                     "input_tokens": tin, "output_tokens": tout, "list_cost": list_cost, "idle_share": idle,
                     "cost": list_cost + idle})
    columns = [*label_cols, "card_hours", "input_tokens", "output_tokens", "list_cost", "idle_share", "cost"]
    numeric = columns[len(label_cols):]
    totals = {c: sum((r[c] for r in rows), 0) for c in numeric}
    return Lines(columns=columns, rows=rows, atoms=atoms, names=names, total_cost=Decimal(totals["cost"]),
                 total_card_hours=Decimal(totals["card_hours"]), totals=totals)


# --- files -------------------------------------------------------------------------------


def _total_row(lines: Lines) -> list:
    first_num = lines.columns.index("card_hours")
    return ["TOTAL", *[""] * (first_num - 1), *(lines.totals[c] for c in lines.columns[first_num:])]


def write_csv(lines: Lines, out) -> None:
    w = csv.writer(out)
    w.writerow(lines.columns)
    w.writerows([r[c] for c in lines.columns] for r in lines.rows)
    w.writerow(_total_row(lines))


def to_csv(lines: Lines) -> str:
    out = io.StringIO()
    write_csv(lines, out)
    return out.getvalue()


def write_xlsx(report: Report, lines: Lines, out) -> None:
    """One sheet: bold header and totals row, a number format on every numeric cell, frozen
    header. openpyxl's write-only mode was measured slower here (50 vs 42 ms for 200 lines,
    690 vs 445 ms for 2,000): its per-cell objects cost more than the memory it saves on a
    sheet of lines, which is never larger than the number of projects or days."""
    wb = Workbook()
    ws = wb.active
    ws.title = "report"
    ws.append(lines.columns)
    bold = Font(bold=True)
    for cell in ws[1]:
        cell.font = bold
    for r in lines.rows:
        ws.append([r[c] for c in lines.columns])
    ws.append(_total_row(lines))
    for cell in ws[ws.max_row]:
        cell.font = bold
    money = f'#,##0.00 "{report.currency}"'
    formats = {"card_hours": "#,##0.000", "input_tokens": "#,##0", "output_tokens": "#,##0",
               "list_cost": money, "idle_share": money, "cost": money}
    for idx, col in enumerate(lines.columns, start=1):
        if col in formats:
            for (cell,) in ws.iter_rows(min_row=2, min_col=idx, max_col=idx):
                cell.number_format = formats[col]
        ws.column_dimensions[get_column_letter(idx)].width = 16
    ws.freeze_panes = "A2"
    wb.save(out)


def to_xlsx(report: Report, lines: Lines) -> bytes:
    buf = io.BytesIO()
    write_xlsx(report, lines, buf)
    return buf.getvalue()


# FOCUS 1.2 columns: (name, type). Types are the spec's data types; the test reads them back.
FOCUS_COLUMNS: list[tuple[str, str]] = [
    ("BilledCost", "Decimal"), ("BillingAccountId", "String"), ("BillingAccountName", "String"),
    ("BillingAccountType", "String"), ("BillingCurrency", "CurrencyCode"), ("BillingPeriodEnd", "DateTime"),
    ("BillingPeriodStart", "DateTime"), ("ChargeCategory", "String"), ("ChargeClass", "String"),
    ("ChargeDescription", "String"), ("ChargeFrequency", "String"), ("ChargePeriodEnd", "DateTime"),
    ("ChargePeriodStart", "DateTime"), ("ConsumedQuantity", "Decimal"), ("ConsumedUnit", "String"),
    ("ContractedCost", "Decimal"), ("ContractedUnitPrice", "Decimal"), ("EffectiveCost", "Decimal"),
    ("InvoiceIssuerName", "String"), ("ListCost", "Decimal"), ("ListUnitPrice", "Decimal"),
    ("PricingCategory", "String"), ("PricingCurrency", "CurrencyCode"), ("PricingQuantity", "Decimal"),
    ("PricingUnit", "String"), ("ProviderName", "String"), ("PublisherName", "String"), ("RegionId", "String"),
    ("RegionName", "String"), ("ResourceId", "String"), ("ResourceName", "String"), ("ResourceType", "String"),
    ("ServiceCategory", "String"), ("ServiceName", "String"), ("ServiceSubcategory", "String"), ("SkuId", "String"),
    ("SkuPriceId", "String"), ("SubAccountId", "String"), ("SubAccountName", "String"), ("SubAccountType", "String"),
    ("Tags", "JSON"),
    ("x_TenantId", "String"), ("x_TenantName", "String"), ("x_Pool", "String"), ("x_ModelService", "String"),
    ("x_IdleShareCost", "Decimal"), ("x_ReportMode", "String"), ("x_ReportId", "String"),
]
FOCUS_NAMES = [c for c, _ in FOCUS_COLUMNS]


# Where each FOCUS column's value comes from: the report, the owner (tenant and project), the
# resource (accelerator model and pool, or model service), the charge period, or the row.
FOCUS_ROW_COLUMNS = ("BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "ListUnitPrice",
                     "ContractedUnitPrice", "ConsumedQuantity", "PricingQuantity", "x_IdleShareCost")
FOCUS_OWNER_COLUMNS = ("SubAccountId", "SubAccountName", "SubAccountType", "Tags", "x_TenantId", "x_TenantName")
FOCUS_RESOURCE_COLUMNS = ("ChargeDescription", "ConsumedUnit", "PricingUnit", "ResourceId", "ResourceName",
                          "ResourceType", "ServiceCategory", "ServiceName", "ServiceSubcategory", "SkuId", "SkuPriceId",
                          "x_Pool", "x_ModelService")
FOCUS_PERIOD_COLUMNS = ("ChargePeriodStart", "ChargePeriodEnd")


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _atom_order(a: Atom) -> tuple:
    return (a.day or dt.date.min, a.tenant_id or 0, a.project_id or 0, a.accelerator_model_id or 0, a.pool_id or 0,
            a.model_service)


_NEEDS_QUOTES = re.compile(r'[,"\r\n]').search


def _csv_field(value) -> str:
    """A field as the csv module's default dialect writes it: quoted only when it must be."""
    text = str(value)
    if _NEEDS_QUOTES(text):
        return '"' + text.replace('"', '""') + '"'
    return text


def _same(source: str, cols: dict) -> dict:
    return cols


class _FocusParts:
    """The columns a FOCUS row shares with other rows, built once per report, owner, resource
    and charge period, each passed through `shape(source, columns)` once (a plain dict, or CSV text)."""

    def __init__(self, report: Report, names: Names, shape=_same):
        self.names, self.shape = names, shape
        account = getattr(settings, "ATRIUM_INSTALLATION_NAME", "atrium")
        bp_start, bp_end = _iso(services.day_start(report.period_start)), _iso(services.day_start(report.period_end))
        self.report = shape("report", dict(
            BillingAccountId=account, BillingAccountName=account, BillingAccountType="Installation",
            BillingCurrency=report.currency, BillingPeriodEnd=bp_end, BillingPeriodStart=bp_start,
            ChargeCategory="Usage", ChargeClass="", ChargeFrequency="Usage-Based", InvoiceIssuerName=account,
            PricingCategory="Standard", PricingCurrency=report.currency, ProviderName=account, PublisherName=account,
            RegionId="", RegionName="", x_ReportMode=report.mode, x_ReportId=str(report.pk),
        ))
        self.owners: dict = {}
        self.resources: dict = {}
        self.periods: dict = {None: shape("period", {"ChargePeriodStart": bp_start, "ChargePeriodEnd": bp_end})}

    def owner(self, tenant_id, project_id) -> dict:
        part = self.owners.get((tenant_id, project_id))
        if part is None:
            slug = self.names.project[project_id][1] if project_id else None
            tenant = self.names.tenant.get(tenant_id) if tenant_id else None
            part = self.owners[tenant_id, project_id] = self.shape("owner", dict(
                SubAccountId=str(project_id) if slug else "", SubAccountName=slug or "",
                SubAccountType="Project" if slug else "",
                # keys in sorted order, so the default (C) encoder gives what sort_keys=True would
                Tags=json.dumps({"project": slug, "tenant": tenant} if slug else {"unallocated": "true"}),  # idle or faulty
                x_TenantId=str(tenant_id) if tenant else "", x_TenantName=tenant or "",
            ))
        return part

    def resource(self, model_id, pool_id, service) -> dict:
        part = self.resources.get((model_id, pool_id, service))
        if part is None:
            if model_id is None:
                rid = f"service:{service}"
                cols = dict(
                    ConsumedUnit="1000 Tokens", PricingUnit="1000 Tokens", ServiceCategory="AI and Machine Learning",
                    ServiceSubcategory="Generative AI", ServiceName="Atrium model serving", ResourceId=rid,
                    ResourceName=service, ResourceType="Model service", SkuId=rid, SkuPriceId=f"{rid}@list",
                    ChargeDescription=f"Tokens of model service {service}", x_Pool="", x_ModelService=service)
            else:
                (model_name, short), pool = self.names.model[model_id], self.names.pool[pool_id]
                rid = f"{pool}/{model_name}"
                cols = dict(
                    ConsumedUnit="GPU-Hours", PricingUnit="GPU-Hours", ServiceCategory="Compute",
                    ServiceSubcategory="Other (Compute)", ServiceName="Atrium GPU", ResourceId=rid,
                    ResourceName=f"{short} in pool {pool}", ResourceType="GPU", SkuId=rid, SkuPriceId=f"{rid}@list",
                    ChargeDescription={IDLE: f"Idle healthy {short} capacity in pool {pool}",
                                       FAULTY: f"Faulty (quarantined or failed) {short} capacity in pool {pool}",
                                       }.get(service, f"{short} card time"),
                    x_Pool=pool, x_ModelService=service)
            part = self.resources[model_id, pool_id, service] = self.shape("resource", cols)
        return part

    def period(self, day) -> dict:
        part = self.periods.get(day)
        if part is None:
            start = services.day_start(day)
            part = self.periods[day] = self.shape("period", {"ChargePeriodStart": _iso(start),
                                                             "ChargePeriodEnd": _iso(start + services.DAY)})
        return part


def _focus_atoms(lines: Lines):
    """(atom, its row columns) in file order: quantity in GPU-hours or thousands of tokens."""
    mcs_per_hour = services.MCS_PER_CARD_HOUR
    for a in sorted(lines.atoms, key=_atom_order):
        if a.accelerator_model_id is None:
            qty = (Decimal(a.tokens_in + a.tokens_out) / 1000).quantize(Q6)
        else:
            qty = (Decimal(a.mcs) / mcs_per_hour).quantize(Q6)
        list_cost, idle = a.list_cost, a.idle_share
        billed = list_cost + idle
        unit_price = (list_cost / qty).quantize(Q6) if qty else ZERO
        yield a, (billed, billed, list_cost, list_cost, unit_price, unit_price, qty, qty, idle)


def focus_rows(report: Report, lines: Lines):
    """FOCUS rows (dicts by column name) at (tenant, project, accelerator model or service,
    pool[, day]) detail: one per atom, no regrouping."""
    parts = _FocusParts(report, lines.names)
    for a, values in _focus_atoms(lines):
        yield {**parts.report, **parts.owner(a.tenant_id, a.project_id),
               **parts.resource(a.accelerator_model_id, a.pool_id, a.model_service), **parts.period(a.day),
               **dict(zip(FOCUS_ROW_COLUMNS, values, strict=True))}


def write_focus(report: Report, lines: Lines, out) -> None:
    """The FOCUS CSV, byte for byte what csv.DictWriter writes for focus_rows (a test checks).

    The file's columns fall into runs that come from one source (report, owner, resource,
    period, row). Each shared part becomes its runs' CSV text once, and each (resource,
    period) pair a row template with the report's, the resource's and the period's text in
    place, so a row is one str.format of its owner's text and its numbers."""
    source = {c: "row" for c in FOCUS_ROW_COLUMNS} | {c: "owner" for c in FOCUS_OWNER_COLUMNS} | {
        c: "resource" for c in FOCUS_RESOURCE_COLUMNS} | {c: "period" for c in FOCUS_PERIOD_COLUMNS}
    runs: list[tuple[str, list[str]]] = []
    for col in FOCUS_NAMES:
        src = source.get(col, "report")
        if runs and runs[-1][0] == src:
            runs[-1][1].append(col)
        else:
            runs.append((src, [col]))

    runs_of: dict[str, list] = defaultdict(list)
    for i, (src, run) in enumerate(runs):
        runs_of[src].append((i, run))

    def shape(src: str, cols: dict) -> dict:  # the runs one part fills, as CSV text keyed by run number
        return {i: ",".join([_csv_field(cols[c]) for c in run]) for i, run in runs_of[src]}

    owner_runs = [i for i, _ in runs_of["owner"]]

    def template(resource: dict, period: dict) -> str:
        """Placeholders {0}.. for the owner's runs, then one per row column."""
        fixed = {**parts.report, **resource, **period}
        pieces = []
        for i, (src, run) in enumerate(runs):
            if src == "owner":
                pieces.append(f"{{{owner_runs.index(i)}}}")
            elif src == "row":
                pieces.append(",".join(f"{{{len(owner_runs) + FOCUS_ROW_COLUMNS.index(c)}}}" for c in run))
            else:
                pieces.append(fixed[i].replace("{", "{{").replace("}", "}}"))
        return ",".join(pieces)

    parts = _FocusParts(report, lines.names, shape)
    templates: dict = {}
    buf = [",".join(map(_csv_field, FOCUS_NAMES))]
    for a, values in _focus_atoms(lines):
        tk = (a.accelerator_model_id, a.pool_id, a.model_service, a.day)
        row = templates.get(tk)
        if row is None:
            row = templates[tk] = template(parts.resource(*tk[:3]), parts.period(a.day)).format
        buf.append(row(*parts.owner(a.tenant_id, a.project_id).values(), *map(str, values)))  # str(): Decimal.__format__ is slow
        if len(buf) >= 2000:  # a few large writes, not one per row
            out.write("\r\n".join(buf) + "\r\n")
            buf.clear()
    if buf:
        out.write("\r\n".join(buf) + "\r\n")


def to_focus(report: Report, lines: Lines) -> str:
    out = io.StringIO()
    write_focus(report, lines, out)
    return out.getvalue()


def _save(file_field, name: str, write, text: bool) -> None:
    """Stream one file into storage through a spooled temporary file (memory while small)."""
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as raw:
        if text:
            out = io.TextIOWrapper(raw, encoding="utf-8", newline="")
            write(out)
            out.flush()
            out.detach()
        else:
            write(raw)
        raw.seek(0)
        file_field.save(name, File(raw, name=name), save=False)


def write_files(report: Report, lines: Lines) -> None:
    """The report's three files under names of its own. A build is a whole rebuild: the files of
    an earlier build are removed first, including those an attempt that died wrote before it
    could record them on the row (otherwise the retry's files would be saved beside them
    under new names)."""
    stem = f"report-{report.pk}-{report.period_start:%Y%m%d}-{report.grouping}"
    for f in (report.csv_file, report.xlsx_file, report.focus_file):
        if f:
            f.delete(save=False)
    for f, name in ((report.csv_file, f"{stem}.csv"), (report.xlsx_file, f"{stem}.xlsx"),
                    (report.focus_file, f"{stem}-focus.csv")):
        leftover = f.field.generate_filename(report, name)
        if f.storage.exists(leftover):
            f.storage.delete(leftover)
    _save(report.csv_file, f"{stem}.csv", lambda out: write_csv(lines, out), text=True)
    _save(report.xlsx_file, f"{stem}.xlsx", lambda out: write_xlsx(report, lines, out), text=False)
    _save(report.focus_file, f"{stem}-focus.csv", lambda out: write_focus(report, lines, out), text=True)

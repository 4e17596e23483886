"""Report lines and the three report files: CSV, XLSX and FOCUS 1.2 CSV.

Every file is written from the same "atoms" (usage per day-or-period, tenant, project,
accelerator model, pool, model service) whose costs are rounded once, to the micro-unit of
the currency, before any grouping. Lines are exact sums of atoms, so the lines of every
format add up to the same total, to the last digit. Rows are read through the requester's
visibility (tenants.access), never around it; this module writes files, never domain state.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal

from django.conf import settings
from django.core.files.base import ContentFile
from django.db.models import Case, DecimalField, Q, Sum, Value, When
from django.db.models.functions import TruncDay
from openpyxl import Workbook
from openpyxl.styles import Font

from metering import services
from metering.models import Granularity, PoolCapacity, Report, ReportGrouping, ReportMode, TokenUsage, UsageRecord
from tenants import access
from tenants.models import Project

ZERO = Decimal(0)
Q6 = services.COST_PLACES
NO_SERVICE = "(batch jobs)"
IDLE = "(idle capacity)"


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


@dataclass
class Lines:
    columns: list[str]
    rows: list[dict]
    atoms: list[Atom]
    names: dict = field(default_factory=dict)
    total_cost: Decimal = ZERO
    total_card_hours: Decimal = ZERO


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
    """Calendar-month pieces of the period: one ledger scan per month keeps the job near the
    SQL floor (smaller pieces turn one sequential scan into many index scans) and still gives
    a long report visible progress."""
    t = lo
    while t < hi:
        end = min(hi, services.day_start(services.next_month(t.date())))
        yield t, end
        t = end


def _price_segments(lo: dt.datetime, hi: dt.datetime):
    """(CASE over the models whose price changes inside [lo, hi) or None, constant price per other model)."""
    from metering.models import Price

    by_model: dict[int, list] = defaultdict(list)
    for p in Price.objects.order_by("accelerator_model_id", "effective_from"):
        by_model[p.accelerator_model_id].append(p)
    constant, whens = {}, []
    for model_id, prices in by_model.items():
        live = [(p, prices[i + 1].effective_from if i + 1 < len(prices) else None) for i, p in enumerate(prices)]
        live = [(p, until) for p, until in live if p.effective_from < hi and (until is None or until > lo)]
        if len(live) == 1 and live[0][0].effective_from <= lo:
            constant[model_id] = live[0][0].per_card_hour
            continue
        for p, until in live:
            cond = Q(accelerator_model_id=model_id, hour__gte=p.effective_from)
            if until is not None:
                cond &= Q(hour__lt=until)
            whens.append(When(cond, then=Value(p.per_card_hour)))
    case = Case(*whens, default=Value(Decimal(0)), output_field=DecimalField(max_digits=10, decimal_places=4))
    return (case if whens else None), constant


def report_lines(report: Report, progress=lambda pct: None) -> Lines:
    lo, hi = services.day_start(report.period_start), services.day_start(report.period_end)
    by_day = report.grouping == ReportGrouping.DAY
    scope = Q()
    if report.project_id:
        scope = Q(project_id=report.project_id)
    elif report.tenant_id:
        scope = Q(tenant_id=report.tenant_id)
    user = report.requested_by
    atoms: dict[tuple, Atom] = {}
    keys = ["project_id", "accelerator_model_id", "pool_id"]  # a project names its tenant: a narrower GROUP BY
    chunks = list(_chunks(lo, hi))
    tenant_of = dict(Project.objects.values_list("pk", "tenant_id"))  # a project names its tenant
    progress(5)
    for i, (a, b) in enumerate(chunks):
        qs = access.visible_to(user, UsageRecord.objects.filter(scope, hour__gte=a, hour__lt=b))
        case, constant = _price_segments(a, b)
        group = list(keys)
        if by_day:
            qs = qs.annotate(day=TruncDay("hour", tzinfo=dt.UTC))
            group.insert(0, "day")
        if case is not None:
            qs = qs.annotate(price=case)
            group.append("price")
        # integer sums in SQL, money in Python: the ledger is scanned once, with no numeric maths per row
        for r in qs.values(*group).annotate(mcs=Sum("milli_card_seconds")).values_list(*group, "mcs").order_by():
            if by_day:
                day, project_id, model_id, pool_id, *rest = r
                day = day.date()
            else:
                project_id, model_id, pool_id, *rest = r
                day = None
            mcs = rest[-1]
            price = rest[0] if case is not None and rest[0] is not None else constant.get(model_id, 0)
            key = (day, tenant_of[project_id], project_id, model_id, pool_id, "")
            atom = atoms.get(key)
            if atom is None:
                atom = atoms[key] = Atom(*key)
            atom.mcs += mcs
            atom.list_cost += price * mcs  # unrounded: rounding happens once, below
        progress(5 + int(75 * (i + 1) / len(chunks)))
    for atom in atoms.values():
        atom.list_cost = (atom.list_cost / services.MCS_PER_CARD_HOUR).quantize(Q6)

    tokens = within_usage_reach(user, TokenUsage.objects.filter(scope, hour__gte=lo, hour__lt=hi))
    for t in tokens.values("hour", "tenant_id", "project_id", "model_service", "model_name", "input_tokens", "output_tokens"):
        day = t["hour"].date() if by_day else None
        key = (day, t["tenant_id"], t["project_id"], None, None, t["model_service"])
        atom = atoms.get(key) or atoms.setdefault(key, Atom(*key))
        pin, pout = services.token_price_at(t["model_name"], t["hour"])
        atom.tokens_in += t["input_tokens"]
        atom.tokens_out += t["output_tokens"]
        atom.list_cost += ((pin * t["input_tokens"] + pout * t["output_tokens"]) / 1_000_000).quantize(Q6)

    _idle(report, atoms, lo, hi, by_day)
    progress(90)
    return _group(report, list(atoms.values()))


def _idle(report: Report, atoms: dict, lo, hi, by_day: bool) -> None:
    """Chargeback: spread each pool's idle cost by use; showback for every tenant: idle lines."""
    days = PoolCapacity.objects.filter(granularity=Granularity.DAY, period__gte=lo.date(), period__lt=hi.date())
    cap = {
        (r["pool_id"], r["accelerator_model_id"]): r
        for r in days.values("pool_id", "accelerator_model_id")
        .annotate(idle=Sum("idle_cost"), used=Sum("used_milli_card_seconds")).order_by()
    }
    if report.mode == ReportMode.SHOWBACK and by_day and not report.tenant_id and not report.project_id:
        for r in days.filter(idle_cost__gt=0).values("period", "pool_id", "accelerator_model_id", "idle_cost"):
            key = (r["period"], None, None, r["accelerator_model_id"], r["pool_id"], IDLE)
            atoms[key] = Atom(*key, list_cost=r["idle_cost"].quantize(Q6))
        return
    if report.mode == ReportMode.CHARGEBACK:
        for atom in atoms.values():
            c = cap.get((atom.pool_id, atom.accelerator_model_id))
            if c and c["used"] and atom.mcs:
                atom.idle_share = (c["idle"] * atom.mcs / c["used"]).quantize(Q6)
    elif not report.tenant_id and not report.project_id:
        for (pool_id, model_id), c in cap.items():
            if c["idle"]:
                key = (None, None, None, model_id, pool_id, IDLE)
                atoms[key] = Atom(*key, list_cost=c["idle"].quantize(Q6))


def _names(atoms: list[Atom]) -> dict:
    from scheduling.models import AcceleratorModel, ResourcePool
    from tenants.models import Project, Tenant

    def ids(attr):
        return {getattr(a, attr) for a in atoms if getattr(a, attr)}

    return {
        "tenant": {t.pk: t for t in Tenant.objects.filter(pk__in=ids("tenant_id"))},
        "project": {p.pk: p for p in Project.objects.filter(pk__in=ids("project_id"))},
        "model": {m.pk: m for m in AcceleratorModel.objects.filter(pk__in=ids("accelerator_model_id"))},
        "pool": {p.pk: p for p in ResourcePool.objects.filter(pk__in=ids("pool_id"))},
    }


def _group(report: Report, atoms: list[Atom]) -> Lines:
    names = _names(atoms)
    g = report.grouping

    def label(a: Atom) -> tuple:
        tenant = names["tenant"][a.tenant_id].slug if a.tenant_id else IDLE
        if g == ReportGrouping.TENANT:
            return (tenant,)
        if g == ReportGrouping.PROJECT:
            return (tenant, names["project"][a.project_id].slug if a.project_id else IDLE)
        if g == ReportGrouping.ACCELERATOR_MODEL:
            return (names["model"][a.accelerator_model_id].short_name if a.accelerator_model_id else "(tokens)",)
        if g == ReportGrouping.MODEL_SERVICE:
            return (a.model_service or NO_SERVICE,)
        return (a.day.isoformat() if a.day else "",)

    label_cols = {"tenant": ["tenant"], "project": ["tenant", "project"], "accelerator_model": ["accelerator_model"],
                  "model_service": ["model_service"], "day": ["day"]}[g]
    grouped: dict[tuple, dict] = {}
    for a in atoms:
        k = label(a)
        row = grouped.setdefault(k, {**dict(zip(label_cols, k, strict=True)), "card_hours": ZERO, "input_tokens": 0,
                                     "output_tokens": 0, "list_cost": ZERO, "idle_share": ZERO, "cost": ZERO, "_mcs": 0})
        row["_mcs"] += a.mcs
        row["input_tokens"] += a.tokens_in
        row["output_tokens"] += a.tokens_out
        row["list_cost"] += a.list_cost
        row["idle_share"] += a.idle_share
        row["cost"] += a.cost
    rows = []
    for k in sorted(grouped):
        row = grouped[k]
        row["card_hours"] = (Decimal(row.pop("_mcs")) / services.MCS_PER_CARD_HOUR).quantize(Q6)
        rows.append(row)
    columns = [*label_cols, "card_hours", "input_tokens", "output_tokens", "list_cost", "idle_share", "cost"]
    return Lines(columns=columns, rows=rows, atoms=atoms, names=names,
                 total_cost=sum((r["cost"] for r in rows), ZERO),
                 total_card_hours=sum((r["card_hours"] for r in rows), ZERO))


# --- files -------------------------------------------------------------------------------


def to_csv(lines: Lines) -> str:
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(lines.columns)
    for r in lines.rows:
        w.writerow([r[c] for c in lines.columns])
    totals = {c: sum((r[c] for r in lines.rows), 0) for c in lines.columns[lines.columns.index("card_hours"):]}
    w.writerow(["TOTAL", *[""] * (lines.columns.index("card_hours") - 1), *totals.values()])
    return out.getvalue()


def to_xlsx(report: Report, lines: Lines) -> bytes:
    wb = Workbook()
    ws = wb.active
    ws.title = "report"
    ws.append(lines.columns)
    for cell in ws[1]:
        cell.font = Font(bold=True)
    first_num = lines.columns.index("card_hours")
    for r in lines.rows:
        ws.append([r[c] for c in lines.columns])
    totals = [sum((r[c] for r in lines.rows), 0) for c in lines.columns[first_num:]]
    ws.append(["TOTAL", *[""] * (first_num - 1), *totals])
    for cell in ws[ws.max_row]:
        cell.font = Font(bold=True)
    money = f'#,##0.00 "{report.currency}"'
    formats = {"card_hours": "#,##0.000", "input_tokens": "#,##0", "output_tokens": "#,##0",
               "list_cost": money, "idle_share": money, "cost": money}
    for idx, col in enumerate(lines.columns, start=1):
        if col in formats:
            for (cell,) in ws.iter_rows(min_row=2, min_col=idx, max_col=idx):
                cell.number_format = formats[col]
        ws.column_dimensions[cell.column_letter].width = 16
    ws.freeze_panes = "A2"
    buf = io.BytesIO()
    wb.save(buf)
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


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def focus_rows(report: Report, lines: Lines) -> list[dict]:
    """FOCUS rows at (tenant, project, accelerator model or service, pool[, day]) detail."""
    n = lines.names
    bp_start, bp_end = services.day_start(report.period_start), services.day_start(report.period_end)
    bp_start_iso, bp_end_iso = _iso(bp_start), _iso(bp_end)
    account = getattr(settings, "ATRIUM_INSTALLATION_NAME", "atrium")
    tags: dict = {}
    rows = []
    # atoms are already at FOCUS detail: one row each, no regrouping
    for a in sorted(lines.atoms, key=lambda a: (a.day or dt.date.min, a.tenant_id or 0, a.project_id or 0,
                                                a.accelerator_model_id or 0, a.pool_id or 0, a.model_service)):
        day, tenant_id, project_id, model_id, pool_id, service = (
            a.day, a.tenant_id, a.project_id, a.accelerator_model_id, a.pool_id, a.model_service)
        list_cost, idle = a.list_cost, a.idle_share
        billed = list_cost + idle
        tenant, project = n["tenant"].get(tenant_id), n["project"].get(project_id)
        model, pool = n["model"].get(model_id), n["pool"].get(pool_id)
        is_tokens = model_id is None
        if is_tokens:
            qty = Decimal(a.tokens_in + a.tokens_out) / 1000
            unit, category, sub = "1000 Tokens", "AI and Machine Learning", "Generative AI"
            resource_id, resource_name, resource_type = f"service:{service}", service, "Model service"
            description = f"Tokens of model service {service}"
        else:
            qty = Decimal(a.mcs) / services.MCS_PER_CARD_HOUR
            unit, category, sub = "GPU-Hours", "Compute", "Other (Compute)"
            resource_id = f"{pool.name}/{model.name}"
            resource_name, resource_type = f"{model.short_name} in pool {pool.name}", "GPU"
            description = (f"Idle healthy {model.short_name} capacity in pool {pool.name}" if service == IDLE
                           else f"{model.short_name} card time")
        qty = qty.quantize(Q6)
        unit_price = (list_cost / qty).quantize(Q6) if qty else ZERO
        c_start = _iso(services.day_start(day)) if day else bp_start_iso
        c_end = _iso(services.day_start(day) + services.DAY) if day else bp_end_iso
        if project_id not in tags:
            tags[project_id] = json.dumps({"tenant": tenant.slug, "project": project.slug} if project else {"idle": "true"},
                                          sort_keys=True)
        rows.append({
            "BilledCost": billed, "BillingAccountId": account, "BillingAccountName": account,
            "BillingAccountType": "Installation", "BillingCurrency": report.currency,
            "BillingPeriodEnd": bp_end_iso, "BillingPeriodStart": bp_start_iso, "ChargeCategory": "Usage",
            "ChargeClass": "", "ChargeDescription": description, "ChargeFrequency": "Usage-Based",
            "ChargePeriodEnd": c_end, "ChargePeriodStart": c_start, "ConsumedQuantity": qty,
            "ConsumedUnit": unit, "ContractedCost": list_cost, "ContractedUnitPrice": unit_price,
            "EffectiveCost": billed, "InvoiceIssuerName": account, "ListCost": list_cost, "ListUnitPrice": unit_price,
            "PricingCategory": "Standard", "PricingCurrency": report.currency, "PricingQuantity": qty,
            "PricingUnit": unit, "ProviderName": account, "PublisherName": account, "RegionId": "", "RegionName": "",
            "ResourceId": resource_id, "ResourceName": resource_name, "ResourceType": resource_type,
            "ServiceCategory": category, "ServiceName": "Atrium GPU" if not is_tokens else "Atrium model serving",
            "ServiceSubcategory": sub, "SkuId": resource_id, "SkuPriceId": f"{resource_id}@list",
            "SubAccountId": str(project.pk) if project else "", "SubAccountName": project.slug if project else "",
            "SubAccountType": "Project" if project else "",
            "Tags": tags[project_id],
            "x_TenantId": str(tenant.pk) if tenant else "", "x_TenantName": tenant.slug if tenant else "",
            "x_Pool": pool.name if pool else "", "x_ModelService": service, "x_IdleShareCost": idle,
            "x_ReportMode": report.mode, "x_ReportId": str(report.pk),
        })
    return rows


def to_focus(report: Report, lines: Lines) -> str:
    out = io.StringIO()
    w = csv.writer(out)
    names = [c for c, _ in FOCUS_COLUMNS]
    w.writerow(names)
    for r in focus_rows(report, lines):
        w.writerow([r[c] for c in names])
    return out.getvalue()


def write_files(report: Report, lines: Lines) -> None:
    stem = f"report-{report.pk}-{report.period_start:%Y%m%d}-{report.grouping}"
    for f in (report.csv_file, report.xlsx_file, report.focus_file):
        if f:
            f.delete(save=False)
    report.csv_file.save(f"{stem}.csv", ContentFile(to_csv(lines).encode()), save=False)
    report.xlsx_file.save(f"{stem}.xlsx", ContentFile(to_xlsx(report, lines)), save=False)
    report.focus_file.save(f"{stem}-focus.csv", ContentFile(to_focus(report, lines).encode()), save=False)

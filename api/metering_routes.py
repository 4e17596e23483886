"""API routes over metering: usage and cost of a month, and showback/chargeback reports.

Rows come from the same visibility rules as the metering pages (metering.usagerecord and
metering.report in tenants.access); report requests go through metering.services, which
checks the requester's usage scope and audits. Costs are priced at each row's own hour.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from django.db.models import DecimalField, ExpressionWrapper, F, Sum
from django.db.models.functions import TruncDay
from django.http import FileResponse
from ninja import Field, Query, Schema

from api import ratelimit
from api.problems import ApiProblem, documented
from api.schemas import NO_NUL
from metering import services as metering
from metering.models import Report, ReportGrouping, ReportMode, UsageRecord
from tenants import access
from tenants.models import Project, Tenant


class UsageRow(Schema):
    tenant: str
    project: str
    accelerator_model: str
    card_hours: float
    cost: float


class UsageDay(Schema):
    day: dt.date
    card_hours: float
    cost: float


class UsageOut(Schema):
    month: str
    currency: str
    total_card_hours: float
    total_cost: float
    rows: list[UsageRow]
    days: list[UsageDay]


class ReportIn(Schema):
    period_start: dt.date
    period_end: dt.date = Field(description="exclusive")
    grouping: ReportGrouping = ReportGrouping.PROJECT
    mode: ReportMode = ReportMode.SHOWBACK
    tenant: str | None = Field(None, max_length=40, pattern=NO_NUL, description="tenant slug; empty = every tenant you may see")
    project: int | None = Field(None, description="project id (narrower than tenant)")


class ReportOut(Schema):
    id: int
    status: str
    progress: int
    error: str
    scope: str
    period_start: dt.date
    period_end: dt.date
    grouping: str
    mode: str
    currency: str
    lines: int
    total_card_hours: float | None
    total_cost: float | None
    created: dt.datetime
    finished: dt.datetime | None
    downloads: list[str] = Field(description="formats ready to download: csv, xlsx, focus")


def _money(raw) -> float:
    return float((Decimal(raw or 0) / metering.MCS_PER_CARD_HOUR).quantize(metering.COST_PLACES))


def _hours(mcs) -> float:
    return round((mcs or 0) / metering.MCS_PER_CARD_HOUR, 6)


def _report_out(r: Report) -> dict:
    downloads = [fmt for fmt, f in (("csv", r.csv_file), ("xlsx", r.xlsx_file), ("focus", r.focus_file)) if f]
    return {
        "id": r.pk, "status": r.status, "progress": r.progress, "error": r.error, "scope": r.scope_label,
        "period_start": r.period_start, "period_end": r.period_end, "grouping": r.grouping, "mode": r.mode,
        "currency": r.currency, "lines": r.lines,
        "total_card_hours": float(r.total_card_hours) if r.total_card_hours is not None else None,
        "total_cost": float(r.total_cost) if r.total_cost is not None else None,
        "created": r.created, "finished": r.finished, "downloads": downloads,
    }


def register(api) -> None:
    from django.conf import settings

    @api.get("/usage", response={200: UsageOut, **documented(401, 403, 422)}, tags=["usage"],
             summary="Card-hours and cost of one month, per project and accelerator model, and per day")
    def usage_month(request, month: str = Query(..., pattern=r"^\d{4}-\d{2}$", description="YYYY-MM"),
                    tenant: str = Query("", max_length=40, pattern=NO_NUL), project: int | None = None):
        try:
            first = dt.date(int(month[:4]), int(month[5:7]), 1)
        except ValueError:
            raise ApiProblem("validation-error", "month: not a month, e.g. 2026-11",
                             errors=[{"field": "month", "message": "not a month, e.g. 2026-11"}])
        lo = dt.datetime.combine(first, dt.time(), dt.UTC)
        hi = dt.datetime.combine(metering.next_month(first), dt.time(), dt.UTC)
        rows = access.visible_to(request.user, UsageRecord).filter(hour__gte=lo, hour__lt=hi)
        if tenant:
            rows = rows.filter(tenant__slug=tenant)
        if project is not None:
            rows = rows.filter(project_id=project)
        cost = Sum(ExpressionWrapper(F("milli_card_seconds") * metering.price_case(),
                                     output_field=DecimalField(max_digits=24, decimal_places=4)))
        grouped = (rows.values("tenant__slug", "project__slug", "accelerator_model__name")
                   .annotate(mcs=Sum("milli_card_seconds"), cost=cost).order_by("tenant__slug", "project__slug"))
        per_day = rows.annotate(day=TruncDay("hour")).values("day").annotate(mcs=Sum("milli_card_seconds"), cost=cost)
        out_rows = [{"tenant": r["tenant__slug"], "project": r["project__slug"],
                     "accelerator_model": r["accelerator_model__name"], "card_hours": _hours(r["mcs"]),
                     "cost": _money(r["cost"])} for r in grouped]
        return {
            "month": month, "currency": settings.ATRIUM_CURRENCY,
            "total_card_hours": round(sum(r["card_hours"] for r in out_rows), 6),
            "total_cost": round(sum(r["cost"] for r in out_rows), 6), "rows": out_rows,
            "days": [{"day": d["day"].date(), "card_hours": _hours(d["mcs"]), "cost": _money(d["cost"])}
                     for d in per_day.order_by("day")],
        }

    @api.get("/reports", response={200: list[ReportOut], **documented(401, 403, 422)}, tags=["reports"],
             summary="Reports the caller may see, newest first")
    def report_list(request, limit: int = Query(50, ge=1, le=200)):
        return [_report_out(r) for r in access.visible_to(request.user, Report).select_related("tenant", "project")[:limit]]

    @api.post("/reports", response={202: ReportOut, **documented(400, 401, 403, 404, 422, 429)}, tags=["reports"],
              summary="Ask for a showback/chargeback report; poll it, then download")
    def report_request(request, payload: ReportIn):
        from ninja import Status

        ratelimit.check(request)
        tenant = project = None
        if payload.project is not None:
            project = access.visible_to(request.user, Project.objects.select_related("tenant")).filter(pk=payload.project).first()
            if project is None:
                raise ApiProblem("validation-error", "project: no project with this id within your reach",
                                 errors=[{"field": "project", "message": "no project with this id within your reach"}])
        elif payload.tenant:
            tenant = access.visible_to(request.user, Tenant).filter(slug=payload.tenant).first()
            if tenant is None:
                raise ApiProblem("validation-error", "tenant: no tenant with this slug within your reach",
                                 errors=[{"field": "tenant", "message": "no tenant with this slug within your reach"}])
        if payload.period_end <= payload.period_start:
            raise ApiProblem("validation-error", "period_end: the period must end after it starts",
                             errors=[{"field": "period_end", "message": "the period must end after it starts"}])
        report = metering.request_report(request.user, period_start=payload.period_start, period_end=payload.period_end,
                                         grouping=payload.grouping, mode=payload.mode, tenant=tenant, project=project)
        return Status(202, _report_out(report))

    @api.get("/reports/{report_id}", response={200: ReportOut, **documented(401, 403, 404, 422)}, tags=["reports"],
             summary="A report's status and progress")
    def report_detail(request, report_id: int):
        return _report_out(access.get_visible_or_404(request.user, Report.objects.select_related("tenant", "project"),
                                                     pk=report_id))

    binary = {"schema": {"type": "string", "format": "binary"}}

    @api.get("/reports/{report_id}/download", response={200: None, **documented(401, 403, 404, 409, 422)},
             tags=["reports"], summary="Download a finished report (csv, xlsx or FOCUS csv)",
             # the file is not JSON: document its media types so clients (and schemathesis) know them
             openapi_extra={"responses": {200: {"description": "the report file, as an attachment", "content": {
                 "text/csv": binary, "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet": binary}}}})
    def report_download(request, report_id: int, format: str = Query("csv", pattern="^(csv|xlsx|focus)$")):
        report = access.get_visible_or_404(request.user, Report, pk=report_id)
        field = {"csv": report.csv_file, "xlsx": report.xlsx_file, "focus": report.focus_file}[format]
        if not field:
            raise ApiProblem("conflict", f"Report {report.pk} is {report.status}; its {format} file is not ready yet.")
        return FileResponse(field.open("rb"), as_attachment=True, filename=field.name.rsplit("/", 1)[-1])

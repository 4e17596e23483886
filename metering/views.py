"""Metering pages: usage with charts, reports (request, progress, downloads), budgets, prices.

Thin views: rows come from tenants.access.visible_to (another tenant's report or budget is a
404), changes go through metering.services (which check permission again and audit).
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from decimal import Decimal
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Q, Sum
from django.http import FileResponse, Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import redirect
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods
from django_tables2 import RequestConfig

from metering import services
from metering.exports import within_usage_reach
from metering.forms import BudgetForm, PriceForm, ReportForm
from metering.models import Budget, Granularity, PoolCapacity, Price, Report, TokenPrice, UsageRollup
from metering.tables import BudgetTable, ReportTable
from portal.rendering import render_page
from portal.services import SudoRequired
from tenants import access
from tenants.models import Project, Tenant


def _sudo_redirect(request, page: str):
    """Send the user to re-authenticate, then back to the page they acted on."""
    url = reverse("reauthenticate") + "?" + urlencode({"next": page})
    messages.info(request, "This change needs you to confirm your identity first.")
    if request.htmx:
        response = HttpResponse(status=204)
        response["HX-Redirect"] = url
        return response
    return HttpResponseRedirect(url)


GROUPS = {"tenant": "tenant__slug", "project": "project__slug", "model": "accelerator_model__short_name"}


def may_see_usage(user) -> bool:
    return bool(access.has_platform_perm(user, "view_all_usage") or access.tenant_ids(user, "view_tenant_usage")
                or access.project_ids(user, "view_project_usage"))


def _require_usage(user) -> None:
    # like every page out of reach: it does not exist for you (404), as the page matrix expects
    if not may_see_usage(user):
        raise Http404("no usage in your reach")


def _stacked_bars(series: dict[str, dict[str, float]], days: list[str], title: str, unit: str) -> dict:
    return {
        "data": [{"type": "bar", "name": name, "x": days, "y": [round(vals.get(d, 0), 4) for d in days]}
                 for name, vals in sorted(series.items())],
        "layout": {"barmode": "stack", "title": {"text": title}, "yaxis": {"title": {"text": unit}},
                   "margin": {"t": 40, "r": 10, "l": 50, "b": 40}, "height": 320},
    }


def _daily_charts(user, first: dt.date, days: int, by: str, scope: Q | None = None) -> dict:
    """Card-hours and cost per day from `first` for `days` days, stacked by `by` (GROUPS), from
    the daily rollups within the user's usage reach (and `scope`): plotly figures and totals."""
    rows = list(
        within_usage_reach(user, UsageRollup.objects.filter(
            scope or Q(), granularity=Granularity.DAY, period__gte=first, period__lt=first + dt.timedelta(days=days)))
        .values("period", GROUPS[by]).annotate(mcs=Sum("milli_card_seconds"), cost=Sum("cost")).order_by("period")
    )
    labels = [(first + dt.timedelta(days=i)).isoformat() for i in range(days)]
    hours: dict[str, dict[str, float]] = defaultdict(dict)
    cost: dict[str, dict[str, float]] = defaultdict(dict)
    totals = {"hours": Decimal(0), "cost": Decimal(0)}
    for r in rows:
        key, day = r[GROUPS[by]], r["period"].isoformat()
        hours[key][day] = r["mcs"] / services.MCS_PER_CARD_HOUR
        cost[key][day] = float(r["cost"])
        totals["hours"] += Decimal(r["mcs"]) / services.MCS_PER_CARD_HOUR
        totals["cost"] += r["cost"]
    return {
        "hours_chart": _stacked_bars(hours, labels, f"Card-hours per day by {by}", "card-hours") if rows else None,
        "cost_chart": _stacked_bars(cost, labels, f"Cost per day by {by}", settings.ATRIUM_CURRENCY) if rows else None,
        "total_hours": round(totals["hours"], 2), "total_cost": round(totals["cost"], 2),
    }


@login_required
def usage(request):
    """Card-hours and cost per day, stacked by tenant, project or accelerator model (rollups)."""
    _require_usage(request.user)
    try:
        days = max(1, min(366, int(request.GET.get("days", 30))))
    except ValueError:
        days = 30
    by = request.GET.get("by") if request.GET.get("by") in GROUPS else "project"
    today = timezone.now().date()
    first = today - dt.timedelta(days=days - 1)
    charts = _daily_charts(request.user, first, days, by)
    capacity = None
    if access.has_platform_perm(request.user, "view_all_usage"):
        capacity = list(
            # nosemgrep: atrium-queryset-outside-visible-to -- fleet capacity, no tenant owns it; platform view_all_usage only
            PoolCapacity.objects.filter(granularity=Granularity.DAY, period__gte=first)
            .values("pool__name", "accelerator_model__short_name")
            .annotate(healthy=Sum("healthy_milli_card_seconds"), used=Sum("used_milli_card_seconds"),
                      idle=Sum("idle_milli_card_seconds"), faulty=Sum("faulty_milli_card_seconds"),
                      idle_cost=Sum("idle_cost"), faulty_cost=Sum("faulty_cost"))
            .order_by("pool__name", "accelerator_model__short_name")
        )
        for c in capacity:
            for k in ("healthy", "used", "idle", "faulty"):
                c[k] = round(c[k] / services.MCS_PER_CARD_HOUR, 1)
    ctx = {"days": days, "by": by, "groups": list(GROUPS), "currency": settings.ATRIUM_CURRENCY, **charts,
           "capacity": capacity}
    return render_page(request, "metering/usage.html", ctx)


# --- reports -----------------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def report_list(request):
    _require_usage(request.user)
    scopes = services.report_scopes(request.user)
    form = ReportForm(request.POST or None, scopes=scopes)
    if request.method == "POST" and form.is_valid():
        d = form.cleaned_data
        report = services.request_report(
            request.user, period_start=d["period_start"], period_end=d["period_end"], grouping=d["grouping"],
            mode=d["mode"], **form.scope_objects(),
        )
        messages.success(request, f"Report {report.pk} is being built.")
        return redirect("metering:report_detail", pk=report.pk)
    reports = access.visible_to(request.user, Report).select_related("requested_by", "tenant", "project")
    table = ReportTable(reports)
    RequestConfig(request, paginate={"per_page": 25}).configure(table)
    return render_page(request, "metering/report_list.html", {"table": table, "form": form},
                       fragment="partials/table.html")


@login_required
def report_detail(request, pk: int):
    report = access.get_visible_or_404(
        request.user, Report.objects.select_related("requested_by", "tenant", "project"), pk=pk)
    ctx = {"report": report, "currency": settings.ATRIUM_CURRENCY}
    if not request.htmx:  # the progress poll re-renders the status only
        # the report's period and scope over time (card time from the daily rollups), stacked by
        # its grouping where that is a tenant, project or accelerator model, else by project
        by = {"tenant": "tenant", "project": "project", "accelerator_model": "model"}.get(report.grouping, "project")
        days = max(1, min(366, (report.period_end - report.period_start).days))
        ctx.update(by=by, **_daily_charts(request.user, report.period_start, days, by, report.scope_filter))
    response = render_page(request, "metering/report_detail.html", ctx,
                           fragment="metering/partials/report_status.html")
    if request.htmx and report.is_finished:
        response.status_code = 286  # htmx: stop polling, the report will not change any more
    return response


@login_required
def report_download(request, pk: int, fmt: str):
    report = access.get_visible_or_404(request.user, Report, pk=pk)
    field = {"csv": report.csv_file, "xlsx": report.xlsx_file, "focus": report.focus_file}.get(fmt)
    if not field:
        raise Http404("no such file")
    return FileResponse(field.open("rb"), as_attachment=True, filename=field.name.rsplit("/", 1)[-1])


# --- budgets -----------------------------------------------------------------------------


def _budget_scopes(user):
    """Tenants and projects whose budgets `user` may set (see services._budget_actor_may)."""
    if access.has_platform_perm(user, "manage_tenants"):
        return (access.visible_to(user, Tenant, "manage").order_by("slug"),
                access.visible_to(user, Project.objects.select_related("tenant"), "manage").order_by("tenant__slug", "slug"))
    tenant_ids = access.tenant_ids(user, "split_tenant_quota")
    return (Tenant.objects.none(),
            access.visible_to(user, Project.objects.filter(tenant_id__in=tenant_ids).select_related("tenant"))
            .order_by("tenant__slug", "slug"))


@login_required
def budget_list(request):
    _require_usage(request.user)
    budgets = access.visible_to(request.user, Budget).select_related("tenant", "project")
    now = timezone.now()
    spent = {b.pk: services.budget_spent(b, now) for b in budgets[:50]}
    table = BudgetTable(budgets)
    RequestConfig(request, paginate={"per_page": 50}).configure(table)
    tenants, projects = _budget_scopes(request.user)
    rows = [{"budget": b, "spent": spent.get(b.pk), "pct": round(spent[b.pk] * 100 / b.amount) if b.pk in spent else None}
            for b in budgets[:50]]
    return render_page(request, "metering/budget_list.html", {
        "table": table, "rows": rows, "may_edit": tenants.exists() or projects.exists(),
        "currency": settings.ATRIUM_CURRENCY,
    })


@login_required
@require_http_methods(["GET", "POST"])
def budget_edit(request, pk: int | None = None):
    _require_usage(request.user)
    tenants, projects = _budget_scopes(request.user)
    budget = access.get_visible_or_404(request.user, Budget, pk=pk) if pk else None
    if not tenants.exists() and not projects.exists():
        raise PermissionDenied("You may not set budgets.")
    initial = {}
    if budget:
        initial = {"scope": f"p{budget.project_id}" if budget.project_id else f"t{budget.tenant_id}", "unit": budget.unit,
                   "amount": budget.amount, "mode": budget.mode, "thresholds": ", ".join(map(str, budget.thresholds))}
    form = BudgetForm(request.POST or None, initial=initial, tenants=tenants, projects=projects)
    if request.method == "POST" and form.is_valid():
        d = form.cleaned_data
        if "delete" in request.POST and budget:
            services.delete_budget(request.user, budget)
            messages.success(request, "Budget removed.")
        else:
            services.set_budget(request.user, unit=d["unit"], amount=d["amount"], mode=d["mode"],
                                thresholds=d["thresholds"], **form.scope_objects())
            messages.success(request, "Budget saved.")
        return redirect("metering:budget_list")
    return render_page(request, "metering/budget_form.html", {"form": form, "budget": budget})


# --- prices ------------------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def price_list(request):
    _require_usage(request.user)
    may_edit = access.has_platform_perm(request.user, "manage_policy")
    form = PriceForm(request.POST or None) if may_edit else None
    if request.method == "POST":
        if not may_edit:
            raise PermissionDenied("Only platform admins change price lists.")
        if form.is_valid():
            d = form.cleaned_data
            try:
                services.set_price(request.user, accelerator_model=d["accelerator_model"],
                                   per_card_hour=d["per_card_hour"], effective_from=d["effective_from"])
            except SudoRequired:
                return _sudo_redirect(request, reverse("metering:price_list"))
            except PermissionDenied as exc:
                messages.error(request, str(exc))
            else:
                messages.success(request, "Price saved.")
                return redirect("metering:price_list")
    now = timezone.now()
    prices = list(Price.objects.select_related("accelerator_model").order_by("accelerator_model__name", "-effective_from"))
    current = {}
    for p in prices:
        if p.effective_from <= now and p.accelerator_model_id not in current:
            current[p.accelerator_model_id] = p.pk
    return render_page(request, "metering/price_list.html", {
        "prices": prices, "current": set(current.values()), "token_prices": TokenPrice.objects.all()[:200],
        "form": form, "currency": settings.ATRIUM_CURRENCY, "now": now,
    })

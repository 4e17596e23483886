"""Scheduler pages: submit, job list and detail, cancel; inventory with health actions.

Thin views: querysets come from tenants.access.visible_to (another tenant's job is a 404),
changes go through scheduling.services (which check permission again and audit).
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Count, Prefetch, Q
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST
from django_tables2 import RequestConfig

from portal.forms import add_service_errors
from portal.rendering import render_page
from portal.services import SudoRequired
from scheduling import services
from scheduling.cycle import QUEUED_STATES
from scheduling.filters import JobFilterSet, NodeFilterSet
from scheduling.forms import CancelForm, CardHealthForm, JobForm
from scheduling.models import ACTIVE_STATES, Accelerator, Binding, Job, Node
from scheduling.tables import JobTable, NodeTable
from tenants import access
from tenants.models import Project

# jobs whose row on the list can still change: queued, admitted or running
LIVE_STATES = (*QUEUED_STATES, *ACTIVE_STATES)


@login_required
def job_list(request):
    jobs = access.visible_to(request.user, Job).select_related("project__tenant", "spec", "priority_class")
    filterset = JobFilterSet(request.GET, queryset=jobs, request=request,
                             projects=access.visible_to(request.user, Project).select_related("tenant"))
    table = JobTable(filterset.qs)
    RequestConfig(request, paginate={"per_page": 25}).configure(table)
    # The open list refreshes itself only while a row on it can still change (the page's rows
    # are fetched once, here and for rendering alike); a list of finished jobs stops polling.
    live = any(row.record.state in LIVE_STATES for row in table.page.object_list)
    response = render_page(request, "scheduling/job_list.html", {"table": table, "filter": filterset, "live": live},
                           fragment="partials/table.html")
    if request.htmx and request.htmx.trigger == "job-list-poll" and not live:
        response.status_code = 286  # htmx: stop polling; a filter change is not the poller and swaps as usual
    return response


@login_required
def job_detail(request, pk: int):
    job = access.get_visible_or_404(
        request.user, Job.objects.select_related("project__tenant", "spec", "priority_class", "submitter"), pk=pk
    )
    bindings = job.bindings.select_related("accelerator__node", "accelerator__model")
    context = {
        "job": job,
        "events": job.events.all(),
        "bindings": bindings,
        "may_cancel": not job.is_final and (
            (job.submitter_id == request.user.pk and access.can(request.user, "submit_job", job.project))
            or access.can(request.user, "cancel_project_jobs", job.project)
        ),
        "cancel_form": CancelForm(),
    }
    response = render_page(request, "scheduling/job_detail.html", context, fragment="scheduling/partials/job_status.html")
    if request.htmx and job.is_final:
        response.status_code = 286  # htmx: stop polling, the job will not change any more
    return response


@login_required
@require_http_methods(["GET", "POST"])
def job_create(request):
    if not access.project_ids(request.user, "submit_job"):
        raise PermissionDenied("You are not a user of any project.")
    form = JobForm(request.POST or None, user=request.user)
    if request.method == "POST" and not request.htmx:
        if form.is_valid():
            data = form.cleaned_data
            try:
                job = services.submit_job(
                    request.user, project=data["project"], spec=data["spec"], priority_class=data["priority_class"],
                    name=data["name"], image=data["image"], command=data["command"], replicas=data["replicas"],
                    expected_minutes=data["expected_minutes"], time_limit_minutes=data["time_limit_minutes"],
                )
            except ValidationError as exc:
                add_service_errors(form, exc)
            except PermissionDenied as exc:
                # the service refused (and audited it); name the field when it was the class
                refused_class = data["priority_class"].pk not in form.allowed_priority_pks
                form.add_error("priority_class" if refused_class else None, str(exc))
            else:
                messages.success(request, f"Job {job.pk} submitted; it waits for the next scheduling cycle.")
                return redirect("scheduling:job_detail", pk=job.pk)
        return render(request, "scheduling/job_form.html", {"form": form, "preview": form.quota_preview()},
                      status=400)
    if request.htmx:
        # dependent fields: re-render the form for the chosen project (no errors shown yet)
        form = JobForm(initial=request.POST.dict() if request.method == "POST" else request.GET.dict(),
                       user=request.user)
        return render(request, "scheduling/partials/job_form_fields.html",
                      {"form": form, "preview": form.quota_preview()})
    return render(request, "scheduling/job_form.html", {"form": form, "preview": form.quota_preview()})


@login_required
@require_POST
def job_cancel(request, pk: int):
    job = access.get_visible_or_404(request.user, Job, pk=pk)
    form = CancelForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Tick the confirmation box to cancel the job.")
        return redirect("scheduling:job_detail", pk=job.pk)
    try:
        services.cancel_job(request.user, job, reason=form.cleaned_data["reason"])
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"Job {job.pk} cancelled.")
    return redirect("scheduling:job_detail", pk=job.pk)


@login_required
def node_list(request):
    nodes = access.visible_to(request.user, Node).select_related("pool").annotate(
        card_count=Count("accelerators"),
        unhealthy_count=Count("accelerators", filter=~Q(accelerators__health="healthy")),
    )
    if not access.has_platform_perm(request.user, "view_inventory") and not nodes.exists():
        raise Http404
    filterset = NodeFilterSet(request.GET, queryset=nodes)
    table = NodeTable(filterset.qs)
    RequestConfig(request, paginate={"per_page": 50}).configure(table)
    return render_page(request, "scheduling/node_list.html", {"table": table, "filter": filterset},
                       fragment="partials/table.html")


@login_required
def node_detail(request, pk: int):
    node = access.get_visible_or_404(request.user, Node.objects.select_related("pool"), pk=pk)
    cards = access.visible_to(request.user, Accelerator.objects.filter(node=node)).select_related("model").prefetch_related(
        Prefetch("bindings", queryset=Binding.objects.filter(end__isnull=True).select_related("project__tenant")
                 .order_by("start", "id"),
                 to_attr="current")
    )
    show_occupants = access.has_platform_perm(request.user, "view_inventory")
    operate = access.has_platform_perm(request.user, "operate_inventory")
    events = access.visible_to(request.user, "scheduling.HealthEvent").filter(
        accelerator__node=node).select_related("accelerator__node")[:50]
    return render(request, "scheduling/node_detail.html", {
        "node": node, "cards": cards, "show_occupants": show_occupants, "operate": operate,
        "events": events, "health_form": CardHealthForm(),
    })


@login_required
@require_POST
def card_health(request, pk: int):
    card = access.get_visible_or_404(request.user, Accelerator, pk=pk)
    if not access.has_platform_perm(request.user, "operate_inventory"):
        raise PermissionDenied("Only ops engineers change card health.")
    form = CardHealthForm(request.POST)
    if form.is_valid():
        try:
            services.set_card_health(request.user, card, form.cleaned_data["health"], reason=form.cleaned_data["reason"])
        except SudoRequired:
            raise
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
        else:
            messages.success(request, f"{card} is now {form.cleaned_data['health']}.")
    else:
        messages.error(request, "Say why the card's health changes.")
    return redirect("scheduling:node_detail", pk=card.node_id)

"""Tenant console (members, projects, quota split) and platform pages (tenants, tenant quotas,
platform roles, work orders and vendor grants).

Thin views: every tenant-owned object comes from tenants.access (another tenant's object is a
404, exactly like an id that does not exist); a visible object the user may not act on is a
403 through portal.services.deny (so the refusal is audited); changes go through the services,
which check permission again and write the audit event. State changes are POST only. A view
must never write a model itself or offer a choice outside the user's reach.
"""

from __future__ import annotations

from decimal import Decimal
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db.models import Count, Sum
from django.http import HttpResponse, HttpResponseRedirect
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST
from django_tables2 import RequestConfig

from portal.forms import add_service_errors
from portal.rendering import render_page
from portal.services import SudoRequired, deny
from scheduling import services as sched
from scheduling.models import Accelerator, Node, Quota
from tenants import access, services
from tenants.filters import (
    PlatformRoleFilterSet,
    ProjectMembershipFilterSet,
    TenantFilterSet,
    TenantMembershipFilterSet,
    VendorGrantFilterSet,
)
from tenants.forms import (
    MemberAddForm,
    PlatformRoleForm,
    ProjectForm,
    QuotaSplitForm,
    RevokeForm,
    RoleChangeForm,
    TenantForm,
    TenantQuotaForm,
    TenantStateForm,
    VendorGrantForm,
    WorkOrderForm,
    line_label,
)
from tenants.models import (
    PlatformRoleAssignment,
    Project,
    ProjectMembership,
    Tenant,
    TenantMembership,
    VendorGrant,
    WorkOrder,
)
from tenants.tables import (
    PlatformRoleTable,
    PlatformTenantTable,
    ProjectMembershipTable,
    ProjectQuotaTable,
    ProjectTable,
    QuotaLineTable,
    TenantConsoleTable,
    TenantMembershipTable,
    TenantQuotaTable,
    VendorGrantTable,
    WorkOrderTable,
)

# --- helpers ------------------------------------------------------------------------------


def _sudo_redirect(request, page: str):
    """Send the user to re-authenticate, then back to the page they acted on."""
    url = reverse("reauthenticate") + "?" + urlencode({"next": page})
    messages.info(request, "This change needs you to confirm your identity first.")
    if request.htmx:
        response = HttpResponse(status=204)
        response["HX-Redirect"] = url
        return response
    return HttpResponseRedirect(url)


def _require(request, allowed: bool, action: str, reason: str, **target) -> None:
    """Refuse (403, audited) unless `allowed`."""
    if not allowed:
        deny(request.user, action, reason, **target)


def _console_tenant(request, pk: int, perm: str, action: str) -> Tenant:
    """A tenant the user can see (else 404) and holds `perm` on (else 403)."""
    tenant = access.get_visible_or_404(request.user, Tenant, pk=pk)
    _require(
        request,
        access.has_platform_perm(request.user, "manage_tenants") or access.can(request.user, perm, tenant),
        action, f"needs {perm} on this tenant", target=tenant, tenant=tenant,
    )
    return tenant


def _platform(request, *perms: str, action: str) -> None:
    _require(request, any(access.has_platform_perm(request.user, p) for p in perms), action,
             f"needs one of the platform permissions {', '.join(perms)}")


def _amount(value) -> str:
    """A quota amount as people write it: 2, 0.5 (never 2.000 or 2E+1)."""
    return f"{Decimal(value).normalize():f}"


def _table(request, table, per_page: int = 50):
    RequestConfig(request, paginate={"per_page": per_page}).configure(table)
    return table


# --- tenant console ----------------------------------------------------------------------


@login_required
@require_GET
def tenant_list(request):
    """The tenants this user administers (a platform admin: all of them)."""
    tenants = access.visible_to(request.user, Tenant, "manage")
    if not tenants.exists() and not access.has_platform_perm(request.user, "manage_tenants"):
        deny(request.user, "tenant.console", "administers no tenant")
    tenants = tenants.annotate(project_count=Count("projects", distinct=True),
                               member_count=Count("memberships__user", distinct=True))
    filterset = TenantFilterSet(request.GET, queryset=tenants)
    table = _table(request, TenantConsoleTable(filterset.qs))
    return render_page(request, "tenants/tenant_list.html", {"table": table, "filter": filterset},
                       fragment="partials/table.html")


def _members_page(request, tenant: Tenant, *, add_form=None, status: int = 200):
    tenant_members = access.visible_to(request.user, TenantMembership).filter(tenant=tenant).select_related("user")
    project_members = access.visible_to(request.user, ProjectMembership).filter(tenant=tenant).select_related(
        "user", "project")
    filterset = TenantMembershipFilterSet(request.GET, queryset=tenant_members)
    project_filter = ProjectMembershipFilterSet(request.GET, queryset=project_members)
    projects = access.visible_to(request.user, Project).filter(tenant=tenant, archived__isnull=True)
    context = {
        "tenant": tenant,
        "filter": filterset,
        "table": _table(request, TenantMembershipTable(filterset.qs, prefix="t-")),
        "project_table": _table(request, ProjectMembershipTable(project_filter.qs, prefix="p-")),
        "add_form": add_form or MemberAddForm(projects=projects),
        "role_form": RoleChangeForm(),
    }
    return render_page(request, "tenants/member_list.html", context, fragment="tenants/partials/members.html",
                       status=status)


@login_required
@require_GET
def member_list(request, pk: int):
    tenant = _console_tenant(request, pk, "manage_tenant_members", "membership.view")
    return _members_page(request, tenant)


@login_required
@require_POST
def member_add(request, pk: int):
    tenant = _console_tenant(request, pk, "manage_tenant_members", "membership.grant")
    projects = access.visible_to(request.user, Project).filter(tenant=tenant, archived__isnull=True)
    form = MemberAddForm(request.POST, projects=projects)
    if form.is_valid():
        data = form.cleaned_data
        try:
            user = services.find_user(data["who"])
            if data["project"] is None:
                services.add_tenant_member(request.user, tenant, user, data["role"])
            else:
                services.add_project_member(request.user, data["project"], user, data["role"])
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            where = data["project"] or tenant
            messages.success(request, f"{user.get_username()} is now {data['role']} of {where}.")
            return redirect("tenants:member_list", pk=tenant.pk)
    return _members_page(request, tenant, add_form=form, status=400)


def _membership(request, model, pk: int):
    return access.get_visible_or_404(request.user, model.objects.select_related("user", "tenant"), pk=pk)


def _change_role(request, model, pk: int, change):
    membership = _membership(request, model, pk)
    form = RoleChangeForm(request.POST)
    if form.is_valid():
        try:
            change(request.user, membership, form.cleaned_data["role"])
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
        else:
            messages.success(request, f"{membership.user.get_username()} is now {form.cleaned_data['role']}.")
    else:
        messages.error(request, "Choose a role.")
    return redirect("tenants:member_list", pk=membership.tenant_id)


def _remove(request, model, pk: int, remove):
    membership = _membership(request, model, pk)
    tenant_id, name, role = membership.tenant_id, membership.user.get_username(), membership.role
    remove(request.user, membership)
    messages.success(request, f"{name} no longer holds {role}.")
    return redirect("tenants:member_list", pk=tenant_id)


@login_required
@require_POST
def membership_role(request, pk: int):
    return _change_role(request, TenantMembership, pk, services.change_tenant_member_role)


@login_required
@require_POST
def membership_remove(request, pk: int):
    return _remove(request, TenantMembership, pk, services.remove_tenant_member)


@login_required
@require_POST
def project_membership_role(request, pk: int):
    return _change_role(request, ProjectMembership, pk, services.change_project_member_role)


@login_required
@require_POST
def project_membership_remove(request, pk: int):
    return _remove(request, ProjectMembership, pk, services.remove_project_member)


def _projects_page(request, tenant: Tenant, *, form=None, status: int = 200):
    projects = access.visible_to(request.user, Project).filter(tenant=tenant)
    context = {"tenant": tenant, "table": _table(request, ProjectTable(projects)), "form": form or ProjectForm()}
    return render_page(request, "tenants/project_list.html", context, fragment="partials/table.html", status=status)


@login_required
@require_GET
def project_list(request, pk: int):
    tenant = _console_tenant(request, pk, "manage_tenant_projects", "project.view")
    return _projects_page(request, tenant)


@login_required
@require_POST
def project_create(request, pk: int):
    tenant = _console_tenant(request, pk, "manage_tenant_projects", "project.create")
    form = ProjectForm(request.POST)
    if form.is_valid():
        try:
            project = services.create_project(request.user, tenant, **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"Project {project} created.")
            return redirect("tenants:project_list", pk=tenant.pk)
    return _projects_page(request, tenant, form=form, status=400)


@login_required
@require_POST
def project_archive(request, pk: int):
    project = access.get_visible_or_404(request.user, Project.objects.select_related("tenant"), pk=pk)
    if project.archived is not None:
        messages.error(request, f"{project} is already archived.")
    else:
        services.archive_project(request.user, project)
        messages.success(request, f"{project} archived; its jobs keep their history.")
    return redirect("tenants:project_list", pk=project.tenant_id)


def _quota_page(request, tenant: Tenant, *, form=None, status: int = 200):
    quotas = access.visible_to(request.user, Quota).filter(tenant=tenant).select_related("accelerator_model", "project")
    lines = [q for q in quotas if q.project_id is None]
    split = {
        (row["resource"], row["accelerator_model"]): row["g"]
        for row in quotas.filter(project__isnull=False).values("resource", "accelerator_model").annotate(g=Sum("guaranteed"))
    }
    rows = []
    for q in lines:
        given = split.get((q.resource, q.accelerator_model_id)) or 0
        rows.append({"line": line_label(q), "guaranteed": _amount(q.guaranteed), "limit": _amount(q.limit),
                     "split": _amount(given), "left": _amount(q.guaranteed - given)})
    projects = access.visible_to(request.user, Project).filter(tenant=tenant, archived__isnull=True)
    context = {
        "tenant": tenant,
        "table": QuotaLineTable(rows),
        "project_table": _table(request, ProjectQuotaTable(quotas.filter(project__isnull=False))),
        "form": form or QuotaSplitForm(projects=projects, lines=lines),
    }
    return render_page(request, "tenants/quota_split.html", context, fragment="tenants/partials/quota_tables.html",
                       status=status)


@login_required
@require_GET
def quota_split(request, pk: int):
    tenant = _console_tenant(request, pk, "split_tenant_quota", "quota.view")
    return _quota_page(request, tenant)


@login_required
@require_POST
def quota_split_set(request, pk: int):
    tenant = _console_tenant(request, pk, "split_tenant_quota", "quota.change")
    quotas = access.visible_to(request.user, Quota).filter(tenant=tenant, project__isnull=True)
    lines = list(quotas.select_related("accelerator_model"))
    projects = access.visible_to(request.user, Project).filter(tenant=tenant, archived__isnull=True)
    form = QuotaSplitForm(request.POST, projects=projects, lines=lines)
    if form.is_valid():
        data = form.cleaned_data
        line = form.lines[data["line"]]
        try:
            sched.set_quota(request.user, tenant=tenant, project=data["project"], resource=line.resource,
                            accelerator_model=line.accelerator_model, guaranteed=data["guaranteed"],
                            limit=data["limit"])
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"{data['project']} now has {_amount(data['guaranteed'])}/{_amount(data['limit'])} "
                                      f"of {line_label(line)}.")
            return redirect("tenants:quota_split", pk=tenant.pk)
    return _quota_page(request, tenant, form=form, status=400)


# --- platform: tenants and tenant quotas ---------------------------------------------------


def _platform_tenants_page(request, *, form=None, status: int = 200):
    tenants = access.visible_to(request.user, Tenant, "manage").annotate(project_count=Count("projects"))
    filterset = TenantFilterSet(request.GET, queryset=tenants)
    context = {"table": _table(request, PlatformTenantTable(filterset.qs)), "filter": filterset,
               "form": form or TenantForm()}
    return render_page(request, "tenants/platform_tenants.html", context, fragment="partials/table.html",
                       status=status)


@login_required
@require_GET
def platform_tenant_list(request):
    _platform(request, "manage_tenants", action="tenant.view")
    return _platform_tenants_page(request)


@login_required
@require_POST
def platform_tenant_create(request):
    _platform(request, "manage_tenants", action="tenant.create")
    form = TenantForm(request.POST)
    if form.is_valid():
        try:
            tenant = services.create_tenant(request.user, **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"Tenant {tenant.slug} created.")
            return redirect("platform:tenant_list")
    return _platform_tenants_page(request, form=form, status=400)


@login_required
@require_POST
def platform_tenant_state(request, pk: int):
    tenant = access.get_visible_or_404(request.user, Tenant, pk=pk)
    _platform(request, "manage_tenants", action="tenant.state")
    form = TenantStateForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose a state.")
        return redirect("platform:tenant_list")
    services.set_tenant_state(request.user, tenant, form.cleaned_data["state"])
    messages.success(request, f"Tenant {tenant.slug} is now {tenant.state}.")
    return redirect("platform:tenant_list")


def _tenant_quota_page(request, *, form=None, status: int = 200):
    tenants = access.visible_to(request.user, Tenant, "manage")
    quotas = access.visible_to(request.user, Quota).filter(project__isnull=True).select_related("tenant",
                                                                                                "accelerator_model")
    context = {"table": _table(request, TenantQuotaTable(quotas)), "form": form or TenantQuotaForm(tenants=tenants)}
    return render_page(request, "tenants/platform_quotas.html", context, fragment="partials/table.html",
                       status=status)


@login_required
@require_GET
def platform_quota_list(request):
    _platform(request, "manage_tenants", action="quota.view")
    return _tenant_quota_page(request)


@login_required
@require_POST
def platform_quota_set(request):
    _platform(request, "manage_tenants", action="quota.change")
    form = TenantQuotaForm(request.POST, tenants=access.visible_to(request.user, Tenant, "manage"))
    if form.is_valid():
        data = form.cleaned_data
        try:
            sched.set_quota(request.user, tenant=data["tenant"], resource=data["resource"],
                            accelerator_model=data["accelerator_model"], guaranteed=data["guaranteed"],
                            limit=data["limit"])
        except SudoRequired:
            return _sudo_redirect(request, reverse("platform:quota_list"))
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"Quota of {data['tenant']} set to {_amount(data['guaranteed'])}/{_amount(data['limit'])}.")
            return redirect("platform:quota_list")
    return _tenant_quota_page(request, form=form, status=400)


# --- platform: roles -----------------------------------------------------------------------


def _roles_page(request, *, form=None, status: int = 200):
    qs = access.visible_to(request.user, PlatformRoleAssignment.objects.select_related("user"))
    filterset = PlatformRoleFilterSet(request.GET, queryset=qs)
    context = {"table": _table(request, PlatformRoleTable(filterset.qs)), "filter": filterset,
               "form": form or PlatformRoleForm()}
    return render_page(request, "tenants/platform_roles.html", context, fragment="partials/table.html", status=status)


@login_required
@require_GET
def platform_role_list(request):
    _platform(request, "manage_platform_roles", action="platform_role.view")
    return _roles_page(request)


@login_required
@require_POST
def platform_role_grant(request):
    _platform(request, "manage_platform_roles", action="platform_role.grant")
    form = PlatformRoleForm(request.POST)
    if form.is_valid():
        try:
            user = services.find_user(form.cleaned_data["who"])
            services.grant_platform_role(request.user, user, form.cleaned_data["role"])
        except SudoRequired:
            return _sudo_redirect(request, reverse("platform:role_list"))
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"{user.get_username()} is now {form.cleaned_data['role']}.")
            return redirect("platform:role_list")
    return _roles_page(request, form=form, status=400)


@login_required
@require_POST
def platform_role_revoke(request, pk: int):
    # platform role rows belong to no tenant: reach is the platform permission itself
    _platform(request, "manage_platform_roles", action="platform_role.revoke")
    assignment = access.get_visible_or_404(request.user, PlatformRoleAssignment.objects.select_related("user"), pk=pk)
    try:
        services.revoke_platform_role(request.user, assignment)
    except SudoRequired:
        return _sudo_redirect(request, reverse("platform:role_list"))
    messages.success(request, f"{assignment.user.get_username()} no longer holds {assignment.role}.")
    return redirect("platform:role_list")


# --- platform: work orders and vendor grants ---------------------------------------------

VENDOR_ADMIN_PERMS = ("operate_inventory", "approve_vendor_grants")


def _work_orders_page(request, *, form=None, status: int = 200):
    orders = access.visible_to(request.user, WorkOrder.objects.select_related("opened_by"))
    context = {
        "table": _table(request, WorkOrderTable(orders)),
        "may_open": access.has_platform_perm(request.user, "operate_inventory"),
        "form": form or WorkOrderForm(nodes=access.visible_to(request.user, Node),
                                      cards=access.visible_to(request.user, Accelerator).select_related("node")),
    }
    return render_page(request, "tenants/workorder_list.html", context, fragment="partials/table.html",
                       status=status)


@login_required
@require_GET
def workorder_list(request):
    _platform(request, *VENDOR_ADMIN_PERMS, action="workorder.view")
    return _work_orders_page(request)


@login_required
@require_POST
def workorder_create(request):
    _platform(request, "operate_inventory", action="workorder.open")
    form = WorkOrderForm(request.POST, nodes=access.visible_to(request.user, Node),
                         cards=access.visible_to(request.user, Accelerator))
    if form.is_valid():
        try:
            order = services.open_work_order(request.user, **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"{order} opened.")
            return redirect("platform:workorder_detail", pk=order.pk)
    return _work_orders_page(request, form=form, status=400)


def _work_order(request, pk: int) -> WorkOrder:
    # work orders belong to no tenant: reach is the platform permission, checked first
    _platform(request, *VENDOR_ADMIN_PERMS, action="workorder.view")
    return access.get_visible_or_404(request.user, WorkOrder.objects.select_related("opened_by"), pk=pk)


def _work_order_page(request, order: WorkOrder, *, form=None, status: int = 200):
    grants = order.grants.select_related("vendor", "requested_by", "approved_by", "work_order")
    context = {
        "order": order,
        "nodes": order.nodes.all(),
        "cards": order.accelerators.select_related("node"),
        "table": _table(request, VendorGrantTable(grants)),
        "may_request": access.has_platform_perm(request.user, "operate_inventory") and order.closed is None,
        "form": form or VendorGrantForm(),
    }
    return render_page(request, "tenants/workorder_detail.html", context, fragment="partials/table.html",
                       status=status)


@login_required
@require_GET
def workorder_detail(request, pk: int):
    return _work_order_page(request, _work_order(request, pk))


@login_required
@require_POST
def grant_request(request, pk: int):
    order = _work_order(request, pk)
    _platform(request, "operate_inventory", action="vendor.grant.request")
    form = VendorGrantForm(request.POST)
    if form.is_valid():
        data = form.cleaned_data
        try:
            vendor = services.find_user(data["vendor"])
            services.request_vendor_grant(request.user, work_order=order, vendor=vendor, starts=data["starts"],
                                          expires=data["expires"])
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"Access for {vendor.get_username()} requested; a security admin approves it.")
            return redirect("platform:workorder_detail", pk=order.pk)
    return _work_order_page(request, order, form=form, status=400)


@login_required
@require_GET
def grant_list(request):
    _platform(request, *VENDOR_ADMIN_PERMS, action="vendor.grant.view")
    grants = access.visible_to(request.user, VendorGrant.objects.select_related("vendor", "requested_by", "approved_by",
                                                                      "work_order"))
    filterset = VendorGrantFilterSet(request.GET, queryset=grants)
    context = {"table": _table(request, VendorGrantTable(filterset.qs)), "filter": filterset}
    return render_page(request, "tenants/grant_list.html", context, fragment="partials/table.html")


def _grant(request, pk: int, action: str) -> VendorGrant:
    _platform(request, *VENDOR_ADMIN_PERMS, action=action)
    return access.get_visible_or_404(request.user, VendorGrant.objects.select_related("vendor", "work_order"), pk=pk)


@login_required
@require_POST
def grant_approve(request, pk: int):
    grant = _grant(request, pk, "vendor.grant.approve")
    try:
        services.approve_vendor_grant(request.user, grant)
    except SudoRequired:
        return _sudo_redirect(request, reverse("platform:grant_list"))
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"Access of {grant.vendor.get_username()} approved until {grant.expires:%Y-%m-%d %H:%M}.")
    return redirect("platform:grant_list")


@login_required
@require_POST
def grant_revoke(request, pk: int):
    grant = _grant(request, pk, "vendor.grant.revoke")
    form = RevokeForm(request.POST)
    reason = form.cleaned_data["reason"] if form.is_valid() else ""
    try:
        services.revoke_vendor_grant(request.user, grant, reason=reason)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"Access of {grant.vendor.get_username()} revoked; their sessions end now.")
    return redirect("platform:grant_list")


"""django-tables2 tables of the tenant console and the platform pages.

Action columns only render forms that post to the services' views; whether the action is
allowed is decided there, never by hiding a button.
"""

from __future__ import annotations

import django_tables2 as tables

from scheduling.models import Quota
from tenants.models import PlatformRoleAssignment, Project, ProjectMembership, Tenant, TenantMembership, VendorGrant, WorkOrder


class TenantConsoleTable(tables.Table):
    slug = tables.Column(linkify=("tenants:member_list", {"pk": tables.A("pk")}), verbose_name="Tenant")
    project_count = tables.Column(verbose_name="Projects", orderable=False)
    member_count = tables.Column(verbose_name="Members", orderable=False)

    class Meta:
        model = Tenant
        fields = ("slug", "name", "state", "project_count", "member_count")
        attrs = {"class": "table"}


class PlatformTenantTable(tables.Table):
    slug = tables.Column(linkify=("tenants:member_list", {"pk": tables.A("pk")}), verbose_name="Tenant")
    project_count = tables.Column(verbose_name="Projects", orderable=False)
    actions = tables.TemplateColumn(template_name="tenants/partials/tenant_state_action.html", orderable=False,
                                    verbose_name="")

    class Meta:
        model = Tenant
        fields = ("slug", "name", "state", "created", "project_count", "actions")
        attrs = {"class": "table"}


class TenantMembershipTable(tables.Table):
    user = tables.Column(accessor="user__username", verbose_name="Member")
    email = tables.Column(accessor="user__email", verbose_name="E-mail")
    actions = tables.TemplateColumn(template_name="tenants/partials/membership_actions.html", orderable=False,
                                    verbose_name="", extra_context={"kind": "tenant"})

    class Meta:
        model = TenantMembership
        fields = ("user", "email", "role", "source", "created", "actions")
        attrs = {"class": "table"}
        order_by = ("user",)


class ProjectMembershipTable(tables.Table):
    user = tables.Column(accessor="user__username", verbose_name="Member")
    project = tables.Column(accessor="project__slug", verbose_name="Project")
    actions = tables.TemplateColumn(template_name="tenants/partials/membership_actions.html", orderable=False,
                                    verbose_name="", extra_context={"kind": "project"})

    class Meta:
        model = ProjectMembership
        fields = ("user", "project", "role", "source", "created", "actions")
        attrs = {"class": "table"}
        order_by = ("project", "user")


class ProjectTable(tables.Table):
    actions = tables.TemplateColumn(template_name="tenants/partials/project_actions.html", orderable=False,
                                    verbose_name="")

    class Meta:
        model = Project
        fields = ("slug", "name", "project_class", "cost_centre", "created", "archived", "actions")
        attrs = {"class": "table"}


class QuotaLineTable(tables.Table):
    """A tenant quota line with how much of it the projects already hold (rows are dicts)."""

    line = tables.Column(verbose_name="Quota line")
    guaranteed = tables.Column(verbose_name="Tenant guaranteed")
    limit = tables.Column(verbose_name="Tenant limit")
    split = tables.Column(verbose_name="Split to projects (guaranteed)")
    left = tables.Column(verbose_name="Left to split")

    class Meta:
        attrs = {"class": "table"}
        orderable = False


class ProjectQuotaTable(tables.Table):
    project = tables.Column(accessor="project__slug", verbose_name="Project")
    accelerator_model = tables.Column(accessor="accelerator_model__short_name", verbose_name="Model", default="")

    class Meta:
        model = Quota
        fields = ("project", "resource", "accelerator_model", "guaranteed", "limit")
        attrs = {"class": "table"}


class TenantQuotaTable(tables.Table):
    tenant = tables.Column(accessor="tenant__slug", verbose_name="Tenant")
    accelerator_model = tables.Column(accessor="accelerator_model__short_name", verbose_name="Model", default="")

    class Meta:
        model = Quota
        fields = ("tenant", "resource", "accelerator_model", "guaranteed", "limit")
        attrs = {"class": "table"}


class PlatformRoleTable(tables.Table):
    user = tables.Column(accessor="user__username", verbose_name="User")
    actions = tables.TemplateColumn(template_name="tenants/partials/role_actions.html", orderable=False,
                                    verbose_name="")

    class Meta:
        model = PlatformRoleAssignment
        fields = ("user", "role", "source", "created", "actions")
        attrs = {"class": "table"}
        order_by = ("role", "user")


class WorkOrderTable(tables.Table):
    id = tables.Column(linkify=("platform:workorder_detail", {"pk": tables.A("pk")}), verbose_name="WO")
    title = tables.Column(linkify=("platform:workorder_detail", {"pk": tables.A("pk")}))
    opened_by = tables.Column(accessor="opened_by__username")

    class Meta:
        model = WorkOrder
        fields = ("id", "title", "opened_by", "opened", "closed")
        attrs = {"class": "table"}


class VendorGrantTable(tables.Table):
    vendor = tables.Column(accessor="vendor__username")
    work_order = tables.Column(linkify=("platform:workorder_detail", {"pk": tables.A("work_order_id")}))
    requested_by = tables.Column(accessor="requested_by__username")
    approved_by = tables.Column(accessor="approved_by__username", default="not yet")
    status = tables.Column(empty_values=(), orderable=False)
    actions = tables.TemplateColumn(template_name="tenants/partials/grant_actions.html", orderable=False,
                                    verbose_name="")

    class Meta:
        model = VendorGrant
        fields = ("vendor", "work_order", "requested_by", "approved_by", "starts", "expires", "revoked", "status",
                  "actions")
        attrs = {"class": "table"}

    def render_status(self, record):
        if record.revoked:
            return "revoked"
        if record.approved_by_id is None:
            return "awaiting approval"
        return "valid" if record.is_valid() else "not valid now"

"""Audit log pages: a filtered, paged list and a CSV export of the same rows.

The rows come from visible_to(): security admins and auditors see everything, a tenant admin
only its tenant's events. The export holds exactly what the filtered list holds.
"""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django_tables2 import RequestConfig
from django_tables2.export import TableExport

from portal.filters import AuditEventFilterSet
from portal.models import AuditEvent
from portal.rendering import render_page
from portal.tables import AuditEventTable
from tenants import access


@login_required
def audit_list(request):
    if not (access.has_platform_perm(request.user, "view_all_audit") or access.tenant_ids(request.user, "view_tenant_audit")):
        raise Http404
    qs = access.visible_to(request.user, AuditEvent).select_related("tenant")
    filterset = AuditEventFilterSet(request.GET, queryset=qs)
    table = AuditEventTable(filterset.qs)
    RequestConfig(request, paginate={"per_page": 50}).configure(table)
    export = request.GET.get("_export")
    if TableExport.is_valid_format(export):
        from portal import audit

        audit.record("audit.export", actor=request.user, target_type="portal.auditevent",
                     target_label=f"{filterset.qs.count()} events as {export}")
        return TableExport(export, table, exclude_columns=()).response(f"audit.{export}")
    return render_page(request, "portal/audit_list.html", {"table": table, "filter": filterset},
                       fragment="partials/table.html")

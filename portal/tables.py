"""django-tables2 tables of the portal's own models (the audit log)."""

import django_tables2 as tables

from portal.models import AuditEvent


class AuditEventTable(tables.Table):
    time = tables.DateTimeColumn(format="Y-m-d H:i:s")
    tenant = tables.Column(accessor="tenant__slug", verbose_name="Tenant")

    class Meta:
        model = AuditEvent
        fields = ("time", "actor_label", "action", "tenant", "target_label", "outcome", "reason", "source_ip",
                  "request_id")
        attrs = {"class": "table"}
        order_by = ("-time",)

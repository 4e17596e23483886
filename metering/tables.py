"""Tables of the metering pages (django-tables2): reports and budgets."""

import django_tables2 as tables

from metering.models import Budget, Report


class ReportTable(tables.Table):
    id = tables.Column(linkify=("metering:report_detail", {"pk": tables.A("pk")}), verbose_name="Report")
    scope = tables.Column(accessor="scope_label", orderable=False)
    requested_by = tables.Column(accessor="requested_by__username", verbose_name="Requested by")
    period_start = tables.DateColumn(format="Y-m-d", verbose_name="From")
    period_end = tables.DateColumn(format="Y-m-d", verbose_name="To (exclusive)")
    total_cost = tables.Column(verbose_name="Total")
    created = tables.DateTimeColumn(format="Y-m-d H:i")

    class Meta:
        model = Report
        fields = ("id", "scope", "period_start", "period_end", "grouping", "mode", "status", "total_cost",
                  "requested_by", "created")
        attrs = {"class": "table"}
        order_by = ("-created",)


class BudgetTable(tables.Table):
    scope = tables.Column(accessor="scope_label", orderable=False)
    edit = tables.TemplateColumn(
        '<a href="{% url \'metering:budget_edit\' record.pk %}">edit</a>', orderable=False, verbose_name="",
    )

    class Meta:
        model = Budget
        fields = ("scope", "unit", "amount", "mode", "thresholds", "updated")
        attrs = {"class": "table"}

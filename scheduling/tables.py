"""Tables of the scheduler's pages (django-tables2): jobs and nodes."""

import django_tables2 as tables

from scheduling.models import Job, Node


class JobTable(tables.Table):
    id = tables.Column(linkify=("scheduling:job_detail", {"pk": tables.A("pk")}), verbose_name="Job")
    name = tables.Column(linkify=("scheduling:job_detail", {"pk": tables.A("pk")}))
    project = tables.Column(accessor="project", order_by=("project__tenant__slug", "project__slug"))
    spec = tables.Column(accessor="spec__name", verbose_name="Spec")
    priority_class = tables.Column(accessor="priority_class__name", verbose_name="Priority")
    submitted = tables.DateTimeColumn(format="Y-m-d H:i")
    wait_message = tables.Column(verbose_name="Why it waits", orderable=False)

    class Meta:
        model = Job
        fields = ("id", "name", "project", "spec", "priority_class", "state", "queue_position", "wait_message",
                  "submitted")
        attrs = {"class": "table"}
        order_by = ("-submitted",)
        # the body cells written out for speed; same cells as the generic template (tested)
        template_name = "scheduling/partials/job_table.html"


class NodeTable(tables.Table):
    name = tables.Column(linkify=("scheduling:node_detail", {"pk": tables.A("pk")}))
    pool = tables.Column(accessor="pool__name")
    cards = tables.Column(accessor="card_count", verbose_name="Cards", orderable=False)
    unhealthy = tables.Column(accessor="unhealthy_count", verbose_name="Unhealthy", orderable=False)

    class Meta:
        model = Node
        fields = ("name", "pool", "state", "cards", "unhealthy", "cpu_milli", "memory_mib")
        attrs = {"class": "table"}

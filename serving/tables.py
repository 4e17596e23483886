"""Tables of the serving pages (django-tables2): services, applications, knowledge bases, keys."""

import django_tables2 as tables

from serving.models import ApiKey, Application, KnowledgeBase, ModelService


class ModelServiceTable(tables.Table):
    slug = tables.Column(linkify=("serving:service_detail", {"pk": tables.A("pk")}), verbose_name="Model")
    project = tables.Column(accessor="project", order_by=("project__tenant__slug", "project__slug"))

    class Meta:
        model = ModelService
        fields = ("slug", "name", "project", "base_model", "status", "visibility", "replicas", "published")
        attrs = {"class": "table"}


class ApplicationTable(tables.Table):
    project = tables.Column(accessor="project", order_by=("project__tenant__slug", "project__slug"))
    service = tables.Column(accessor="service__slug", verbose_name="Model")

    class Meta:
        model = Application
        fields = ("slug", "name", "project", "service", "top_k", "created")
        attrs = {"class": "table"}


class KnowledgeBaseTable(tables.Table):
    slug = tables.Column(linkify=("serving:kb_detail", {"pk": tables.A("pk")}))
    tenant = tables.Column(accessor="tenant__slug")

    class Meta:
        model = KnowledgeBase
        fields = ("slug", "name", "tenant", "all_projects", "created")
        attrs = {"class": "table"}


class ApiKeyTable(tables.Table):
    prefix = tables.Column(linkify=("serving:key_detail", {"pk": tables.A("pk")}), verbose_name="Key")
    project = tables.Column(accessor="project", order_by=("project__tenant__slug", "project__slug"))
    state = tables.Column(orderable=False)
    created_by = tables.Column(accessor="created_by__username", verbose_name="Created by")

    class Meta:
        model = ApiKey
        fields = ("prefix", "name", "project", "state", "created_by", "created", "expires", "last_used")
        attrs = {"class": "table"}

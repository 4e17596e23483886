"""Filter sets of the scheduler's pages (django-filter)."""

import django_filters

from scheduling.models import Job, JobState, Node, NodeState
from tenants.models import Project


class JobFilterSet(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name")
    state = django_filters.ChoiceFilter(choices=JobState.choices)
    mine = django_filters.BooleanFilter(method="filter_mine", label="Only my jobs")

    class Meta:
        model = Job
        fields = ["q", "state", "project", "mine"]

    def __init__(self, *args, projects=None, **kwargs):
        super().__init__(*args, **kwargs)
        # never the default Project.objects.all(): the choices would name other tenants' projects
        self.filters["project"].queryset = projects if projects is not None else Project.objects.none()

    def filter_mine(self, queryset, name, value):
        return queryset.filter(submitter=self.request.user) if value else queryset


class NodeFilterSet(django_filters.FilterSet):
    name = django_filters.CharFilter(lookup_expr="icontains")
    state = django_filters.ChoiceFilter(choices=NodeState.choices)

    class Meta:
        model = Node
        fields = ["name", "pool", "state"]

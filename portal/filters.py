"""django-filter filter sets of the portal's own models (the audit log)."""

import django_filters

from portal.models import AuditEvent, AuditOutcome


class AuditEventFilterSet(django_filters.FilterSet):
    actor = django_filters.CharFilter(field_name="actor_label", lookup_expr="icontains", label="Actor")
    action = django_filters.CharFilter(lookup_expr="istartswith", label="Action")
    target = django_filters.CharFilter(field_name="target_label", lookup_expr="icontains", label="Target")
    outcome = django_filters.ChoiceFilter(choices=AuditOutcome.choices)
    since = django_filters.DateFilter(field_name="time", lookup_expr="date__gte", label="From")
    until = django_filters.DateFilter(field_name="time", lookup_expr="date__lte", label="To")

    class Meta:
        model = AuditEvent
        fields = ["actor", "action", "target", "outcome", "since", "until"]

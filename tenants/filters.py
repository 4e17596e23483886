"""django-filter filter sets of the tenant console and the platform pages.

Choices that name tenant-owned rows are always narrowed by the view to what the user may
see; a filter's default queryset would list every tenant's projects.
"""

import django_filters

from tenants.models import PlatformRoleAssignment, ProjectMembership, Tenant, TenantMembership, TenantState, VendorGrant
from tenants.roles import PLATFORM_ROLES


class TenantFilterSet(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="slug", lookup_expr="icontains", label="Slug")
    state = django_filters.ChoiceFilter(choices=TenantState.choices)

    class Meta:
        model = Tenant
        fields = ["q", "state"]


class TenantMembershipFilterSet(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="user__username", lookup_expr="icontains", label="Member")

    class Meta:
        model = TenantMembership
        fields = ["q"]


class ProjectMembershipFilterSet(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="user__username", lookup_expr="icontains", label="Member")

    class Meta:
        model = ProjectMembership
        fields = ["q"]


class PlatformRoleFilterSet(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="user__username", lookup_expr="icontains", label="User")
    role = django_filters.ChoiceFilter(choices=[(r, r) for r in PLATFORM_ROLES])

    class Meta:
        model = PlatformRoleAssignment
        fields = ["q", "role"]


class VendorGrantFilterSet(django_filters.FilterSet):
    vendor = django_filters.CharFilter(field_name="vendor__username", lookup_expr="icontains")
    pending = django_filters.BooleanFilter(field_name="approved_by", lookup_expr="isnull", label="Awaiting approval")

    class Meta:
        model = VendorGrant
        fields = ["vendor", "pending"]

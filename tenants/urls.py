"""URLs of the tenant console (mounted at tenants/, namespace "tenants") and of the platform
pages (mounted at platform/, namespace "platform"). Every state change is a POST URL of its own."""

from django.urls import path

from tenants import views

app_name = "tenants"

urlpatterns = [
    path("", views.tenant_list, name="tenant_list"),
    path("<int:pk>/members/", views.member_list, name="member_list"),
    path("<int:pk>/members/add/", views.member_add, name="member_add"),
    path("memberships/<int:pk>/role/", views.membership_role, name="membership_role"),
    path("memberships/<int:pk>/remove/", views.membership_remove, name="membership_remove"),
    path("project-memberships/<int:pk>/role/", views.project_membership_role, name="project_membership_role"),
    path("project-memberships/<int:pk>/remove/", views.project_membership_remove, name="project_membership_remove"),
    path("<int:pk>/projects/", views.project_list, name="project_list"),
    path("<int:pk>/projects/new/", views.project_create, name="project_create"),
    path("projects/<int:pk>/archive/", views.project_archive, name="project_archive"),
    path("<int:pk>/quotas/", views.quota_split, name="quota_split"),
    path("<int:pk>/quotas/set/", views.quota_split_set, name="quota_split_set"),
]

platform_urlpatterns = [
    path("tenants/", views.platform_tenant_list, name="tenant_list"),
    path("tenants/new/", views.platform_tenant_create, name="tenant_create"),
    path("tenants/<int:pk>/state/", views.platform_tenant_state, name="tenant_state"),
    path("quotas/", views.platform_quota_list, name="quota_list"),
    path("quotas/set/", views.platform_quota_set, name="quota_set"),
    path("roles/", views.platform_role_list, name="role_list"),
    path("roles/grant/", views.platform_role_grant, name="role_grant"),
    path("roles/<int:pk>/revoke/", views.platform_role_revoke, name="role_revoke"),
    path("work-orders/", views.workorder_list, name="workorder_list"),
    path("work-orders/new/", views.workorder_create, name="workorder_create"),
    path("work-orders/<int:pk>/", views.workorder_detail, name="workorder_detail"),
    path("work-orders/<int:pk>/grants/new/", views.grant_request, name="grant_request"),
    path("vendor-grants/", views.grant_list, name="grant_list"),
    path("vendor-grants/<int:pk>/approve/", views.grant_approve, name="grant_approve"),
    path("vendor-grants/<int:pk>/revoke/", views.grant_revoke, name="grant_revoke"),
]

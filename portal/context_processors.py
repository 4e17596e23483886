"""Template context every page gets: version, the navigation for the user's roles, the
tenant/project switcher and whether SSO is on. Reads permissions through tenants.access only."""

from __future__ import annotations

from django.conf import settings
from django.urls import reverse

import portal


def _nav(user) -> list[dict]:
    from tenants import access

    if not user.is_authenticated:
        return []
    access.prime(user)  # every permission question below from two queries, not one each
    perms = access.platform_perms(user)
    items = [{"label": "Dashboard", "url": reverse("home")}]
    if "view_all_tenants" in perms or access.project_ids(user, "view_project_jobs"):
        items.append({"label": "Jobs", "url": reverse("scheduling:job_list")})
    if access.project_ids(user, "submit_job"):
        items.append({"label": "Submit", "url": reverse("scheduling:job_create")})
    if "view_all_tenants" in perms or access.project_ids(user, "use_model_services"):
        items.append({"label": "Model services", "url": reverse("serving:service_list")})
        items.append({"label": "Knowledge bases", "url": reverse("serving:kb_list")})
    if access.project_ids(user, "manage_api_keys"):
        items.append({"label": "API keys", "url": reverse("serving:key_list")})
    nodes, cards, _ = access.vendor_scope(user)
    if "view_inventory" in perms or nodes or cards:
        items.append({"label": "Inventory", "url": reverse("scheduling:node_list")})
    if ("view_all_usage" in perms or access.tenant_ids(user, "view_tenant_usage")
            or access.project_ids(user, "view_project_usage")):
        items.append({"label": "Usage", "url": reverse("metering:usage")})
        items.append({"label": "Reports", "url": reverse("metering:report_list")})
    if "view_all_audit" in perms or access.tenant_ids(user, "view_tenant_audit"):
        items.append({"label": "Audit", "url": reverse("portal:audit_list")})
    if "manage_tenants" in perms or access.tenant_ids(user, "manage_tenant_members"):
        items.append({"label": "Tenant console", "url": reverse("tenants:tenant_list")})
    if "manage_tenants" in perms:
        items.append({"label": "Tenants", "url": reverse("platform:tenant_list")})
        items.append({"label": "Tenant quotas", "url": reverse("platform:quota_list")})
    if "manage_platform_roles" in perms:
        items.append({"label": "Platform roles", "url": reverse("platform:role_list")})
    if "operate_inventory" in perms or "approve_vendor_grants" in perms:
        items.append({"label": "Work orders", "url": reverse("platform:workorder_list")})
        items.append({"label": "Vendor grants", "url": reverse("platform:grant_list")})
    return items


def atrium(request) -> dict:
    user = getattr(request, "user", None)
    return {
        "atrium_version": portal.__version__,
        "nav_items": _nav(user) if user is not None else [],
        "oidc_enabled": settings.OIDC_ENABLED,
    }

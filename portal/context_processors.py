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
    perms = access.platform_perms(user)
    items = [{"label": "Dashboard", "url": reverse("home")}]
    if "view_all_tenants" in perms or access.project_ids(user, "view_project_jobs"):
        items.append({"label": "Jobs", "url": reverse("scheduling:job_list")})
    if access.project_ids(user, "submit_job"):
        items.append({"label": "Submit", "url": reverse("scheduling:job_create")})
    nodes, cards, _ = access.vendor_scope(user)
    if "view_inventory" in perms or nodes or cards:
        items.append({"label": "Inventory", "url": reverse("scheduling:node_list")})
    if "view_all_audit" in perms or access.tenant_ids(user, "view_tenant_audit"):
        items.append({"label": "Audit", "url": reverse("portal:audit_list")})
    return items


def atrium(request) -> dict:
    user = getattr(request, "user", None)
    return {
        "atrium_version": portal.__version__,
        "nav_items": _nav(user) if user is not None else [],
        "oidc_enabled": settings.OIDC_ENABLED,
    }

"""The dashboard page and its live fragments, at one URL.

`/` renders the whole dashboard for the scope named in `?scope=` (default: the user's first
project, else tenant, else the platform view). An htmx request that names a `panel`
(`?scope=...&panel=queue`) gets only that panel's fragment, rendered without the site-wide
context processors so a poll costs only the panel's own queries; the same URL without htmx
is the full page, so every fragment link works without JavaScript. Thin: the numbers come
from portal.dashboard, which reads through tenants.access only; nothing here changes a row.
"""

from __future__ import annotations

from django.http import HttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode

from portal import dashboard
from tenants import access

POLL_SECONDS = {"alarms": 10, "quota": 10, "queue": 10, "usage": 60}


def _panel_urls(scope) -> dict[str, str]:
    return {p: reverse("home") + "?" + urlencode({"scope": scope.value, "panel": p}) for p in dashboard.PANELS}


def dashboard_page(request):
    user = request.user
    # the page asks ~14 project/tenant permission questions (panels + navigation): answer them
    # all from two queries instead of one guardian query each
    access.prime(user)
    raw = request.GET.get("scope")
    panel = request.GET.get("panel")
    if request.htmx and panel in dashboard.PANELS and raw:
        scope = dashboard.resolve_scope(user, raw)
        ctx = dashboard.panel_context(user, scope, panel)
        ctx.update(panel_urls=_panel_urls(scope), poll=POLL_SECONDS, fragment=True)
        return HttpResponse(render_to_string(f"partials/dashboard_{panel}.html", ctx))
    choices = dashboard.scope_choices(user)
    scope = dashboard.resolve_scope(user, raw) if raw else dashboard.default_scope(user, choices)
    ctx = dashboard.home_context(user)
    ctx.update(choices=choices, scope=scope, now=timezone.now(), poll=POLL_SECONDS)
    if scope is not None:
        ctx.update(dashboard.scoped_context(user, scope, ctx["now"]))
        ctx["panel_urls"] = _panel_urls(scope)
    return render(request, "portal/home.html", ctx)

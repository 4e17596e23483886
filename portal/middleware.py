"""Request-wide middleware: request id and source address for audit, and session validity.

The source address is taken from X-Forwarded-For only when the direct peer is one of the
configured trusted proxies; a client can never choose the address the audit log records.
"""

from __future__ import annotations

import time
from dataclasses import replace

from django.conf import settings
from django.contrib.auth import logout
from django.http import HttpResponse
from django.shortcuts import redirect, resolve_url

from portal import context

SUDO_SESSION_KEY = "atrium_reauth_at"


def client_address(request) -> str:
    peer = request.META.get("REMOTE_ADDR", "")
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if forwarded and peer in settings.ATRIUM_TRUSTED_PROXIES:
        return forwarded.split(",")[-1].strip()
    return peer


class RequestContextMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        incoming = request.META.get("HTTP_X_REQUEST_ID", "")
        rid = incoming if incoming.isalnum() and len(incoming) <= 64 else context.new_request_id()
        request.request_id = rid
        token = context.set_context(
            context.RequestContext(
                request_id=rid,
                source_ip=client_address(request),
                user_agent=request.META.get("HTTP_USER_AGENT", "")[:400],
            )
        )
        try:
            response = self.get_response(request)
        finally:
            context.reset_context(token)
        response["X-Request-ID"] = rid
        return response


class SessionValidityMiddleware:
    """Ends a session whose reason to exist has gone (a vendor grant expired or revoked).

    Checked on every request so expiry and revocation take effect at the next request.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            from tenants.access import session_still_valid

            if not session_still_valid(user):
                from portal import audit

                audit.record("vendor.session_end", actor=user, reason="no valid vendor grant")
                logout(request)
                return login_redirect(request)
            reauth_at = request.session.get(SUDO_SESSION_KEY, 0)
            if time.time() - reauth_at < settings.ATRIUM_SUDO_SECONDS:
                context.set_context(replace(context.current(), sudo=True))
        return self.get_response(request)


def login_redirect(request):
    """Send the browser to sign-in; htmx requests get HX-Redirect (htmx cannot follow a 302)."""
    url = resolve_url(settings.LOGIN_URL)
    if request.headers.get("HX-Request"):
        resp = HttpResponse(status=204)
        resp["HX-Redirect"] = url
        return resp
    return redirect(url)


class HealthProbeMiddleware:
    """Answers /healthz and /readyz before the Host check and HTTPS redirect.

    Container and Kubernetes probes address the pod by IP or 127.0.0.1, which production
    ALLOWED_HOSTS rightly does not list; the probes reveal nothing but up/ready.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path in ("/healthz", "/readyz") and request.method in ("GET", "HEAD"):
            from portal import views

            return views.healthz(request) if request.path == "/healthz" else views.readyz(request)
        return self.get_response(request)

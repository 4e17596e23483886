"""Request-wide middleware: request id and source address for audit, session validity, and
the short path of the key-authenticated gateway.

The source address is taken from X-Forwarded-For only when the direct peer is one of the
configured trusted proxies; a client can never choose the address the audit log records.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import lru_cache

from django.conf import settings
from django.contrib.auth import logout
from django.http import HttpResponse
from django.shortcuts import redirect, resolve_url
from django.urls import Resolver404, get_urlconf, resolve

from portal import context

SUDO_SESSION_KEY = "atrium_reauth_at"


def client_address(request) -> str:
    peer = request.META.get("REMOTE_ADDR", "")
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if forwarded and peer in settings.ATRIUM_TRUSTED_PROXIES:
        return forwarded.split(",")[-1].strip()
    return peer


def request_id_from(incoming: str) -> str:
    """The caller's X-Request-ID when it is a plain token of at most 64 characters, else a new one."""
    return incoming if incoming.isalnum() and len(incoming) <= 64 else context.new_request_id()


class RequestContextMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        rid = request_id_from(request.META.get("HTTP_X_REQUEST_ID", ""))
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


GATEWAY_PREFIX = "/v1/"


@lru_cache(maxsize=256)
def _gateway_match(urlconf, path: str):
    """The key-authenticated view at `path`, or None. Resolving walks every pattern of the site
    before /v1/; the answer for a path only changes with the URLconf, which is in the key."""
    try:
        match = resolve(path, urlconf)
    except Resolver404:
        return None
    return match if getattr(match.func, "key_authenticated", False) else None
GATEWAY_CSP = "default-src 'none'; frame-ancestors 'none'"


class GatewayShortPathMiddleware:
    """Sends a /v1/ request for a key-authenticated gateway view straight to that view.

    The OpenAI-compatible gateway authenticates every request by its API key and never reads a
    session, a CSRF token, request.user, messages, htmx headers or a CSP nonce, yet those
    middleware cost more CPU than the gateway's own work. Only a view marked
    `key_authenticated` (serving.gateway.gateway_view) takes this path; any other URL,
    including an unknown /v1/ path, goes through the whole chain as before. What still applies
    to the short path: every middleware above this one (health probes, SecurityMiddleware's HTTPS
    redirect and headers, whitenoise, request id and audit context, the database-outage 503),
    the ALLOWED_HOSTS check (as CommonMiddleware makes it), X-Frame-Options, a Content Security
    Policy that allows nothing (a JSON answer loads nothing) and Content-Length.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.path_info.startswith(GATEWAY_PREFIX):
            return self.get_response(request)
        request.get_host()  # DisallowedHost -> 400, exactly as for every other path
        match = _gateway_match(get_urlconf() or settings.ROOT_URLCONF, request.path_info)
        if match is None:
            return self.get_response(request)
        request.resolver_match = match
        response = match.func(request, *match.args, **match.kwargs)
        if not response.streaming and not response.has_header("Content-Length"):
            response.headers["Content-Length"] = str(len(response.content))
        response.headers.setdefault("X-Frame-Options", settings.X_FRAME_OPTIONS)
        response.headers.setdefault("Content-Security-Policy", GATEWAY_CSP)
        return response

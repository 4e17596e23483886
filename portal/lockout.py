"""Throttling of local-account sign-in (django-axes), its audit event and its page.

Failed password sign-ins are counted per (user name, client address) pair; at
ATRIUM_LOGIN_FAILURE_LIMIT failures (AXES_FAILURE_LIMIT) that pair is refused for
ATRIUM_LOGIN_LOCKOUT_MINUTES (AXES_COOLOFF_TIME), counted from the failure that locked it
(refusals during the lockout neither extend it nor are recorded). docs/security.md explains the choice.
This module writes exactly one `auth.lockout` audit event per lockout, renders the sign-in (or
re-authentication) page with a sentence and a Retry-After instead of axes' bare answer, and
keeps OIDC callbacks out of the count. It must never lock anything but a password sign-in:
API tokens, gateway keys and SSO do not pass through here.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from datetime import datetime, timedelta

from axes.backends import AxesStandaloneBackend
from axes.exceptions import AxesBackendPermissionDenied
from axes.handlers.proxy import AxesProxyHandler
from axes.models import AccessAttempt
from axes.signals import user_locked_out
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import AuthenticationForm
from django.db import connection, transaction
from django.dispatch import receiver
from django.shortcuts import render
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme

from portal import audit, locks
from portal.middleware import client_address
from portal.models import AuditEvent, AuditOutcome

log = logging.getLogger(__name__)

LOCKOUT_ACTION = "auth.lockout"
# Request attribute: the throttle refused this attempt because the pair is already locked.
REFUSED_ATTR = "atrium_login_locked"
_LOCKOUT_AUDIT_LOCK = locks.LOGIN_LOCKOUT  # one lockout event even when failures race


class LocalLoginThrottle(AxesStandaloneBackend):
    """First password backend: refuses a locked (user name, address) pair before any hashing.

    It marks the request so the failed-sign-in audit receiver and the re-authentication view
    know the refusal is the lockout's (already audited once), not another wrong password.
    """

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            # No address to count for. Every portal sign-in path passes its request; only
            # Django's test client login() and shell use come here without one.
            return None
        try:
            return super().authenticate(request, username=username, password=password, **kwargs)
        except AxesBackendPermissionDenied:
            setattr(request, REFUSED_ATTR, True)
            log.warning("local sign-in refused while locked out (from %s)", getattr(request, "axes_ip_address", "?"))
            raise


def client_ip(request) -> str:
    """The address failures are counted for: the audit log's source address (trusted proxies
    only), and never a value that PostgreSQL's inet column would refuse."""
    address = client_address(request)
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        peer = request.META.get("REMOTE_ADDR", "")
        try:
            return str(ipaddress.ip_address(peer))
        except ValueError:
            return str(ipaddress.IPv4Address(0))  # no usable address (a unix socket, no proxy header)


def not_a_password_login(request, credentials) -> bool:
    """axes' whitelist: everything that is not a user name + password (the OIDC callback
    authenticates with a code and a nonce) is neither counted nor refused."""
    credentials = credentials or {}
    return not (credentials.get("username") and credentials.get("password") is not None)


def attempted_username(request, credentials) -> str | None:
    """AXES_USERNAME_CALLABLE: the name as typed, cut to the counter column's 255 characters
    (no account name is that long, so the cut never merges a real account with another)."""
    if credentials:
        name = credentials.get("username")
    else:
        name = getattr(request, "POST", {}).get("username")
    return None if name is None else str(name)[:255]


def cool_off() -> timedelta:
    return settings.AXES_COOLOFF_TIME


def locked_until(request, credentials) -> datetime:
    """When the pair is free again: the newest counted failure plus the cool-off.

    An upper bound when failures came with several user agents (each row ages on its own)."""
    handler = AxesProxyHandler.get_implementation()
    AxesProxyHandler.update_request(request)
    newest = None
    for attempts in handler.get_user_attempts(request, credentials):
        latest = attempts.order_by("-attempt_time").values_list("attempt_time", flat=True).first()
        if latest is not None and (newest is None or latest > newest):
            newest = latest
    return (newest or timezone.now()) + cool_off()


def lockout_sentence(until, seconds: int) -> str:
    minutes = max(1, math.ceil(seconds / 60))
    text = (f"Too many failed sign-ins for this user name from your address: signing in with its password "
            f"from here is paused for {minutes} minute{'s' if minutes != 1 else ''} "
            f"(until {until:%H:%M} UTC). A platform administrator can lift the lock sooner.")
    if settings.OIDC_ENABLED:
        text += " Signing in with SSO is not affected."
    return text


def lockout_response(request, original_response=None, credentials=None):
    """AXES_LOCKOUT_CALLABLE: the page the person was on, with the sentence, 429 + Retry-After."""
    credentials = credentials or getattr(request, "axes_credentials", None) or {}
    until = locked_until(request, credentials)
    seconds = max(1, math.ceil((until - timezone.now()).total_seconds()))
    sentence = lockout_sentence(until, seconds)
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        # sudo re-authentication counts against the same pair as sign-in
        next_url = request.POST.get("next") or "/"
        if not url_has_allowed_host_and_scheme(next_url, {request.get_host()}, request.is_secure()):
            next_url = "/"
        sso = request.session.get("_auth_user_backend", "").endswith("AtriumOIDCBackend") and settings.OIDC_ENABLED
        response = render(request, "portal/reauthenticate.html",
                          {"next": next_url, "sso": sso, "lockout": sentence}, status=429)
    else:
        form = AuthenticationForm(request, initial={"username": credentials.get("username", "")})
        response = render(request, "registration/login.html", {
            "form": form, "lockout": sentence, "oidc_enabled": settings.OIDC_ENABLED,
            "next": request.POST.get("next", ""),
        }, status=429)
    response["Retry-After"] = str(seconds)
    return response


@receiver(user_locked_out)
def audit_lockout(sender, request, username, ip_address, **kwargs):
    """One `auth.lockout` event per lockout.

    axes sends the signal for the failure that locks and again for each refusal while locked;
    only a recorded failure (axes_failures_since_start set) can start a lockout, and an event
    for the same pair inside the cool-off window means this one already has its event (two
    racing failures may both cross the limit)."""
    failures = getattr(request, "axes_failures_since_start", None)
    if failures is None or getattr(request, REFUSED_ATTR, False):
        return
    username = str(username or "")[:150]
    since = timezone.now() - cool_off()
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cur:
                cur.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCKOUT_AUDIT_LOCK])
        already = AuditEvent.objects.filter(action=LOCKOUT_ACTION, time__gte=since, target_label=username,
                                            after__address=ip_address).exists()
        if already:
            return
        account = get_user_model().objects.filter(username=username).only("pk").first()
        until = timezone.now() + cool_off()
        audit.record(
            LOCKOUT_ACTION, outcome=AuditOutcome.DENIED, actor_label=f"anonymous ({username})",
            target_type="auth.user", target_id=str(account.pk) if account else "", target_label=username,
            reason=(f"{failures} failed sign-ins from {ip_address}: password sign-in for this user name "
                    f"from this address refused for {int(cool_off().total_seconds() // 60)} minutes"),
            after={"failures": failures, "address": ip_address, "until": until},
        )


def prune_expired_attempts(now=None) -> int:
    """Delete failure counters older than the cool-off (they no longer count for anything)."""
    threshold = (now or timezone.now()) - cool_off()
    deleted, _ = AccessAttempt.objects.filter(attempt_time__lte=threshold).delete()
    return deleted

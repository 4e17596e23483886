"""Audit of sign-in, sign-out and failed sign-in; a fresh sign-in also opens sudo mode."""

from __future__ import annotations

import time

from django.contrib.auth.signals import user_logged_in, user_logged_out, user_login_failed
from django.dispatch import receiver

from portal import audit, lockout
from portal.middleware import SUDO_SESSION_KEY
from portal.models import AuditOutcome


@receiver(user_logged_in)
def on_login(sender, request, user, **kwargs):
    if request is not None and hasattr(request, "session"):
        request.session[SUDO_SESSION_KEY] = time.time()
    from tenants.access import is_vendor_only

    action = "vendor.login" if is_vendor_only(user) else "auth.login"
    audit.record(action, actor=user, target_type="auth.user", target_id=str(user.pk),
                 target_label=user.get_username(), reason=_vendor_reason(user) if action == "vendor.login" else "")


def _vendor_reason(user) -> str:
    from django.utils import timezone

    now = timezone.now()
    grants = user.vendor_grants.filter(revoked__isnull=True, starts__lte=now, expires__gt=now)
    return "; ".join(f"work order {g.work_order_id}" for g in grants) or "no valid grant"


@receiver(user_logged_out)
def on_logout(sender, request, user, **kwargs):
    if user is not None:
        audit.record("auth.logout", actor=user, target_type="auth.user", target_id=str(user.pk),
                     target_label=user.get_username())


@receiver(user_login_failed)
def on_login_failed(sender, credentials, request=None, **kwargs):
    if "username" not in credentials:
        return  # the OIDC callback: portal.oidc audits its refusals itself, with the reason
    if getattr(request, lockout.REFUSED_ATTR, False):
        return  # refused by the sign-in throttle: one auth.lockout event per lockout (portal.lockout)
    username = str(credentials.get("username", ""))[:150]
    audit.record("auth.login_failed", outcome=AuditOutcome.FAILED, actor_label=f"anonymous ({username})",
                 target_type="auth.user", target_label=username, reason="wrong username or password")

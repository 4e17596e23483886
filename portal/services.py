"""Shared helpers for every app's services: refusing with an audit trail, and sudo mode.

A refusal is audited outside the refused transaction (so the record survives the rollback)
and then raised. Sensitive operations ask `require_sudo`, which passes only when the acting
request carries a recent re-authentication. Nothing here changes domain state.
"""

from __future__ import annotations

from django.core.exceptions import PermissionDenied

from portal import audit, context
from portal.models import AuditOutcome


class SudoRequired(PermissionDenied):
    """The action needs a fresh re-authentication (password or SSO) first."""


def deny(actor, action: str, reason: str, **target) -> None:
    audit.record(action, actor=actor, outcome=AuditOutcome.DENIED, reason=reason, **target)
    raise PermissionDenied(reason)


def require_sudo(actor, action: str, **target) -> None:
    if not context.current().sudo:
        audit.record(
            action, actor=actor, outcome=AuditOutcome.DENIED,
            reason="needs a recent re-authentication", **target,
        )
        raise SudoRequired("This change needs you to confirm your identity again.")

"""Personal access tokens: issue, revoke and check them (the only code that writes the rows).

A token is `atp_` followed by 40 random URL-safe characters. Only its HMAC-SHA256, keyed by
ATRIUM_API_TOKEN_KEY (or, when unset, a key derived from SECRET_KEY), is stored, so a copy
of the database alone cannot be used to call the API. Issuing and revoking each write one
audit event; checking a token never writes one (it would flood the log) and never reveals
whether a refused token was unknown, expired or revoked beyond what its holder already knows.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.utils import timezone

from api.models import SCOPE_ORDER, PersonalAccessToken, TokenScope
from portal import audit

TOKEN_PREFIX = "atp_"  # nosec B105 # the public marker of the token kind, not a secret
MAX_DAYS = 365
# last_used is a hint for people reviewing their tokens; writing it on every call would
# turn each read into a write, so it is refreshed at most once a minute.
LAST_USED_RESOLUTION = dt.timedelta(minutes=1)


def _key() -> bytes:
    configured = getattr(settings, "ATRIUM_API_TOKEN_KEY", "")
    if configured:
        return configured.encode()
    return hashlib.sha256(b"atrium.api.token:" + settings.SECRET_KEY.encode()).digest()


def digest(raw: str) -> str:
    return hmac.new(_key(), raw.encode(), hashlib.sha256).hexdigest()


def create_token(actor, *, name: str, scope: str, days: int, max_scope: str | None = None) -> tuple[PersonalAccessToken, str]:
    """Issue a token for `actor` itself; returns the row and the secret (shown once, never stored).

    `max_scope` is the scope of the token making this request, if any: a token never mints a
    stronger one."""
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "give the token a name that says where it is used"})
    if scope not in TokenScope.values:
        raise ValidationError({"scope": f"scope must be one of {', '.join(TokenScope.values)}"})
    if not isinstance(days, int) or not 1 <= days <= MAX_DAYS:
        raise ValidationError({"expires_in_days": f"a token lives between 1 and {MAX_DAYS} days"})
    if max_scope is not None and SCOPE_ORDER.index(TokenScope(scope)) > SCOPE_ORDER.index(TokenScope(max_scope)):
        raise PermissionDenied(f"a {max_scope} token cannot create a {scope} token")
    raw = TOKEN_PREFIX + secrets.token_urlsafe(30)
    now = timezone.now()
    token = PersonalAccessToken(user=actor, name=name[:80], prefix=raw[:12], digest=digest(raw), scope=scope,
                                created=now, expires=now + dt.timedelta(days=days))
    with transaction.atomic():
        token.save()
        audit.record("api.token.create", actor=actor, target=token,
                     after={"name": token.name, "scope": scope, "prefix": token.prefix, "expires": token.expires})
    return token, raw


def revoke_token(actor, token: PersonalAccessToken) -> PersonalAccessToken:
    """Revoke one of the actor's own tokens (effective at its next use)."""
    if token.user_id != actor.pk:
        # callers look tokens up among the actor's own; this guards a future caller that does not
        raise PermissionDenied("you may revoke only your own tokens")
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        token = PersonalAccessToken.objects.select_for_update().get(pk=token.pk)
        if token.revoked is not None:
            raise ValidationError({"token": f"token {token.prefix}… is already revoked"})
        token.revoked = timezone.now()
        token.save(update_fields=["revoked"])
        audit.record("api.token.revoke", actor=actor, target=token, before={"revoked": None},
                     after={"revoked": token.revoked, "prefix": token.prefix})
    return token


@dataclass(frozen=True)
class Check:
    token: PersonalAccessToken | None
    problem: str = ""  # why it was refused, in one sentence


def check(raw: str) -> Check:
    """The token a bearer secret stands for, if it may be used now."""
    if not raw.startswith(TOKEN_PREFIX) or len(raw) > 200:
        return Check(None, "The bearer token is not an Atrium access token (they start with atp_).")
    token = PersonalAccessToken.objects.select_related("user").filter(digest=digest(raw)).first()
    if token is None:
        return Check(None, "The access token is not known.")
    if token.revoked is not None:
        return Check(None, f"The access token {token.prefix}… was revoked; create a new one in the portal.")
    now = timezone.now()
    if token.expires <= now:
        return Check(None, f"The access token {token.prefix}… expired; create a new one in the portal.")
    if not token.user.is_active:
        return Check(None, "The account of this access token is disabled.")
    if token.last_used is None or now - token.last_used > LAST_USED_RESOLUTION:
        PersonalAccessToken.objects.filter(pk=token.pk).update(last_used=now)
    return Check(token)


def scope_allows(scope: str, needed: str) -> bool:
    return SCOPE_ORDER.index(TokenScope(scope)) >= SCOPE_ORDER.index(TokenScope(needed))

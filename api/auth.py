"""How an API caller is identified: a personal access token (Bearer) or the portal session.

A token request acts as the token's user with the token's scope and never in sudo mode,
even if the same browser also holds a re-authenticated session. A session request acts with
the person's full reach and must pass Django's CSRF check on changes. Neither grants
anything: what the caller may see and do is still decided by tenants.access and the services.
"""

from __future__ import annotations

from dataclasses import replace

from ninja.security import HttpBearer, SessionAuth

from api import tokens
from api.models import TokenScope
from api.problems import ApiProblem
from portal import context
from tenants import access


class TokenAuth(HttpBearer):
    """`Authorization: Bearer atp_...`: a personal access token."""

    def authenticate(self, request, token: str):
        result = tokens.check(token.strip())
        if result.token is None:
            raise ApiProblem("invalid-token", result.problem)
        user = result.token.user
        if not access.session_still_valid(user):
            raise ApiProblem("invalid-token", "The account of this access token has no valid access any more.")
        request.user = user
        request.api_token = result.token
        # a token never carries the re-authentication of a browser session that may be present
        context.set_context(replace(context.current(), sudo=False))
        return user


class PortalSession(SessionAuth):
    """The portal's own signed-in session (cookie), with CSRF on state-changing calls."""

    def authenticate(self, request, key):
        user = super().authenticate(request, key)
        if user is not None:
            request.api_token = None
        return user


AUTH = [TokenAuth(), PortalSession()]


def require_scope(request, scope: str) -> None:
    """Refuse a token whose scope is narrower than `scope` (a session has every scope)."""
    token = getattr(request, "api_token", None)
    if token is not None and not token.allows(scope):
        raise ApiProblem("insufficient-scope",
                         f"This call needs a token with scope '{scope}'; this token ({token.prefix}…) has '{token.scope}'.")


def caller_scope(request) -> str | None:
    token = getattr(request, "api_token", None)
    return token.scope if token is not None else None


__all__ = ["AUTH", "TokenScope", "caller_scope", "require_scope"]

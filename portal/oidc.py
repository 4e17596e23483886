"""Single sign-on with an OpenID Provider (mozilla-django-oidc): backend, views, session refresh.

Authorization code flow with PKCE (S256), state and nonce; the ID token's RS256 signature is
checked against the provider's JWKS, and its issuer, audience and expiry are checked too.
People are matched on (issuer, subject) through `tenants.ExternalIdentity` and never by email
(an email address can be reassigned at the provider; a subject cannot). The groups claim is
mapped to memberships at every login through the tenants services with source="oidc": new
groups grant, missing groups revoke, and only rows the provider granted are ever revoked.
A claim never creates a tenant or a project. Endpoints come from discovery, fetched once and
cached, so operators set one variable. This module must never trust a claim it has not
verified, and never log a token.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from urllib.parse import urlsplit

import jwt
import requests
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured, SuspiciousOperation
from django.core.signals import setting_changed
from django.db import transaction
from django.dispatch import receiver
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import resolve_url
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.generic import View
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.middleware import SessionRefresh
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from portal import audit
from portal.middleware import SUDO_SESSION_KEY
from portal.models import AuditOutcome

log = logging.getLogger(__name__)

# A re-authentication for sudo mode must come from a sign-in at the provider this recent.
REAUTH_MAX_AGE_SECONDS = 300
_REAUTH_STATE_KEY = "atrium_oidc_reauth_state"
_USERNAME_OK = re.compile(r"^[\w.@+-]{1,100}$")


class ProviderUnavailable(Exception):
    """Discovery failed: the provider is unreachable or its metadata is not usable."""


class LoginRefused(Exception):
    """A verified token that still may not sign in (subject mismatch, inactive account)."""


# --- discovery ------------------------------------------------------------------------------

_DISCOVERY_TTL = 3600
_discovery_lock = threading.Lock()
_discovery_cache: dict[str, tuple[float, dict]] = {}

# setting name -> discovery metadata field
_ENDPOINTS = {
    "OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint",
    "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",  # nosec B105 # a discovery document field name
    "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint",
    "OIDC_OP_JWKS_ENDPOINT": "jwks_uri",
}


def discovery_url() -> str:
    if settings.OIDC_OP_DISCOVERY_URL:
        return settings.OIDC_OP_DISCOVERY_URL
    if settings.OIDC_OP_ISSUER:
        return settings.OIDC_OP_ISSUER.rstrip("/") + "/.well-known/openid-configuration"
    return ""


def provider_metadata() -> dict:
    """The provider's discovery document, fetched on first use and cached for an hour.

    A failed fetch is not cached, so the next sign-in tries again.
    """
    url = discovery_url()
    if not url:
        return {}
    now = time.monotonic()
    with _discovery_lock:
        cached = _discovery_cache.get(url)
        if cached and now - cached[0] < _DISCOVERY_TTL:
            return cached[1]
    try:
        resp = requests.get(url, timeout=settings.OIDC_TIMEOUT, verify=settings.OIDC_VERIFY_SSL)
        resp.raise_for_status()
        meta = resp.json()
    except (requests.RequestException, ValueError) as exc:
        raise ProviderUnavailable(f"OIDC discovery at {url} failed: {exc}") from exc
    missing = [f for f in (*_ENDPOINTS.values(), "issuer") if not meta.get(f)]
    if missing:
        raise ProviderUnavailable(f"OIDC discovery at {url} lacks {', '.join(missing)}")
    # OpenID Connect Discovery 4.3: the document must name the issuer we asked.
    if settings.OIDC_OP_ISSUER and meta["issuer"].rstrip("/") != settings.OIDC_OP_ISSUER.rstrip("/"):
        raise ProviderUnavailable(f"OIDC discovery names issuer {meta['issuer']!r}, expected {settings.OIDC_OP_ISSUER!r}")
    with _discovery_lock:
        _discovery_cache[url] = (now, meta)
    return meta


@receiver(setting_changed)
def _forget_discovery(setting, **kwargs):
    if setting.startswith("OIDC_"):
        with _discovery_lock:
            _discovery_cache.clear()


def endpoint(setting_name: str) -> str:
    """An explicitly configured endpoint wins; otherwise the discovered one."""
    explicit = getattr(settings, setting_name, "")
    if explicit:
        return explicit
    value = provider_metadata().get(_ENDPOINTS[setting_name], "")
    if not value:
        raise ImproperlyConfigured(f"{setting_name} is not set and no OIDC discovery is configured")
    return value


def expected_issuer() -> str:
    issuer = settings.OIDC_OP_ISSUER or provider_metadata().get("issuer", "")
    if not issuer:
        raise ImproperlyConfigured("OIDC needs OIDC_OP_ISSUER or OIDC_OP_DISCOVERY_URL to check the token issuer")
    return issuer


class _DiscoveredEndpoints:
    """Endpoint attributes of the mozilla-django-oidc classes, resolved at use, not at __init__.

    The base classes copy static settings into attributes in __init__; the setters ignore
    that copy because `endpoint()` reads the explicit setting itself and falls back to discovery.
    """

    def _ignore(self, value):
        pass

    OIDC_OP_AUTHORIZATION_ENDPOINT = property(lambda self: endpoint("OIDC_OP_AUTHORIZATION_ENDPOINT"), _ignore)
    OIDC_OP_AUTH_ENDPOINT = OIDC_OP_AUTHORIZATION_ENDPOINT  # the request view's spelling
    OIDC_OP_TOKEN_ENDPOINT = property(lambda self: endpoint("OIDC_OP_TOKEN_ENDPOINT"), _ignore)
    OIDC_OP_USER_ENDPOINT = property(lambda self: endpoint("OIDC_OP_USER_ENDPOINT"), _ignore)
    OIDC_OP_JWKS_ENDPOINT = property(lambda self: endpoint("OIDC_OP_JWKS_ENDPOINT"), _ignore)


# --- groups claim -> memberships --------------------------------------------------------------


def parse_groups(groups) -> tuple[set, set, set]:
    """Map `atrium:<tenant>:<role>`, `atrium:<tenant>/<project>:<role>`, `atrium:platform:<role>`.

    Returns ({(tenant, role)}, {(project, role)}, {platform role}) of rows that exist; unknown
    tenants, projects and roles are logged and ignored (a claim never creates anything).
    """
    from tenants.models import Project, Tenant
    from tenants.roles import PLATFORM_ROLES, PROJECT_ROLES, TENANT_ROLES

    prefix = settings.OIDC_GROUP_PREFIX
    if isinstance(groups, str):
        groups = [groups]
    if not isinstance(groups, (list, tuple)):
        return set(), set(), set()
    tenant_roles, project_roles, platform_roles = set(), set(), set()
    for raw in groups:
        # Keycloak sends "/name" when "full group path" is on.
        name = str(raw).lstrip("/")
        if not name.startswith(prefix):
            continue
        scope, sep, role = name[len(prefix):].rpartition(":")
        if not sep or not scope:
            log.warning("OIDC group %r ignored: expected %s<tenant>[/<project>]:<role>", raw, prefix)
            continue
        if scope == "platform":
            if role in PLATFORM_ROLES:
                platform_roles.add(role)
            else:
                log.warning("OIDC group %r ignored: %r is not a platform role", raw, role)
        elif "/" in scope:
            tenant_slug, _, project_slug = scope.partition("/")
            project = Project.objects.select_related("tenant").filter(tenant__slug=tenant_slug, slug=project_slug).first()
            if project is None:
                log.warning("OIDC group %r ignored: no project %s/%s", raw, tenant_slug, project_slug)
            elif role not in PROJECT_ROLES:
                log.warning("OIDC group %r ignored: %r is not a project role", raw, role)
            else:
                project_roles.add((project, role))
        else:
            tenant = Tenant.objects.filter(slug=scope).first()
            if tenant is None:
                log.warning("OIDC group %r ignored: no tenant %s", raw, scope)
            elif role not in TENANT_ROLES:
                log.warning("OIDC group %r ignored: %r is not a tenant role", raw, role)
            else:
                tenant_roles.add((tenant, role))
    return tenant_roles, project_roles, platform_roles


def sync_memberships(user, groups) -> None:
    """Make the user's provider-granted memberships equal to the groups claim.

    Grants go through the tenants services with source="oidc" (the acting user is the user
    themself; each change is audited there). Rows granted in Atrium (source="local") are never
    touched; a project role also keeps the "member" row of its tenant that the project grant
    implied.
    """
    from tenants import services
    from tenants.models import MembershipSource, PlatformRoleAssignment, ProjectMembership, TenantMembership

    oidc = MembershipSource.OIDC
    tenant_roles, project_roles, platform_roles = parse_groups(groups)
    with transaction.atomic():
        for tenant, role in sorted(tenant_roles, key=lambda tr: (tr[0].slug, tr[1])):
            services.add_tenant_member(user, tenant, user, role, source=oidc)
        for project, role in sorted(project_roles, key=lambda pr: (pr[0].pk, pr[1])):
            services.add_project_member(user, project, user, role, source=oidc)
        for role in sorted(platform_roles):
            services.grant_platform_role(user, user, role, source=oidc)

        wanted_projects = {(p.pk, role) for p, role in project_roles}
        for m in ProjectMembership.objects.filter(user=user, source=oidc).select_related("project__tenant", "user"):
            if (m.project_id, m.role) not in wanted_projects:
                services.remove_project_member(user, m, source=oidc)
        wanted_tenants = {(t.pk, role) for t, role in tenant_roles}
        implied = {p.tenant_id for p, _ in project_roles}
        for m in TenantMembership.objects.filter(user=user, source=oidc).select_related("tenant", "user"):
            if (m.tenant_id, m.role) in wanted_tenants or (m.role == "member" and m.tenant_id in implied):
                continue
            services.remove_tenant_member(user, m, source=oidc)
        for a in PlatformRoleAssignment.objects.filter(user=user, source=oidc).select_related("user"):
            if a.role not in platform_roles:
                services.revoke_platform_role(user, a, source=oidc)


# --- authentication backend ----------------------------------------------------------------


def _refused(reason: str, *, subject: str = "") -> None:
    """One audit event per refused SSO sign-in, with the reason."""
    label = f"oidc subject {subject}" if subject else "oidc"
    audit.record("auth.login_failed", outcome=AuditOutcome.FAILED, actor_label=f"anonymous ({label})",
                 target_type="auth.user", target_label=label[:300], reason=f"SSO: {reason}"[:500])
    log.warning("SSO sign-in refused: %s", reason)


def _new_username(claims: dict, issuer: str, subject: str) -> str:
    User = get_user_model()
    preferred = str(claims.get("preferred_username") or "")
    if _USERNAME_OK.match(preferred) and not User.objects.filter(username__iexact=preferred).exists():
        return preferred
    digest = hashlib.sha256(f"{issuer}|{subject}".encode()).hexdigest()
    for length in (12, 20, 64):
        candidate = f"sso-{digest[:length]}"
        if not User.objects.filter(username__iexact=candidate).exists():
            return candidate
    raise LoginRefused("no free username")


class AtriumOIDCBackend(_DiscoveredEndpoints, OIDCAuthenticationBackend):
    """Verifies the provider's tokens and finds the user by (issuer, subject).

    Django builds a backend for every authenticate() and every request's get_user(), so
    __init__ does no network and no discovery (the base class's __init__ would).
    """

    def __init__(self, *args, **kwargs):
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None  # always the provider's JWKS: keys rotate
        self.UserModel = get_user_model()
        self.request = None

    def authenticate(self, request, **kwargs):
        # Only the OIDC callback calls with a nonce / code verifier; a password login that
        # happens to carry ?code=&state= must never start a token exchange.
        if request is None or "username" in kwargs or "password" in kwargs:
            return None
        if not ("nonce" in kwargs or "code_verifier" in kwargs):
            return None
        if not (request.GET.get("code") and request.GET.get("state")):
            return None
        try:
            return super().authenticate(request, **kwargs)
        except (SuspiciousOperation, LoginRefused, ProviderUnavailable, jwt.PyJWTError,
                requests.RequestException, KeyError, ValueError) as exc:
            _refused(str(exc) or exc.__class__.__name__, subject=getattr(self, "_subject", ""))
            return None

    def verify_token(self, token, **kwargs):
        """RS256 against the provider's JWKS; issuer, audience, expiry and nonce checked."""
        if not token:
            raise SuspiciousOperation("the provider returned no ID token")
        header = jwt.get_unverified_header(token)
        if header.get("alg") != self.OIDC_RP_SIGN_ALGO:
            raise SuspiciousOperation(f"token algorithm {header.get('alg')!r} is not {self.OIDC_RP_SIGN_ALGO}")
        key = self.retrieve_matching_jwk(token)
        issuer = expected_issuer()
        try:
            payload = jwt.decode(
                token, key, algorithms=[self.OIDC_RP_SIGN_ALGO], audience=self.OIDC_RP_CLIENT_ID, issuer=issuer,
                options={"require": ["iss", "sub", "aud", "exp", "iat"]}, leeway=30,
            )
        except jwt.InvalidAudienceError:
            raise SuspiciousOperation(f"token audience is not this client ({self.OIDC_RP_CLIENT_ID})")
        except jwt.InvalidIssuerError:
            raise SuspiciousOperation(f"token issuer is not {issuer}")
        except jwt.InvalidSignatureError:
            raise SuspiciousOperation("token signature does not verify against the provider's JWKS")
        except jwt.InvalidTokenError as exc:
            raise SuspiciousOperation(f"token refused: {exc}")
        # OpenID Connect Core 3.1.3.7: with several audiences, azp must name this client.
        aud = payload["aud"]
        if isinstance(aud, list) and len(aud) > 1 and payload.get("azp") != self.OIDC_RP_CLIENT_ID:
            raise SuspiciousOperation("token has several audiences and azp is not this client")
        # The callback passes the nonce it stored; a signed userinfo response has none to check.
        if settings.OIDC_USE_NONCE and "nonce" in kwargs and kwargs["nonce"] != payload.get("nonce"):
            raise SuspiciousOperation("token nonce does not match this sign-in")
        return payload

    def get_or_create_user(self, access_token, id_token, payload):
        from tenants.models import ExternalIdentity

        issuer, subject = payload["iss"], str(payload["sub"])
        self._subject = subject
        try:
            userinfo = self.get_userinfo(access_token, id_token, payload)
        except SuspiciousOperation as exc:
            # the base class would swallow this silently; a refusal must be audited
            raise LoginRefused(f"userinfo refused: {exc}")
        # OpenID Connect Core 5.3.2: the UserInfo sub must be the ID token's sub.
        if str(userinfo.get("sub")) != subject:
            raise LoginRefused("userinfo subject differs from the ID token subject")
        claims = {**payload, **userinfo}
        claim = settings.OIDC_GROUPS_CLAIM
        groups = userinfo.get(claim, payload.get(claim, []))

        with transaction.atomic():
            identity = (ExternalIdentity.objects.select_for_update(of=("self",)).select_related("user")
                        .filter(issuer=issuer, subject=subject).first())
            if identity is None:
                if not settings.OIDC_CREATE_USER:
                    raise LoginRefused("no Atrium account is linked to this identity")
                user = self.UserModel.objects.create_user(
                    _new_username(claims, issuer, subject), email=str(claims.get("email") or ""),
                )
                identity = ExternalIdentity.objects.create(user=user, issuer=issuer, subject=subject)
                audit.record("user.provision", actor=user, target_type="auth.user", target_id=str(user.pk),
                             target_label=user.get_username(), reason="first SSO sign-in",
                             after={"issuer": issuer, "subject": subject})
            user = identity.user
            if not user.is_active:
                raise LoginRefused(f"account {user.get_username()} is disabled")
            # The email is informational only; it is never used to find anyone.
            email = str(claims.get("email") or "")
            if email and email != user.email:
                user.email = email
                user.save(update_fields=["email"])
            identity.last_login = timezone.now()
            identity.save(update_fields=["last_login"])
            sync_memberships(user, groups)
        if self.request is not None:
            self.request.atrium_oidc_auth_time = payload.get("auth_time")
        return user

    def get_user(self, user_id):
        user = super().get_user(user_id)
        return user if user is not None and self.user_can_authenticate(user) else None


# --- views ---------------------------------------------------------------------------------


def _require_enabled() -> None:
    # The URLs are always routed (so tests can turn SSO on with override_settings); they
    # exist for the outside world only when SSO is configured.
    if not settings.OIDC_ENABLED:
        raise Http404("single sign-on is not configured")


def _sso_unavailable(request, exc: Exception):
    log.error("SSO unavailable: %s", exc)
    messages.error(request, "Single sign-on is unavailable right now; try again shortly.")
    return HttpResponseRedirect(resolve_url(settings.LOGIN_URL))


class AtriumAuthenticationRequestView(_DiscoveredEndpoints, OIDCAuthenticationRequestView):
    """Starts the code flow (state, nonce, PKCE S256 from the base class).

    `?reauth=1` asks the provider for a fresh sign-in (prompt=login, max_age=0): the way an SSO
    user confirms their identity for sudo mode.
    """

    def __init__(self, *args, **kwargs):
        View.__init__(self, *args, **kwargs)
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID

    def get(self, request):
        _require_enabled()
        try:
            response = super().get(request)
        except (ProviderUnavailable, ImproperlyConfigured) as exc:
            return _sso_unavailable(request, exc)
        if request.GET.get("reauth"):
            request.session[_REAUTH_STATE_KEY] = _query_value(response["Location"], "state")
        else:
            request.session.pop(_REAUTH_STATE_KEY, None)
        return response

    def get_extra_params(self, request):
        params = dict(super().get_extra_params(request))
        if request.GET.get("reauth"):
            params.update({"prompt": "login", "max_age": "0"})
        return params


def _query_value(url: str, name: str) -> str:
    from urllib.parse import parse_qs

    return (parse_qs(urlsplit(url).query).get(name) or [""])[0]


class AtriumAuthenticationCallbackView(OIDCAuthenticationCallbackView):
    """The provider's redirect back: the base class checks state and runs the backend."""

    @property
    def failure_url(self):
        return resolve_url(settings.LOGIN_URL)

    def get(self, request):
        _require_enabled()
        state = request.GET.get("state", "")
        self._reauth = bool(state) and request.session.pop(_REAUTH_STATE_KEY, None) == state
        try:
            return super().get(request)
        except (ProviderUnavailable, ImproperlyConfigured) as exc:
            return _sso_unavailable(request, exc)

    def login_failure(self):
        messages.error(self.request, "Single sign-on did not succeed.")
        return super().login_failure()

    def login_success(self):
        already = self.request.user.is_authenticated and self.request.user == self.user
        response = super().login_success()
        # A new session gets sudo mode from the user_logged_in signal (portal.signals). An
        # already signed-in user gets it only from an explicit re-authentication whose sign-in
        # at the provider is fresh, never from a silent session refresh (prompt=none).
        auth_time = getattr(self.request, "atrium_oidc_auth_time", None)
        if already and self._reauth and auth_time and time.time() - float(auth_time) < REAUTH_MAX_AGE_SECONDS:
            self.request.session[SUDO_SESSION_KEY] = time.time()
            audit.record("auth.reauthenticate", actor=self.user, target_type="auth.user",
                         target_id=str(self.user.pk), target_label=self.user.get_username(), reason="fresh SSO sign-in")
        return response


# --- session refresh -----------------------------------------------------------------------


class HtmxSessionRefresh(_DiscoveredEndpoints, SessionRefresh):
    """Re-checks an SSO session with the provider when its ID token has expired.

    The base class answers a 302 to the provider (prompt=none); htmx cannot follow that
    across origins, so an htmx request gets 204 with HX-Redirect and the browser navigates.
    The page to come back to is the one the browser shows, not the fragment URL.
    """

    def process_request(self, request):
        try:
            response = super().process_request(request)
        except (ProviderUnavailable, ImproperlyConfigured) as exc:
            # Keep serving the signed-in session; the next request tries again.
            log.error("SSO session refresh skipped: %s", exc)
            return None
        if response is None or not request.headers.get("HX-Request") or response.status_code != 302:
            return response
        current = request.headers.get("HX-Current-URL", "")
        if current and url_has_allowed_host_and_scheme(current, {request.get_host()}, request.is_secure()):
            parts = urlsplit(current)
            request.session["oidc_login_next"] = parts.path + (f"?{parts.query}" if parts.query else "")
        htmx = HttpResponse(status=204)
        htmx["HX-Redirect"] = response["Location"]
        return htmx

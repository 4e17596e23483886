"""SSO sign-in against a real OpenID Provider process (node oidc-provider, pinned).

The provider (tests/oidc_provider/server.mjs) runs on 127.0.0.1 with this module's RSA key,
a client `atrium` that must use PKCE, and accounts read from a JSON file at every sign-in, so
a test changes a person's groups or email between two logins. Logins are driven with
requests through the provider's authorization endpoint, its sign-in form and Atrium's
callback on the live server. Refusals (wrong audience, bad signature) are produced by
tampering with the real provider's token response on its way into Atrium.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import jwt
import pytest
import requests
from cryptography.hazmat.primitives.asymmetric import rsa
from django.conf import settings as django_settings
from django.contrib.auth import SESSION_KEY, get_user_model
from django.contrib.sessions.backends.db import SessionStore

from portal.middleware import SUDO_SESSION_KEY
from portal.models import AuditEvent
from tenants import services as tenancy
from tenants.models import ExternalIdentity, PlatformRoleAssignment, ProjectMembership, TenantMembership

pytestmark = pytest.mark.slow

OP_DIR = Path(django_settings.BASE_DIR) / "tests" / "oidc_provider"
CLIENT_ID = "atrium"
CLIENT_SECRET = "test-only-client-secret-0123456789abcdef"
KID = "atrium-test-key-1"
PASSWORD = "op-password-7h2k"


# --- the provider process -------------------------------------------------------------------


def _ensure_node_modules() -> None:
    """`npm ci` from the committed lock file, once, even with several test runs at a time."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("node and npm are needed for the OIDC end-to-end test")
    with open(Path(tempfile.gettempdir()) / "atrium-oidc-npm-ci.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = OP_DIR / "node_modules" / "oidc-provider" / "package.json"
        if not marker.exists():
            subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=OP_DIR,
                           check=True, timeout=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Provider:
    def __init__(self, workdir: Path, redirect_uri: str):
        self.workdir = workdir
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = jwt.algorithms.RSAAlgorithm.to_jwk(self.key, as_dict=True)
        jwk.update(kid=KID, alg="RS256", use="sig")
        (workdir / "jwks.json").write_text(json.dumps({"keys": [jwk]}))
        clients = [{
            "client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, "redirect_uris": [redirect_uri],
            "grant_types": ["authorization_code"], "response_types": ["code"],
            "token_endpoint_auth_method": "client_secret_basic", "id_token_signed_response_alg": "RS256",
        }]
        (workdir / "clients.json").write_text(json.dumps(clients))
        self.accounts_path = workdir / "accounts.json"
        self.accounts: dict = {}
        self.save_accounts()
        self.port = _free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def save_accounts(self) -> None:
        tmp = self.accounts_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.accounts))
        tmp.replace(self.accounts_path)  # the provider never reads a half-written file

    def set_account(self, login: str, *, sub: str, email: str, groups: list[str], username: str | None = None):
        self.accounts[login] = {"password": PASSWORD, "sub": sub, "claims": {
            "email": email, "email_verified": True, "name": login.title(),
            "preferred_username": username or login, "groups": groups,
        }}
        self.save_accounts()

    def start(self) -> None:
        env = {**os.environ, "OP_PORT": str(self.port), "OP_JWKS": str(self.workdir / "jwks.json"),
               "OP_CLIENTS": str(self.workdir / "clients.json"), "OP_ACCOUNTS": str(self.accounts_path)}
        self.log = open(self.workdir / "provider.log", "w+")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(["node", "server.mjs"], cwd=OP_DIR, env=env, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        deadline = time.monotonic() + 20
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY") or self.proc.poll() is not None:
                break
        if not line.startswith("READY"):
            self.stop()
            self.log.seek(0)
            pytest.fail(f"the OpenID Provider did not start: {line!r} {self.log.read()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()


@pytest.fixture(scope="module")
def op(django_db_setup, live_server, tmp_path_factory):
    # django_db_setup first, so the live server (and its database connection) is gone before
    # the test database is dropped.
    _ensure_node_modules()
    provider = Provider(tmp_path_factory.mktemp("oidc-provider"), f"{live_server.url}/oidc/callback/")
    provider.start()
    yield provider
    provider.stop()


@pytest.fixture
def sso(op, settings):
    """Atrium configured the way an operator does it: the issuer only, endpoints discovered."""
    settings.OIDC_ENABLED = True
    settings.OIDC_OP_ISSUER = op.issuer
    settings.OIDC_OP_DISCOVERY_URL = ""
    for name in ("AUTHORIZATION", "TOKEN", "USER", "JWKS"):
        setattr(settings, f"OIDC_OP_{name}_ENDPOINT", "")
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_TIMEOUT = 5
    settings.AUTHENTICATION_BACKENDS = ["portal.oidc.AtriumOIDCBackend", *django_settings.AUTHENTICATION_BACKENDS]
    op.accounts.clear()
    op.save_accounts()
    return op


# --- driving a login -------------------------------------------------------------------------


class Login:
    def __init__(self, http: requests.Session, final: requests.Response, authorize_url: str, callback_url: str):
        self.http, self.final = http, final
        self.authorize = parse_qs(urlsplit(authorize_url).query)
        self.callback = parse_qs(urlsplit(callback_url).query) if callback_url else {}

    @property
    def session(self) -> SessionStore:
        return SessionStore(session_key=self.http.cookies.get(django_settings.SESSION_COOKIE_NAME))


def sso_login(live_server, op, login: str, *, http: requests.Session | None = None, start: str = "/oidc/authenticate/"):
    """Atrium -> provider's authorization endpoint -> sign-in form -> Atrium's callback."""
    http = http or requests.Session()
    form = http.get(f"{live_server.url}{start}", timeout=10)
    authorize_url = next(r.headers["Location"] for r in form.history if r.headers["Location"].startswith(op.issuer))
    assert form.url.startswith(f"{op.issuer}/interaction/"), form.text[:500]
    action = re.search(r'<form method="post" action="([^"]+)"', form.text).group(1)
    final = http.post(f"{op.issuer}{action}", data={"login": login, "password": PASSWORD}, timeout=20)
    callback_url = next((r.url for r in final.history if "/oidc/callback/" in r.url), "")
    return Login(http, final, authorize_url, callback_url)


def session_user(login: Login):
    pk = login.session.get(SESSION_KEY)
    return get_user_model().objects.filter(pk=pk).first() if pk else None


def roles(user) -> dict:
    return {
        "tenant": {(m.tenant.slug, m.role, m.source) for m in TenantMembership.objects.filter(user=user)},
        "project": {(m.project.slug, m.role, m.source) for m in ProjectMembership.objects.filter(user=user)},
        "platform": {(a.role, a.source) for a in PlatformRoleAssignment.objects.filter(user=user)},
    }


# --- the end-to-end flow ---------------------------------------------------------------------


def test_sso_login_creates_memberships_from_groups_and_resyncs_them_at_next_login(live_server, org, sso):
    # A local account already uses this email address and this username: SSO must take neither.
    local_carol = get_user_model().objects.create_user("carol", email="carol@corp.test", password="x-local-pass-123")
    sso.set_account("carol", sub="b9f1c2d4-0001", email="carol@corp.test", groups=[
        "atrium:alpha:finance_viewer", "atrium:alpha/alpha-p:user", "atrium:platform:auditor",
        "atrium:gamma:member",           # no such tenant: ignored, never created
        "atrium:alpha:overlord",         # no such role: ignored
        "atrium:alpha/nope:user",        # no such project: ignored
        "/other-app:admin",              # another application's group
    ])

    first = sso_login(live_server, sso, "carol")

    # the authorization request carried state, nonce and an S256 PKCE challenge
    assert first.authorize["code_challenge_method"] == ["S256"]
    assert len(first.authorize["code_challenge"][0]) >= 43
    assert first.authorize["state"] and first.authorize["nonce"]
    assert first.authorize["client_id"] == [CLIENT_ID]
    assert first.callback["code"] and first.callback["state"] == first.authorize["state"]
    # ...and it ended signed in to Atrium, on the dashboard, as a new user
    assert first.final.status_code == 200 and first.final.url == f"{live_server.url}/"
    user = session_user(first)
    assert user is not None and user.pk != local_carol.pk
    assert user.username.startswith("sso-") and user.email == "carol@corp.test"
    assert not user.has_usable_password()
    assert ExternalIdentity.objects.get(issuer=sso.issuer, subject="b9f1c2d4-0001").user == user
    assert first.session.get("_auth_user_backend") == "portal.oidc.AtriumOIDCBackend"
    # a fresh SSO login opens sudo mode, and is audited
    assert time.time() - first.session[SUDO_SESSION_KEY] < 60
    assert AuditEvent.objects.filter(action="auth.login", actor=user).count() == 1

    assert roles(user) == {
        # (no implied "member" row: the finance_viewer role already makes carol a tenant member)
        "tenant": {("alpha", "finance_viewer", "oidc")},
        "project": {("alpha-p", "user", "oidc")},
        "platform": {("auditor", "oidc")},
    }
    assert not type(org.tenants["alpha"]).objects.filter(slug="gamma").exists()
    # one event per claimed role (the tenant "member" row implied by the project role has none)
    assert AuditEvent.objects.filter(action="membership.grant", actor=user).count() == 2
    assert AuditEvent.objects.filter(action="platform_role.grant", actor=user).count() == 1
    # the account really sees what the claim gave it
    jobs = first.http.get(f"{live_server.url}/scheduling/jobs/", timeout=10)
    assert jobs.status_code == 200 and jobs.url.endswith("/scheduling/jobs/")

    # A grant made in Atrium itself: SSO must never revoke it.
    tenancy.add_project_member(org.admin, org.projects["beta"], user, "viewer")

    # At the provider: a new email, the alpha groups gone, beta tenant_admin new.
    sso.set_account("carol", sub="b9f1c2d4-0001", email="carol.new@corp.test", groups=["atrium:beta:tenant_admin"])
    second = sso_login(live_server, sso, "carol")

    assert second.final.url == f"{live_server.url}/"
    again = session_user(second)
    assert again.pk == user.pk, "matched on (issuer, subject), not on email"
    again.refresh_from_db()
    assert again.email == "carol.new@corp.test"
    assert ExternalIdentity.objects.filter(user=user).count() == 1
    assert roles(again) == {
        "tenant": {("beta", "tenant_admin", "oidc"), ("beta", "member", "local")},
        "project": {("beta-p", "viewer", "local")},
        "platform": set(),
    }
    revoked = set(AuditEvent.objects.filter(action="membership.revoke", actor=user).values_list("target_label", flat=True))
    assert revoked == {f"{user.username} as user of {org.projects['alpha']}", f"{user.username} as finance_viewer of alpha"}
    assert AuditEvent.objects.filter(action="platform_role.revoke", actor=user).count() == 1
    # the local account with the same email was never touched
    local_carol.refresh_from_db()
    assert local_carol.email == "carol@corp.test" and not ExternalIdentity.objects.filter(user=local_carol).exists()


def test_project_role_from_claim_implies_tenant_membership_and_both_go_with_the_group(live_server, make_user, sso):
    # a tenant and a project of their own (the full `org` fixture is slow without a rollback)
    admin = make_user("bootstrap-admin")
    tenancy.grant_platform_role(admin, admin, "platform_admin", bootstrap=True)
    delta = tenancy.create_tenant(admin, slug="delta", name="Delta")
    tenancy.create_project(admin, delta, slug="delta-p", name="delta project", project_class="research")
    sso.set_account("dmitri", sub="sub-dmitri", email="d@corp.test", groups=["atrium:delta/delta-p:viewer"])
    login = sso_login(live_server, sso, "dmitri")
    user = session_user(login)
    assert user.username == "dmitri"  # preferred_username, since no account has it
    assert roles(user) == {"tenant": {("delta", "member", "oidc")}, "project": {("delta-p", "viewer", "oidc")},
                           "platform": set()}

    sso.set_account("dmitri", sub="sub-dmitri", email="d@corp.test", groups=[])
    assert session_user(sso_login(live_server, sso, "dmitri")) == user
    assert roles(user) == {"tenant": set(), "project": set(), "platform": set()}


def test_explicit_sso_reauthentication_opens_sudo_mode(live_server, db, sso):
    sso.set_account("erin", sub="sub-erin", email="e@corp.test", groups=[])
    login = sso_login(live_server, sso, "erin")
    user = session_user(login)
    session = login.session
    del session[SUDO_SESSION_KEY]
    session.save()

    again = sso_login(live_server, sso, "erin", http=login.http, start="/oidc/authenticate/?reauth=1")

    # the provider was asked for a fresh sign-in, and its answer re-opened sudo mode
    assert again.authorize["prompt"] == ["login"] and again.authorize["max_age"] == ["0"]
    assert session_user(again) == user
    assert time.time() - again.session[SUDO_SESSION_KEY] < 60
    assert AuditEvent.objects.filter(action="auth.reauthenticate", actor=user, reason="fresh SSO sign-in").count() == 1


# --- refusals ----------------------------------------------------------------------------------


def _tamper(monkeypatch, op, how: str):
    """Let the real provider answer the token request, then alter its ID token in transit."""
    from portal.oidc import AtriumOIDCBackend

    real_get_token = AtriumOIDCBackend.get_token
    rogue = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def get_token(self, payload):
        tokens = real_get_token(self, payload)
        claims = jwt.decode(tokens["id_token"], options={"verify_signature": False})
        if how == "audience":
            # validly signed with the provider's own key, but for someone else
            claims["aud"] = "someone-else"
            tokens["id_token"] = jwt.encode(claims, op.key, algorithm="RS256", headers={"kid": KID})
        elif how == "signature":
            # same claims and kid, signed by a key that is not in the provider's JWKS
            tokens["id_token"] = jwt.encode(claims, rogue, algorithm="RS256", headers={"kid": KID})
        return tokens

    monkeypatch.setattr(AtriumOIDCBackend, "get_token", get_token)


@pytest.mark.parametrize(("how", "reason"), [
    ("audience", "SSO: token audience is not this client (atrium)"),
    ("signature", "SSO: token signature does not verify against the provider's JWKS"),
])
def test_tampered_id_token_is_refused_and_audited(live_server, db, sso, monkeypatch, how, reason):
    sso.set_account("mallory", sub="sub-mallory", email="m@corp.test", groups=["atrium:platform:platform_admin"])
    _tamper(monkeypatch, sso, how)
    users_before = get_user_model().objects.count()

    login = sso_login(live_server, sso, "mallory")

    assert login.callback.get("code"), "the provider did issue a code; Atrium refused the token"
    assert login.final.url == f"{live_server.url}/login/"
    assert session_user(login) is None
    assert get_user_model().objects.count() == users_before
    assert not ExternalIdentity.objects.filter(subject="sub-mallory").exists()
    assert not PlatformRoleAssignment.objects.filter(source="oidc").exists()
    assert AuditEvent.objects.filter(action="auth.login_failed", reason=reason, outcome="failed").count() == 1
    # still not signed in on the next page
    home = login.http.get(f"{live_server.url}/", timeout=10)
    assert home.url.startswith(f"{live_server.url}/login/")


def test_refused_sso_login_writes_exactly_one_failed_login_event(live_server, db, sso, monkeypatch):
    sso.set_account("mallory", sub="sub-mallory", email="m@corp.test", groups=[])
    _tamper(monkeypatch, sso, "signature")
    sso_login(live_server, sso, "mallory")
    assert AuditEvent.objects.filter(action="auth.login_failed").count() == 1


def _token(key, **claims):
    now = int(time.time())
    base = {"sub": "s-1", "iat": now, "exp": now + 300, "nonce": "n-1"}
    return jwt.encode({**base, **claims}, key, algorithm="RS256", headers={"kid": KID})


def test_backend_verifies_tokens_against_the_providers_jwks(sso):
    from django.core.exceptions import SuspiciousOperation

    from portal.oidc import AtriumOIDCBackend

    good = {"iss": sso.issuer, "aud": CLIENT_ID}
    backend = AtriumOIDCBackend()
    # the control: a token the provider could have issued passes
    assert backend.verify_token(_token(sso.key, **good), nonce="n-1")["sub"] == "s-1"

    rogue = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = int(time.time())
    refused = {
        "audience is not this client": _token(sso.key, **{**good, "aud": "someone-else"}),
        "signature does not verify": _token(rogue, **good),  # the provider's kid, another key
        "issuer is not": _token(sso.key, **{**good, "iss": "http://127.0.0.1:1"}),
        "expired": _token(sso.key, **good, exp=now - 3600),
        "nonce does not match": _token(sso.key, **good, nonce="replayed"),
        "algorithm 'HS256' is not RS256": jwt.encode(
            {**good, "sub": "s-1", "iat": now, "exp": now + 300}, "x" * 64, algorithm="HS256", headers={"kid": KID}),
    }
    for message, token in refused.items():
        with pytest.raises(SuspiciousOperation, match=message):
            backend.verify_token(token, nonce="n-1")


# --- discovery, switching off, htmx session refresh ---------------------------------------------


def test_discovery_refuses_a_document_for_another_issuer(sso, settings):
    from portal.oidc import ProviderUnavailable, endpoint

    assert endpoint("OIDC_OP_TOKEN_ENDPOINT") == f"{sso.issuer}/token"
    settings.OIDC_OP_DISCOVERY_URL = f"{sso.issuer}/.well-known/openid-configuration"
    settings.OIDC_OP_ISSUER = "https://idp.example.test/realms/corp"
    with pytest.raises(ProviderUnavailable, match="names issuer"):
        endpoint("OIDC_OP_TOKEN_ENDPOINT")


def test_sso_urls_answer_404_when_sso_is_off(client, db, settings):
    settings.OIDC_ENABLED = False
    assert client.get("/oidc/authenticate/").status_code == 404
    assert client.get("/oidc/callback/?code=x&state=y").status_code == 404


def test_expired_sso_session_answers_htmx_with_hx_redirect(client, sso, make_user, settings):
    settings.MIDDLEWARE = [*django_settings.MIDDLEWARE, "portal.oidc.HtmxSessionRefresh"]
    user = make_user("sso-htmx")
    client.force_login(user, backend="portal.oidc.AtriumOIDCBackend")
    session = client.session
    session["oidc_id_token_expiration"] = time.time() + 600
    session.save()
    assert client.get("/scheduling/jobs/", headers={"HX-Request": "true"}).status_code == 200  # token still valid

    session["oidc_id_token_expiration"] = time.time() - 1
    session.save()
    resp = client.get("/scheduling/jobs/?page=1", headers={
        "HX-Request": "true", "HX-Current-URL": "http://testserver/scheduling/jobs/?state=pending"})
    assert resp.status_code == 204
    target = urlsplit(resp["HX-Redirect"])
    query = parse_qs(target.query)
    assert f"{target.scheme}://{target.netloc}{target.path}" == f"{sso.issuer}/auth"
    assert query["prompt"] == ["none"] and query["code_challenge_method"] == ["S256"]
    # back to the page the browser showed, not to the fragment URL
    assert client.session["oidc_login_next"] == "/scheduling/jobs/?state=pending"

    plain = client.get("/scheduling/jobs/")  # a full page load keeps the library's 302
    assert plain.status_code == 302 and plain["Location"].startswith(f"{sso.issuer}/auth?")

"""Security headers on every page, with production transport settings, over HTTPS.

The crawl reuses the page matrix (tenants/permission_matrix.yaml, portal/tests/test_matrix.py):
it walks every URL pattern of the project, asks each one as a role the matrix lets in (so the
answer is the real page, not a redirect to sign-in), as a full page and as an htmx fragment,
and POSTs each form; the JSON API and the gateway (the matrix's covered_elsewhere) are asked
too. Every answer must carry nosniff, a Referrer-Policy and HSTS; every HTML answer a Content
Security Policy that allows no inline or eval'd script and sets frame-ancestors, and no inline
script or event-handler attribute that such a policy would block. Error pages (400, 403, 404,
405, 500, the CSRF refusal) are checked the same way, and the session and CSRF cookies are
Secure and SameSite=Lax (the session's HttpOnly as well).

The test must never relax a header to pass: a missing header is fixed in the settings or the
middleware, for every page at once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.http import HttpResponse
from django.test import Client
from django.urls import include, path, reverse

from conftest import PASSWORD
from portal.tests.test_matrix import fill, request, url_for, url_patterns, world  # noqa: F401 (world: a fixture)
from tenants import matrix
from tenants.tests.factories import client_for

ROOT = Path(__file__).resolve().parents[2]
YEAR = 365 * 24 * 3600
PRODUCTION = {
    "SECURE_SSL_REDIRECT": True,
    "SECURE_HSTS_SECONDS": YEAR,
    "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
    "SECURE_HSTS_PRELOAD": True,
    "SESSION_COOKIE_SECURE": True,
    "CSRF_COOKIE_SECURE": True,
}
SAFE_REFERRER = {"no-referrer", "same-origin", "strict-origin", "strict-origin-when-cross-origin"}
UNSAFE_SCRIPT_SOURCES = {"'unsafe-inline'", "'unsafe-eval'", "'unsafe-hashes'", "*", "data:", "http:", "https:", "blob:"}
# the roles asked first: together they reach every page that any role reaches
ROLE_ORDER = ("platform_admin", "tenant_admin", "project_admin", "project_user", "ops_engineer", "security_admin",
              "finance", "auditor", "finance_viewer", "member", "project_viewer", "vendor", "anonymous")
# kwargs of the API and gateway routes (covered_elsewhere in the matrix) -> alpha's object kind
API_KWARGS = {"project_id": "project", "job_id": "job", "token_id": "token", "key_id": "api_key",
              "report_id": "report", "kb_id": "knowledge_base"}
API_LITERALS = {"slug": "helpdesk"}


@pytest.fixture
def production(settings):
    """The transport settings a DEBUG=0 deployment has (test_production_settings_... proves it)."""
    for name, value in PRODUCTION.items():
        setattr(settings, name, value)
    return settings


def csp_directives(header: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for part in header.split(";"):
        words = part.split()
        if words:
            out.setdefault(words[0].lower(), [w.lower() for w in words[1:]])
    return out


class _InlineScript(HTMLParser):
    """Inline <script> bodies, on* event attributes and javascript: URLs: what a CSP without
    'unsafe-inline' blocks, so a page that has them is broken (or relies on a weaker policy)."""

    DATA_TYPES = {"application/json", "application/ld+json", "text/template"}

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name, value in attrs.items():
            if name.startswith("on"):
                self.found.append(f"<{tag} {name}=...>")
            if name in ("href", "src", "action", "formaction") and (value or "").strip().lower().startswith("javascript:"):
                self.found.append(f"<{tag} {name}=javascript:...>")
        if tag == "script" and not attrs.get("src") and (attrs.get("type") or "").lower() not in self.DATA_TYPES:
            self._in_script = True

    def handle_endtag(self, tag):
        self._in_script = False if tag == "script" else self._in_script

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.found.append(f"inline <script>{data.strip()[:40]}...")


def body_of(response) -> str:
    raw = b"".join(response.streaming_content) if response.streaming else response.content
    return raw.decode(errors="replace")


def header_problems(response, where: str, *, https: bool = True) -> list[str]:
    """Everything wrong with one answer's security headers (and its cookies), as sentences."""
    problems = []
    if response.get("X-Content-Type-Options", "").lower() != "nosniff":
        problems.append("no X-Content-Type-Options: nosniff")
    if response.get("Referrer-Policy", "").lower() not in SAFE_REFERRER:
        problems.append(f"Referrer-Policy {response.get('Referrer-Policy')!r}")
    if https:
        hsts = response.get("Strict-Transport-Security", "")
        age = re.search(r"max-age=(\d+)", hsts)
        if not age or int(age.group(1)) < YEAR or "includesubdomains" not in hsts.lower():
            problems.append(f"Strict-Transport-Security {hsts!r}")
    if response.get("Content-Type", "").startswith("text/html"):
        csp = response.get("Content-Security-Policy")
        if not csp:
            problems.append("an HTML answer without Content-Security-Policy")
        else:
            directives = csp_directives(csp)
            scripts = directives.get("script-src", directives.get("default-src"))
            if scripts is None:
                problems.append("CSP without script-src or default-src")
            elif bad := sorted(set(scripts) & UNSAFE_SCRIPT_SOURCES):
                problems.append(f"CSP script-src allows {bad}")
            if directives.get("frame-ancestors") not in (["'none'"], ["'self'"]):
                problems.append(f"CSP frame-ancestors {directives.get('frame-ancestors')}")
            if directives.get("object-src") != ["'none'"]:
                problems.append(f"CSP object-src {directives.get('object-src')}")
            if "base-uri" not in directives:
                problems.append("CSP without base-uri")
        if response.get("X-Frame-Options", "").upper() not in ("DENY", "SAMEORIGIN"):
            problems.append(f"X-Frame-Options {response.get('X-Frame-Options')!r}")
        if not response.streaming:
            parser = _InlineScript()
            parser.feed(body_of(response))
            problems += [f"the page has {what}, which the CSP blocks" for what in parser.found[:3]]
    for name, morsel in response.cookies.items():
        if not morsel.value:
            continue  # a deletion
        if name in (django_settings.SESSION_COOKIE_NAME, django_settings.CSRF_COOKIE_NAME):
            if https and not morsel["secure"]:
                problems.append(f"cookie {name} without Secure")
            if str(morsel["samesite"]).lower() != "lax":
                problems.append(f"cookie {name} SameSite={morsel['samesite']!r}")
        if name == django_settings.SESSION_COOKIE_NAME and not morsel["httponly"]:
            problems.append(f"cookie {name} without HttpOnly")
    return [f"{where} ({response.status_code}): {p}" for p in problems]


def _role_for(name: str, method: str, statuses: tuple[str, ...]) -> str | None:
    for role in ROLE_ORDER:
        if matrix.expected(name, method, role) in statuses:
            return role
    return None


def _api_url(name: str, pattern, objects: dict) -> str:
    kwargs = {}
    for kwarg in pattern.pattern.regex.groupindex:
        if kwarg in API_LITERALS:
            kwargs[kwarg] = API_LITERALS[kwarg]
        else:
            assert kwarg in API_KWARGS, f"{name}: teach the header crawl which object fills <{kwarg}> (API_KWARGS)"
            kwargs[kwarg] = objects[API_KWARGS[kwarg]].pk
    return reverse(name, kwargs=kwargs)


def test_every_page_carries_the_security_headers(world, production):  # noqa: F811 (the imported fixture)
    clients: dict[str, Client] = {}

    def as_role(role: str) -> Client:
        if role not in clients:
            clients[role] = client_for(world.users[role])
        return clients[role]

    problems: list[str] = []
    seen: Counter = Counter()

    def check(response, where: str) -> None:
        problems.extend(header_problems(response, where))
        kind = "html" if response.get("Content-Type", "").startswith("text/html") else "other"
        seen[f"{kind} {response.status_code}"] += 1

    for name, pattern in url_patterns():
        if name in matrix.urls():
            spec = matrix.urls()[name]
            url = url_for(name, world.own)
            role = _role_for(name, "get", ("200",)) or _role_for(name, "get", ("302", "400", "403", "404", "405"))
            role = role or "platform_admin"
            for headers in ({}, {"HTTP_HX_REQUEST": "true"}):
                what = "htmx GET" if headers else "GET"
                check(request(as_role(role), "get", url, secure=True, **headers), f"{what} {url} ({name}) as {role}")
            post_role = _role_for(name, "post", ("200", "302", "400"))
            if "post" in spec and post_role:
                check(request(as_role(post_role), "post", url, fill(spec.get("data"), world.own), secure=True),
                      f"POST {url} ({name}) as {post_role}")
        else:
            assert matrix.covered_by(name), f"{name} is in neither the page matrix nor covered_elsewhere"
            url = _api_url(name, pattern, world.own)
            # the API with a session (the docs page is HTML); the gateway as anyone without a key
            role = "anonymous" if name.startswith("gateway_") else "platform_admin"
            check(request(as_role(role), "get", url, secure=True), f"GET {url} ({name}) as {role}")
    assert not problems, f"{len(problems)} answers lack a security header:\n" + "\n".join(problems[:60])
    # the crawl saw real pages, not only redirects to sign-in
    assert seen["html 200"] >= 50, f"too few HTML pages answered 200: {dict(seen)}"
    assert seen["other 200"] >= 10 and seen["other 401"] >= 1, f"the API and gateway were not reached: {dict(seen)}"


def _boom(request):
    raise RuntimeError("a bug in a view")


def _ok(request):
    return HttpResponse("<!doctype html><title>t</title><p>ok</p>")


# the project's URLs plus one view that fails, so the 500 page goes through the whole stack
urlpatterns = [path("__boom/", _boom), path("__ok/", _ok), path("", include("portal.urls"))]
handler403 = "portal.views.error_403"
handler404 = "portal.views.error_404"
handler500 = "portal.views.error_500"


def test_error_pages_carry_the_security_headers(world, production):  # noqa: F811 (the imported fixture)
    from serving import gateway
    from serving import services as serving

    _, secret = serving.create_api_key(world.org.people["alpha"]["user"], project=world.org.projects["alpha"],
                                       name="headers", services=[world.own["model_service"]])
    admin = client_for(world.users["platform_admin"])
    anonymous = Client()
    post_only = next(name for name, spec in matrix.urls().items() if spec.get("post_only"))
    forbidden = next((name, role) for name in matrix.urls() for role in ROLE_ORDER
                     if matrix.expected(name, "get", role) == "403")
    cases = [
        (404, "GET", anonymous, "/no-such-page/", {}),
        (404, "GET", admin, "/no-such-page/", {}),
        (403, "GET", client_for(world.users[forbidden[1]]), url_for(forbidden[0], world.own), {}),
        (405, "GET", admin, url_for(post_only, world.own), {}),
        # the CSRF refusal page
        (403, "POST", client_for(world.users["platform_admin"], enforce_csrf_checks=True),
         url_for(post_only, world.own), {}),
        # a form body over DATA_UPLOAD_MAX_MEMORY_SIZE is refused before any view runs
        (400, "POST", anonymous, reverse("login"),
         {"data": "a=" + "x" * (django_settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1),
          "content_type": "application/x-www-form-urlencoded"}),
        # the gateway refuses a body over its limit, in its own JSON shape
        (413, "POST", anonymous, "/v1/chat/completions",
         {"data": b"{" + b" " * getattr(gateway, "MAX_BODY", 1024 * 1024) + b"}", "content_type": "application/json",
          "headers": {"HTTP_AUTHORIZATION": f"Bearer {secret}"}}),
    ]
    problems = []
    for status, method, client, url, extra in cases:
        if method == "GET":
            response = client.get(url, secure=True)
        else:
            response = client.post(url, extra.get("data", {}), content_type=extra.get("content_type",
                                   "multipart/form-data; boundary=BoUnDaRyStRiNg"), secure=True,
                                   **extra.get("headers", {}))
        where = f"{method} {url}"
        if response.status_code != status:
            problems.append(f"{where}: answered {response.status_code}, expected {status}")
        problems += header_problems(response, where)
        if status in (403, 404) and not response.get("Content-Type", "").startswith("text/html"):
            problems.append(f"{where}: the {status} page is not HTML")
    assert not problems, "\n".join(problems)


def test_the_500_page_carries_the_security_headers(production):
    production.ROOT_URLCONF = __name__
    client = Client(raise_request_exception=False)
    response = client.get("/__boom/", secure=True)
    assert response.status_code == 500
    assert response["Content-Type"].startswith("text/html")
    assert not header_problems(response, "GET /__boom/")
    # and a page that sets nothing itself gets every header from the middleware alone
    response = client.get("/__ok/", secure=True)
    assert response.status_code == 200
    assert not header_problems(response, "GET /__ok/")


def test_header_check_refuses_a_weak_policy():
    """The checks above can fail: a page with inline script allowed, no frame-ancestors, an
    inline handler and a cookie without its flags is reported on each count."""
    response = HttpResponse('<p onclick="x()">hi</p><script>alert(1)</script>', content_type="text/html")
    response["Content-Security-Policy"] = "default-src 'self'; script-src 'self' 'unsafe-inline'"
    response.set_cookie(django_settings.SESSION_COOKIE_NAME, "abc", samesite="None")
    found = "\n".join(header_problems(response, "GET /weak/"))
    for expected in ("nosniff", "Referrer-Policy", "Strict-Transport-Security", "script-src allows",
                     "frame-ancestors", "object-src", "X-Frame-Options", "onclick", "inline <script>",
                     "without Secure", "SameSite", "without HttpOnly"):
        assert expected in found, f"{expected!r} not reported in:\n{found}"


def test_session_and_csrf_cookies_are_secure_httponly_and_samesite_lax(production, make_user):
    make_user("cookie-person")
    client = Client(enforce_csrf_checks=True)
    page = client.get(reverse("login"), secure=True)
    assert page.status_code == 200
    csrf = page.cookies[django_settings.CSRF_COOKIE_NAME]
    assert csrf["secure"] and csrf["samesite"] == "Lax"
    # over HTTPS Django's CSRF check also wants the browser's same-origin Referer
    response = client.post(reverse("login"), {"username": "cookie-person", "password": PASSWORD,
                                              "csrfmiddlewaretoken": csrf.value}, secure=True,
                           HTTP_REFERER="https://testserver/login/")
    assert response.status_code == 302, "the sign-in did not succeed"
    session = response.cookies[django_settings.SESSION_COOKIE_NAME]
    assert session.value and session["secure"] and session["httponly"] and session["samesite"] == "Lax"
    assert not header_problems(response, "POST /login")
    # plain HTTP is sent to HTTPS before anything else is served
    response = Client().get(reverse("login"))
    assert response.status_code == 301 and response["Location"].startswith("https://")


def test_production_settings_turn_on_hsts_ssl_redirect_and_secure_cookies():
    """What the tests above override is what DEBUG=0 gives without any SECURE_* variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SECURE_", "SESSION_COOKIE_", "CSRF_COOKIE_"))}
    env.update(DEBUG="0", ATRIUM_TESTING="0", SECRET_KEY="x" * 50, DJANGO_SETTINGS_MODULE="portal.settings")
    code = ("from django.conf import settings as s; print(s.SECURE_HSTS_SECONDS, s.SECURE_HSTS_INCLUDE_SUBDOMAINS, "
            "s.SECURE_SSL_REDIRECT, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SESSION_COOKIE_HTTPONLY, "
            "s.SESSION_COOKIE_SAMESITE, s.CSRF_COOKIE_SAMESITE, s.SECURE_CONTENT_TYPE_NOSNIFF, s.SECURE_REFERRER_POLICY)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    hsts, subdomains, redirect, session, csrf, httponly, samesite, csrf_samesite, nosniff, referrer = out.stdout.split()
    assert int(hsts) >= YEAR and subdomains == "True" and redirect == "True"
    assert session == csrf == httponly == nosniff == "True"
    assert samesite == csrf_samesite == "Lax" and referrer in SAFE_REFERRER

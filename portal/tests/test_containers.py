"""The container files refer only to things that exist: docker/compose.yaml, docker/Dockerfile and
the Keycloak realm export are checked against the code, because no Docker engine runs here.

Every command must be a real management command (or the real WSGI app) that accepts its
arguments, every dependency a defined service that can reach the condition asked of it, every
variable one that Atrium reads, every mount a file in the repository, and the realm must give
the portal what it asks for (PKCE S256, the scopes it requests, a groups claim of real roles).
These tests read files and import code; they must never need Docker, the network or a database.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from django.conf import settings
from django.core.management import CommandError, get_commands, load_command_class
from django.test import override_settings
from django.urls import Resolver404, URLResolver, resolve
from django.urls.resolvers import RegexPattern

from portal import views
from tenants.roles import ROLES

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
REALM = DOCKER / "keycloak" / "atrium-realm.json"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
DEPLOY_DOC = ROOT / "docs" / "deployment.md"
SETTINGS = ROOT / "portal" / "settings.py"
SEED_DEMO = ROOT / "portal" / "management" / "commands" / "seed_demo.py"

REQUIRED_SERVICES = {"web", "worker", "scheduler", "postgres", "redis", "keycloak"}
# Variables an Atrium container may set that other programs read, not Atrium's settings.
NOT_ATRIUM_SETTINGS = {
    "WEB_CONCURRENCY": "gunicorn's worker count",
    "FORWARDED_ALLOW_IPS": "gunicorn's trusted proxies",
    "GUNICORN_CMD_ARGS": "extra gunicorn flags",
}
DEPENDS_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


# --- reading the files ---------------------------------------------------------------------

def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def services() -> dict[str, dict]:
    return compose()["services"]


def atrium_services() -> dict[str, dict]:
    """Services that run Atrium's own image (built from docker/Dockerfile)."""
    found = {}
    for name, svc in services().items():
        build = svc.get("build")
        if isinstance(build, dict) and (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE:
            found[name] = svc
    return found


_VAR = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR:?message}` as compose would fill them on a machine that
    sets only the required variables; a bare `${VAR}` (empty, with only a warning) is a mistake."""

    def fill(m: re.Match) -> str:
        op = m.group("op")
        assert op, f"${{{m.group('name')}}} in compose.yaml has neither a default nor a required marker"
        return m.group("arg") if op.endswith("-") else f"operator-sets-{m.group('name').lower()}"

    return _VAR.sub(fill, str(value))


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(v) for k, v in env.items()}


def command(svc: dict) -> list[str]:
    cmd = svc.get("command")
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd or [])


def container_ports(svc: dict) -> set[int]:
    ports = set()
    for spec in svc.get("ports", []):
        target = spec["target"] if isinstance(spec, dict) else str(spec).split(":")[-1].split("/")[0]
        ports.add(int(target))
    return ports


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, args = current.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        current = ""
    return instructions


def instructions(keyword: str) -> list[str]:
    return [args for kw, args in dockerfile() if kw == keyword]


def exec_form(args: str) -> list[str]:
    assert args.startswith("["), f"use the exec form (JSON list) so signals reach the process: {args}"
    return json.loads(args)


def realm() -> dict:
    return json.loads(REALM.read_text())


def realm_client(client_id: str = "atrium") -> dict:
    clients = [c for c in realm()["clients"] if c["clientId"] == client_id]
    assert len(clients) == 1, f"realm export has {len(clients)} clients named {client_id!r}"
    return clients[0]


def settings_env_names() -> set[str]:
    """The environment variables portal/settings.py reads (env.str("X"), env.bool("X"), ...)."""
    return set(re.findall(r'env(?:\.\w+)?\(\s*"([A-Z][A-Z0-9_]*)"', SETTINGS.read_text()))


def view_at(path: str, resolver=None):
    """The view a path reaches, or None (a 404) instead of an exception."""
    try:
        match = resolver.resolve(path) if resolver else resolve(path)
    except Resolver404:
        return None
    return match


def url_in(text: str) -> str:
    found = re.findall(r"https?://[^'\"\s]+", text)
    assert len(found) == 1, f"expected one URL in {text!r}"
    return found[0]


# --- compose: services and commands --------------------------------------------------------

def test_compose_defines_every_service_atrium_needs():
    assert set(services()) >= REQUIRED_SERVICES, REQUIRED_SERVICES - set(services())
    assert {"web", "worker", "scheduler"} <= set(atrium_services())


def test_every_manage_py_command_exists_and_accepts_its_arguments():
    commands = get_commands()
    checked = 0
    for name, svc in atrium_services().items():
        cmd = command(svc)
        if cmd[:2] != ["python", "manage.py"]:
            continue
        sub, args = cmd[2], cmd[3:]
        assert sub in commands, f"{name}: 'manage.py {sub}' is not a management command"
        parser = load_command_class(commands[sub], sub).create_parser("manage.py", sub)
        try:
            parser.parse_args(args)
        except (SystemExit, CommandError):
            pytest.fail(f"{name}: 'manage.py {sub}' rejects the arguments {args}")
        checked += 1
    assert checked >= 3, "migrate, worker and scheduler should all run manage.py commands"


def test_worker_consumes_every_configured_queue_and_only_those():
    worker = command(services()["worker"])
    assert worker[:3] == ["python", "manage.py", "rqworker"]
    queues = [a for a in worker[3:] if not a.startswith("-")]
    # A queue nobody consumes keeps its jobs forever (cycles, accrual and reports would stop).
    assert set(queues) == set(settings.RQ_QUEUES), f"worker listens on {queues}, settings define {set(settings.RQ_QUEUES)}"


def test_scheduler_runs_the_one_periodic_loop():
    assert command(services()["scheduler"]) == ["python", "manage.py", "run_scheduler"]
    assert services()["scheduler"].get("deploy", {}).get("replicas", 1) == 1


def test_web_runs_gunicorn_on_the_real_wsgi_application_and_the_published_port():
    from gunicorn.config import Config

    web = services()["web"]
    cmd = command(web)
    assert cmd[0] == "gunicorn"
    parsed = Config().parser().parse_args(cmd[1:])
    (app_path,) = parsed.args
    module_name, _, attr = app_path.partition(":")
    assert importlib.util.find_spec(module_name) is not None, f"gunicorn would not find the module {module_name}"
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attr, None)), f"{app_path} is not a callable WSGI application"
    assert app_path == settings.WSGI_APPLICATION.replace(".application", ":application")
    (bind,) = parsed.bind
    host, _, port = bind.rpartition(":")
    assert host == "0.0.0.0", "inside a container gunicorn must listen on all interfaces"
    assert int(port) in container_ports(web), f"gunicorn binds {port}, compose publishes {container_ports(web)}"


def test_depends_on_names_defined_services_that_can_meet_the_condition():
    svcs = services()
    for name, svc in svcs.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, spec in deps.items():
            assert dep in svcs, f"{name} depends on {dep!r}, which is not a service"
            condition = spec.get("condition", "service_started")
            assert condition in DEPENDS_CONDITIONS, f"{name} -> {dep}: unknown condition {condition!r}"
            if condition == "service_healthy":
                check = svcs[dep].get("healthcheck")
                image_has_one = dep in atrium_services() and instructions("HEALTHCHECK")
                assert (check and not check.get("disable")) or (not check and image_has_one), (
                    f"{name} waits for {dep} to be healthy, but {dep} has no health check"
                )
            if condition == "service_completed_successfully":
                assert svcs[dep].get("restart", "no") == "no", f"{dep} is one-shot; a restart policy would rerun it"


def test_long_running_atrium_processes_start_after_migrations():
    for name in ("web", "worker", "scheduler"):
        deps = services()[name]["depends_on"]
        migrating = [d for d, spec in deps.items() if spec.get("condition") == "service_completed_successfully"
                     and command(services()[d])[:3] == ["python", "manage.py", "migrate"]]
        assert migrating, f"{name} may start before the database schema exists"


# --- compose: environment ------------------------------------------------------------------

def test_atrium_services_set_only_variables_atrium_reads_and_documents():
    read = settings_env_names()
    documented = CONFIG_DOC.read_text() if CONFIG_DOC.exists() else None
    for name, svc in atrium_services().items():
        for var in environment(svc):
            if var in NOT_ATRIUM_SETTINGS:
                continue
            assert var in read, f"{name} sets {var}, which portal/settings.py never reads (a typo?)"
            if documented is not None:
                assert re.search(rf"\b{var}\b", documented), f"{name} sets {var}, which docs/configuration.md does not document"


def test_secret_key_must_come_from_the_operator():
    raw = compose()
    for name in atrium_services():
        value = raw["services"][name]["environment"]["SECRET_KEY"]
        assert re.fullmatch(r"\$\{SECRET_KEY:\?[^}]+\}", value), f"{name}: SECRET_KEY must be required, got {value!r}"


def test_service_urls_point_at_the_services_that_serve_them():
    svcs = services()
    pg_env = environment(svcs["postgres"])
    from portal.settings import _database

    for name, svc in atrium_services().items():
        env = environment(svc)
        db = urlsplit(env["DATABASE_URL"])
        assert db.hostname in svcs, f"{name}: DATABASE_URL host {db.hostname!r} is not a service"
        assert (db.username, db.password, db.path.lstrip("/")) == (
            pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], pg_env["POSTGRES_DB"]
        ), f"{name}: DATABASE_URL does not match the postgres service's user, password and database"
        assert _database(env["DATABASE_URL"])["ENGINE"] == "django.db.backends.postgresql"
        redis = urlsplit(env["REDIS_URL"])
        assert redis.scheme == "redis" and redis.hostname == "redis" and "redis" in svcs
        discovery = urlsplit(env["OIDC_OP_DISCOVERY_URL"])
        assert discovery.hostname in svcs, f"{name}: OIDC discovery host {discovery.hostname!r} is not a service"
        assert discovery.path == f"/realms/{realm()['realm']}/.well-known/openid-configuration"
        assert env["OIDC_RP_CLIENT_ID"] == realm_client(env["OIDC_RP_CLIENT_ID"])["clientId"]
        assert env["OIDC_RP_CLIENT_SECRET"] == realm_client(env["OIDC_RP_CLIENT_ID"])["secret"], (
            "the default client secret differs from the one the realm export gives the client"
        )
        assert env["ATRIUM_CLUSTER_BACKEND"] == "simulated"


def test_issuer_is_where_keycloak_says_it_is():
    kc_env = environment(services()["keycloak"])
    for name, svc in atrium_services().items():
        issuer = urlsplit(environment(svc)["OIDC_OP_ISSUER"])
        assert f"{issuer.scheme}://{issuer.netloc}" == kc_env["KC_HOSTNAME"], (
            f"{name}: tokens carry the issuer Keycloak's KC_HOSTNAME makes, not {issuer.geturl()}"
        )
        assert issuer.path == f"/realms/{realm()['realm']}"
        assert issuer.port in container_ports(services()["keycloak"])


def test_local_compose_serves_plain_http_consistently():
    for name in atrium_services():
        env = environment(services()[name])
        assert env["SECURE_SSL_REDIRECT"] == "0", f"{name}: nothing serves https://localhost in compose"
        for origin in env["CSRF_TRUSTED_ORIGINS"].split(","):
            parts = urlsplit(origin)
            assert parts.scheme == "http" and parts.hostname in env["ALLOWED_HOSTS"].split(","), origin


# --- compose: mounts and health checks -----------------------------------------------------

def test_every_mounted_file_exists_and_named_volumes_are_declared():
    declared = set((compose().get("volumes") or {}).keys())
    mounts = 0
    for name, svc in services().items():
        for vol in svc.get("volumes", []):
            source = vol["source"] if isinstance(vol, dict) else str(vol).split(":")[0]
            if source.startswith((".", "/")):
                assert (COMPOSE.parent / source).exists(), f"{name} mounts {source}, which is not in the repository"
            else:
                assert source in declared, f"{name} uses volume {source!r}, not declared under volumes:"
            mounts += 1
    assert mounts >= 2


def test_keycloak_imports_the_realm_export():
    kc = services()["keycloak"]
    assert kc["image"].startswith("quay.io/keycloak/keycloak:")
    assert command(kc)[:1] == ["start-dev"] and "--import-realm" in command(kc)
    targets = [str(v).split(":")[1] for v in kc["volumes"]]
    assert any(t.startswith("/opt/keycloak/data/import/") and t.endswith(".json") for t in targets)


def test_health_checks_probe_what_they_claim():
    svcs = services()
    assert command({"command": svcs["postgres"]["healthcheck"]["test"]})[1] == "pg_isready"
    assert svcs["redis"]["healthcheck"]["test"][1:] == ["redis-cli", "ping"]
    web = svcs["web"]
    url = urlsplit(url_in(" ".join(web["healthcheck"]["test"])))
    assert getattr(view_at(url.path), "func", None) is views.readyz, "web's health check must ask /readyz (database and Redis)"
    assert url.port in container_ports(web)
    assert url.hostname in environment(web)["ALLOWED_HOSTS"].split(","), "the probe's Host would be refused (400)"


def test_atrium_processes_without_gunicorn_do_not_inherit_the_http_health_check():
    # The image's HEALTHCHECK asks gunicorn on :8000; a worker would be reported unhealthy forever.
    for name, svc in atrium_services().items():
        if command(svc)[:1] == ["gunicorn"]:
            continue
        assert (svc.get("healthcheck") or {}).get("disable") is True, f"{name} must disable the image's HTTP health check"


# --- Dockerfile ----------------------------------------------------------------------------

def test_dockerfile_builds_on_the_python_the_tests_run_on():
    (base,) = instructions("FROM")
    assert base == "python:3.11-slim-bookworm"
    assert base.split(":")[1].startswith(f"{sys.version_info.major}.{sys.version_info.minor}-")


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        bare = pat.removeprefix("**/")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(Path(p).name, bare) for p in prefixes):
            return True
    return False


def test_copy_sources_exist_are_not_ignored_and_cover_the_installed_apps():
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    copied = set()
    for args in instructions("COPY"):
        *sources, _dest = [a for a in args.split() if not a.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not _ignored(src.rstrip("/"), patterns), f"COPY {src}: excluded by .dockerignore"
            copied.add(src.rstrip("/"))
    local_apps = {app.split(".")[0] for app in settings.INSTALLED_APPS if (ROOT / app.split(".")[0]).is_dir()}
    needed = local_apps | {"manage.py", "requirements.txt", "templates", "static"}
    assert needed <= copied, f"the image would lack {needed - copied}"


def test_dockerfile_env_sets_only_atrium_settings_or_tool_variables():
    tools = {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", *NOT_ATRIUM_SETTINGS}
    read = settings_env_names()
    names = [pair.split("=", 1)[0] for args in instructions("ENV") for pair in shlex.split(args)]
    assert names
    for name in names:
        assert name in read or name in tools or name.startswith("PIP_"), f"Dockerfile sets {name}, which nothing reads"


def test_requirements_are_installed_before_the_code_is_copied():
    steps = dockerfile()
    install = next(i for i, (kw, args) in enumerate(steps) if kw == "RUN" and "pip install -r requirements.txt" in args)
    first_code = next(i for i, (kw, args) in enumerate(steps) if kw == "COPY" and "portal" in args)
    assert install < first_code


def test_static_files_are_collected_with_a_build_only_key_and_manifest_storage():
    runs = [args for args in instructions("RUN") if "collectstatic" in args]
    assert len(runs) == 1 and "--no-input" in runs[0]
    assert re.search(r"\bSECRET_KEY=\S+", runs[0]) and re.search(r"\bDEBUG=0\b", runs[0])
    env_lines = " ".join(instructions("ENV") + instructions("ARG"))
    # A key in ENV would ship in every container; ATRIUM_TESTING would switch off manifest storage.
    assert "SECRET_KEY" not in env_lines and "ATRIUM_TESTING" not in env_lines and "ATRIUM_TESTING" not in runs[0]


def test_image_runs_as_a_non_root_user():
    steps = dockerfile()
    users = [(i, args) for i, (kw, args) in enumerate(steps) if kw == "USER"]
    assert users, "no USER: the container would run as root"
    last_index, last_user = users[-1]
    assert last_user.split(":")[0] not in {"root", "0"}
    cmd_index = max(i for i, (kw, _) in enumerate(steps) if kw == "CMD")
    assert last_index < cmd_index
    assert any("useradd" in args and last_user.split(":")[0] in args for args in instructions("RUN"))


def test_dockerfile_command_port_and_health_check_match_compose():
    web = services()["web"]
    (expose,) = instructions("EXPOSE")
    assert {int(expose.split("/")[0])} == container_ports(web)
    (cmd,) = instructions("CMD")
    assert exec_form(cmd) == command(web), "docker run and docker compose would start different servers"
    (health,) = instructions("HEALTHCHECK")
    assert "curl" not in health and "wget" not in health, "the slim image has neither"
    url = urlsplit(url_in(health))
    assert getattr(view_at(url.path), "func", None) is views.healthz, f"the image's HEALTHCHECK asks {url.path}, not /healthz"
    assert url.port == int(expose.split("/")[0])


# --- the Keycloak realm --------------------------------------------------------------------

def test_realm_client_is_confidential_with_code_flow_and_pkce_s256():
    client = realm_client()
    assert realm()["realm"] == "atrium" and realm()["enabled"] is True
    assert client["publicClient"] is False and client["secret"]
    assert client["standardFlowEnabled"] is True
    assert client.get("implicitFlowEnabled") is False and client.get("directAccessGrantsEnabled") is False
    assert client.get("attributes", {}).get("pkce.code.challenge.method") == settings.OIDC_PKCE_CODE_CHALLENGE_METHOD == "S256"


def _portal_urls_with_oidc() -> URLResolver:
    """portal/urls.py as it is built when OIDC is on (the test settings leave it off)."""
    spec = importlib.util.spec_from_file_location("_atrium_urls_with_oidc", ROOT / "portal" / "urls.py")
    module = importlib.util.module_from_spec(spec)
    with override_settings(OIDC_ENABLED=True):
        spec.loader.exec_module(module)
    return URLResolver(RegexPattern(r"^/"), module)


def test_realm_redirect_uris_are_the_portals_oidc_callback():
    resolver = _portal_urls_with_oidc()
    web_env = environment(services()["web"])
    for uri in realm_client()["redirectUris"]:
        parts = urlsplit(uri)
        assert "*" not in uri, "wildcard redirect URIs let a crafted link steal codes"
        match = view_at(parts.path, resolver)
        assert match is not None and match.url_name == "oidc_authentication_callback", f"{uri} is not the callback"
        assert parts.hostname in web_env["ALLOWED_HOSTS"].split(",")
        assert parts.port in container_ports(services()["web"])


def test_every_scope_the_portal_requests_is_granted_to_the_client():
    scopes = {s["name"]: s for s in realm()["clientScopes"]}
    client = realm_client()
    assigned = set(client["defaultClientScopes"]) | set(client.get("optionalClientScopes", []))
    # Keycloak answers invalid_scope when the request names a scope the client does not have.
    for requested in settings.OIDC_RP_SCOPES.split():
        if requested == "openid":
            continue
        assert requested in scopes and requested in assigned, f"scope {requested!r} is not granted to the client"
    # Declaring clientScopes stops Keycloak from creating its built-in ones, `basic` (the sub claim) too.
    mappers = [m["protocolMapper"] for name in client["defaultClientScopes"] for m in scopes[name].get("protocolMappers", [])]
    assert "oidc-sub-mapper" in mappers


def test_groups_claim_carries_plain_group_names():
    scopes = {s["name"]: s for s in realm()["clientScopes"]}
    group_mappers = [
        m for name in realm_client()["defaultClientScopes"] for m in scopes[name].get("protocolMappers", [])
        if m["protocolMapper"] == "oidc-group-membership-mapper"
    ]
    assert len(group_mappers) == 1, "the client needs exactly one groups mapper among its default scopes"
    config = group_mappers[0]["config"]
    assert config["claim.name"] == settings.OIDC_GROUPS_CLAIM
    assert config["full.path"] == "false", "with full paths the claim would read '/atrium:...'"
    assert config["id.token.claim"] == "true" and config["userinfo.token.claim"] == "true"


_GROUP = re.compile(r"(?P<tenant>[a-z0-9-]+)(?:/(?P<project>[a-z0-9-]+))?:(?P<role>[a-z_]+)")


def test_realm_groups_name_real_roles_of_the_demo_organisation():
    prefix = settings.OIDC_GROUP_PREFIX
    seed = SEED_DEMO.read_text()
    groups = realm()["groups"]
    assert any(g["name"] == f"{prefix}platform:platform_admin" for g in groups)
    for group in groups:
        assert group["name"].startswith(prefix), group["name"]
        m = _GROUP.fullmatch(group["name"].removeprefix(prefix))
        assert m, f"{group['name']} is not {prefix}<tenant>[/<project>]:<role>"
        role = ROLES.get(m["role"])
        assert role is not None, f"{group['name']}: no role {m['role']!r}"
        expected = "platform" if m["tenant"] == "platform" else ("project" if m["project"] else "tenant")
        assert role.scope == expected, f"{group['name']}: {m['role']} is a {role.scope} role"
        for slug in filter(None, [m["tenant"] if expected != "platform" else None, m["project"]]):
            assert f'"{slug}"' in seed, f"{group['name']}: {slug!r} is not in the demo organisation"


def _keycloak_resolves(path: str, top_level: set[str]) -> str | None:
    """Keycloak's group lookup by path (KeycloakModelUtils.getGroupModel): segments are joined
    with '/' until a top-level group has that name, so 'a/b:c' finds a group named so."""
    segments, name = path.lstrip("/").split("/"), ""
    for i, segment in enumerate(segments):
        name = f"{name}/{segment}" if name else segment
        if name in top_level:
            return name if i == len(segments) - 1 else None  # the rest would be a subgroup; we have none
    return None


def test_demo_users_sign_in_without_prompts_and_land_in_defined_groups():
    top_level = {g["name"] for g in realm()["groups"]}
    users = realm()["users"]
    assert len(users) >= 2
    for user in users:
        assert user["enabled"] is True
        # Keycloak's user profile asks for any of these that is missing at the first login.
        assert all(user.get(k) for k in ("email", "firstName", "lastName")), f"{user['username']} would be asked to fill a form"
        (cred,) = user["credentials"]
        assert cred["type"] == "password" and cred["value"] and cred["temporary"] is False
        assert user["groups"], f"{user['username']} has no role"
        for path in user["groups"]:
            assert _keycloak_resolves(path, top_level) == path.lstrip("/"), f"{user['username']}: no group {path}"


# --- the deployment guide ------------------------------------------------------------------

def test_deployment_guide_covers_the_compose_file():
    text = DEPLOY_DOC.read_text()
    for needle in [*REQUIRED_SERVICES, "docker compose -f docker/compose.yaml", "SECRET_KEY", "seed_demo",
                   "ATRIUM_TRUSTED_PROXIES", "issue 8"]:
        assert needle in text, f"docs/deployment.md does not mention {needle}"

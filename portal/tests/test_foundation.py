"""The foundation holds: configuration errors are one sentence, production settings pass
`check --deploy`, the health probes tell the truth, the pages carry a strict CSP."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import override_settings

ROOT = Path(__file__).resolve().parents[2]

PROD_ENV = {
    "DEBUG": "0",
    "SECRET_KEY": "a-production-like-secret-key-with-enough-entropy-0f9e8d7c6b5a4f3e2d1c",
    "ALLOWED_HOSTS": "atrium.example.org",
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/atrium",
}


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in {
        "DEBUG", "SECRET_KEY", "DATABASE_URL", "SECURE_SSL_REDIRECT", "SESSION_COOKIE_SECURE",
        "CSRF_COOKIE_SECURE", "SECURE_HSTS_SECONDS", "ATRIUM_TESTING", "DJANGO_SETTINGS_MODULE",
        # set by the browser tests in this process (Playwright's loop); never in deployment
        "DJANGO_ALLOW_ASYNC_UNSAFE"}}
    return subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env={**base, **env},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_check_deploy_with_production_settings_reports_nothing():
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=PROD_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


@pytest.mark.parametrize(
    ("env", "sentence"),
    [
        ({"DEBUG": "0", "SECRET_KEY": ""}, "SECRET_KEY is not set"),
        ({**PROD_ENV, "DATABASE_URL": "not a url at all"}, "DATABASE_URL"),
        ({**PROD_ENV, "DATABASE_URL": "mysqlx://nobody@nowhere/db"}, "DATABASE_URL"),
        ({**PROD_ENV, "ATRIUM_CLUSTER_BACKEND": "slurm"}, "ATRIUM_CLUSTER_BACKEND"),
    ],
)
def test_bad_configuration_stops_with_one_sentence(env, sentence):
    result = manage("check", env=env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Atrium cannot start:") and sentence in lines[0]


def test_healthz_answers_without_a_session(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_is_ready_with_database_and_redis(client):
    response = client.get("/readyz")
    assert response.status_code == 200, response.content
    assert response.json()["status"] == "ok"


@pytest.mark.django_db
def test_readyz_names_redis_when_it_is_unreachable(client, settings):
    dead = {name: {**cfg, "URL": "redis://127.0.0.1:1/0"} for name, cfg in settings.RQ_QUEUES.items()}
    with override_settings(RQ_QUEUES=dead):
        response = client.get("/readyz")
    assert response.status_code == 503
    assert set(response.json()["failing"]) == {"redis"}


@pytest.mark.django_db
def test_pages_carry_a_csp_without_inline_script(client, org):
    from conftest import PASSWORD

    assert client.login(username="alpha-user", password=PASSWORD)
    response = client.get("/")
    csp = response["Content-Security-Policy"]
    script_src = re.search(r"script-src ([^;]*)", csp).group(1)
    assert "'unsafe-inline'" not in script_src and "'unsafe-eval'" not in script_src
    html = response.content.decode()
    # every <script> has a src: nothing inline for the CSP to block
    assert all("src=" in tag for tag in re.findall(r"<script[^>]*>", html)), html
    assert "/static/vendor/htmx" in html


def test_no_template_contains_inline_script_or_cdn():
    for path in (ROOT / "templates").rglob("*.html"):
        text = path.read_text()
        for tag in re.findall(r"<script[^>]*>", text):
            assert "src=" in tag or "json_script" in text, f"inline script in {path}"
        assert "cdn." not in text and "unpkg.com" not in text and "jsdelivr" not in text, path


@pytest.mark.django_db
def test_probes_answer_for_hosts_outside_allowed_hosts(client, settings):
    settings.ALLOWED_HOSTS = ["atrium.example.org"]
    assert client.get("/healthz", HTTP_HOST="10.1.2.3:8000").status_code == 200
    assert client.get("/readyz", HTTP_HOST="127.0.0.1").status_code == 200
    # everything else still refuses an unknown host
    assert client.get("/login/", HTTP_HOST="10.1.2.3:8000").status_code == 400

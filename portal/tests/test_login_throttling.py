"""Local-account sign-in throttling (django-axes via portal.lockout), through the real login view.

Failures count per (user name, client address); at ATRIUM_LOGIN_FAILURE_LIMIT the pair is
refused for ATRIUM_LOGIN_LOCKOUT_MINUTES from the failure that locked it. The lockout is one
audit event, the person sees the sign-in page with a sentence and a Retry-After, other
addresses, API tokens and SSO are unaffected, and the counters do not pile up.
"""

from __future__ import annotations

import datetime as dt
import io

import pytest
import requests
import time_machine
from axes.models import AccessAttempt, AccessLog
from django.conf import settings as django_settings
from django.contrib.auth import SESSION_KEY, authenticate
from django.core.management import call_command
from django.test import Client, RequestFactory
from django.urls import reverse
from django.utils import timezone

from api import tokens
from conftest import PASSWORD
from portal.audit import verify_chain
from portal.models import AuditEvent, AuditOutcome
from portal.tests import test_oidc as oidc_e2e
from portal.tests.test_oidc import _tamper, session_user, sso_login

ATTACKER = "203.0.113.9"
ELSEWHERE = "198.51.100.20"
SENTENCE = "Too many failed sign-ins for this user name from your address"

# the real OpenID Provider process and the SSO settings of test_oidc.py
op = oidc_e2e.op
sso = oidc_e2e.sso


@pytest.fixture
def limit():
    return django_settings.ATRIUM_LOGIN_FAILURE_LIMIT


@pytest.fixture
def cool_off():
    return dt.timedelta(minutes=django_settings.ATRIUM_LOGIN_LOCKOUT_MINUTES)


def sign_in(client: Client, username: str, password: str):
    return client.post(reverse("login"), {"username": username, "password": password})


def signed_in(client: Client) -> bool:
    return SESSION_KEY in client.session


def lock(client: Client, username: str, limit: int):
    for _ in range(limit - 1):
        response = sign_in(client, username, "not-the-password")
        assert response.status_code == 200 and SENTENCE not in response.content.decode()
    return sign_in(client, username, "not-the-password")


def lockouts():
    return AuditEvent.objects.filter(action="auth.lockout")


def test_wrong_passwords_lock_the_pair_and_the_right_password_is_then_refused_with_a_sentence(
        make_user, limit, cool_off):
    alice = make_user("alice")
    client = Client(REMOTE_ADDR=ATTACKER)

    locking = lock(client, "alice", limit)

    # the failure that locks already answers with the sentence, on the project's sign-in page
    assert locking.status_code == 429
    page = locking.content.decode()
    assert SENTENCE in page and "Sign in to Atrium" in page and 'id="lockout"' in page
    assert "Traceback" not in page
    assert 0 < int(locking["Retry-After"]) <= cool_off.total_seconds()
    assert "Content-Security-Policy" in locking  # rendered inside the middleware stack, headers on

    right = sign_in(client, "alice", PASSWORD)
    assert right.status_code == 429 and SENTENCE in right.content.decode()
    assert not signed_in(client)
    assert 0 < int(right["Retry-After"]) <= cool_off.total_seconds()

    event = lockouts().get()
    assert event.outcome == AuditOutcome.DENIED
    assert (event.target_type, event.target_id, event.target_label) == ("auth.user", str(alice.pk), "alice")
    assert event.source_ip == ATTACKER and event.actor is None
    assert event.after["failures"] == limit and event.after["address"] == ATTACKER
    # the limit's wrong passwords are each audited; the refusal while locked is not another one
    assert AuditEvent.objects.filter(action="auth.login_failed", target_label="alice").count() == limit
    assert verify_chain().ok


def test_refusals_while_locked_neither_extend_the_lockout_nor_add_events_and_it_lifts_after_the_cool_off(
        make_user, limit, cool_off):
    make_user("alice")
    client = Client(REMOTE_ADDR=ATTACKER)
    start = timezone.now()
    with time_machine.travel(start, tick=False) as clock:
        assert lock(client, "alice", limit).status_code == 429
        first_wait = cool_off.total_seconds()
        for _ in range(3):
            clock.shift(dt.timedelta(seconds=cool_off.total_seconds() / 4))
            refused = sign_in(client, "alice", "still-guessing")
            assert refused.status_code == 429
            wait = int(refused["Retry-After"])
            assert wait < first_wait, "a refusal during the lockout must not restart it"
            first_wait = wait
        assert lockouts().count() == 1

        clock.move_to(start + cool_off + dt.timedelta(seconds=1))
        response = sign_in(client, "alice", PASSWORD)
        assert response.status_code == 302 and signed_in(client)
    assert lockouts().count() == 1


def test_another_address_is_not_locked_and_a_forged_forwarded_header_does_not_escape(make_user, limit, settings):
    make_user("alice")
    assert lock(Client(REMOTE_ADDR=ATTACKER), "alice", limit).status_code == 429

    # the person, from their own address, signs in as usual
    elsewhere = Client(REMOTE_ADDR=ELSEWHERE)
    assert sign_in(elsewhere, "alice", PASSWORD).status_code == 302 and signed_in(elsewhere)

    # the attacker cannot pick another address by sending X-Forwarded-For from an untrusted peer
    forged = Client(REMOTE_ADDR=ATTACKER, HTTP_X_FORWARDED_FOR=ELSEWHERE)
    assert sign_in(forged, "alice", PASSWORD).status_code == 429

    # behind a trusted proxy the forwarded address is the one counted
    settings.ATRIUM_TRUSTED_PROXIES = ["10.0.0.2"]
    via_proxy = Client(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=ATTACKER)
    assert sign_in(via_proxy, "alice", PASSWORD).status_code == 429
    other_client = Client(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=f"{ATTACKER}, 192.0.2.44")
    assert sign_in(other_client, "alice", PASSWORD).status_code == 302
    assert lockouts().count() == 1


def test_a_successful_sign_in_resets_the_count(make_user, limit):
    make_user("alice")
    client = Client(REMOTE_ADDR=ATTACKER)
    for _ in range(limit - 1):
        assert sign_in(client, "alice", "typo").status_code == 200
    assert sign_in(client, "alice", PASSWORD).status_code == 302
    client.post(reverse("logout"))
    for _ in range(limit - 1):
        assert sign_in(client, "alice", "typo").status_code == 200
    assert sign_in(client, "alice", PASSWORD).status_code == 302
    assert lockouts().count() == 0


def test_an_unknown_user_name_is_locked_the_same_way(db, limit):
    # the answer never tells whether an account exists
    response = lock(Client(REMOTE_ADDR=ATTACKER), "no-such-person", limit)
    assert response.status_code == 429 and SENTENCE in response.content.decode()
    event = lockouts().get()
    assert event.target_label == "no-such-person" and event.target_id == ""


def test_sudo_reauthentication_counts_and_shows_the_sentence_on_its_own_page(make_user, limit):
    make_user("alice")
    client = Client(REMOTE_ADDR=ATTACKER)
    assert sign_in(client, "alice", PASSWORD).status_code == 302
    url = reverse("reauthenticate")
    for _ in range(limit - 1):
        assert client.post(url, {"password": "guess", "next": "/"}).status_code == 200
    locking = client.post(url, {"password": "guess", "next": "/"})
    assert locking.status_code == 429 and int(locking["Retry-After"]) > 0
    page = locking.content.decode()
    assert SENTENCE in page and "Confirm your identity" in page

    refused = client.post(url, {"password": PASSWORD, "next": "/"})
    assert refused.status_code == 429 and "That password is not right" not in refused.content.decode()
    assert lockouts().count() == 1
    # one denied re-authentication per wrong password, none for the refusal while locked
    assert AuditEvent.objects.filter(action="auth.reauthenticate", outcome="denied").count() == limit


def test_a_locked_out_persons_api_token_still_works(make_user, limit):
    alice = make_user("alice")
    _token, secret = tokens.create_token(alice, name="laptop", scope="read", days=30)
    assert lock(Client(REMOTE_ADDR=ATTACKER), "alice", limit).status_code == 429

    api = Client(REMOTE_ADDR=ATTACKER, HTTP_AUTHORIZATION=f"Bearer {secret}")
    response = api.get("/api/v1/me")
    assert response.status_code == 200 and response.json()["username"] == "alice"
    # and a wrong token from the same address is the API's own refusal, not the lockout page
    wrong = Client(REMOTE_ADDR=ATTACKER, HTTP_AUTHORIZATION="Bearer atp_not-a-real-token")
    assert wrong.get("/api/v1/me").status_code == 401


def test_failure_counters_do_not_pile_up(make_user, limit, cool_off):
    make_user("alice")
    start = timezone.now()
    with time_machine.travel(start, tick=False) as clock:
        for i in range(30):  # a password spray: many names, many addresses
            sign_in(Client(REMOTE_ADDR=f"192.0.2.{i + 1}"), f"user-{i}", "guess")
        assert AccessAttempt.objects.count() == 30
        # a successful sign-in writes no second log table (the audit log has it)
        assert sign_in(Client(REMOTE_ADDR=ELSEWHERE), "alice", PASSWORD).status_code == 302
        assert AccessLog.objects.count() == 0

        clock.move_to(start + cool_off + dt.timedelta(seconds=1))
        # axes prunes what no longer counts at the next sign-in event ...
        sign_in(Client(REMOTE_ADDR=ELSEWHERE), "alice", "typo")
        assert AccessAttempt.objects.count() == 1

        # ... and a quiet installation runs the command from cron
        clock.move_to(start + 2 * cool_off + dt.timedelta(seconds=2))
        out = io.StringIO()
        call_command("prune_login_attempts", stdout=out)
        assert AccessAttempt.objects.count() == 0
        assert "deleted 1 expired" in out.getvalue()


def test_pruning_never_lifts_a_current_lockout(make_user, limit):
    make_user("alice")
    client = Client(REMOTE_ADDR=ATTACKER)
    assert lock(client, "alice", limit).status_code == 429
    call_command("prune_login_attempts", stdout=io.StringIO())
    assert sign_in(client, "alice", PASSWORD).status_code == 429


# --- SSO is not throttled --------------------------------------------------------------------


@pytest.mark.slow
def test_sso_sign_in_is_unaffected_by_a_password_lockout_and_its_refusals_are_not_counted(
        live_server, db, sso, monkeypatch, limit):
    sso.set_account("dana", sub="sub-dana", email="dana@corp.test", groups=[])
    first = sso_login(live_server, sso, "dana")
    dana = session_user(first)
    assert dana is not None
    # a break-glass local password on the same account, then guessed at from this very address
    dana.set_password(PASSWORD)
    dana.save()
    guesser = requests.Session()
    for _ in range(limit):
        guesser.get(f"{live_server.url}/login/", timeout=10)
        last = guesser.post(f"{live_server.url}/login/", data={
            "username": dana.username, "password": "guess",
            "csrfmiddlewaretoken": guesser.cookies.get("csrftoken", "")}, timeout=10)
    assert last.status_code == 429 and SENTENCE in last.text
    assert "Signing in with SSO is not affected" in last.text

    # SSO from the same address (127.0.0.1) still signs dana in
    again = sso_login(live_server, sso, "dana")
    assert session_user(again) == dana

    # refused SSO callbacks (a bad signature) are never counted as password failures
    attempts = AccessAttempt.objects.count()
    with monkeypatch.context() as m:
        _tamper(m, sso, "signature")
        for _ in range(limit + 1):
            assert session_user(sso_login(live_server, sso, "dana")) is None
    assert AccessAttempt.objects.count() == attempts
    assert session_user(sso_login(live_server, sso, "dana")) == dana
    assert lockouts().count() == 1


def test_an_over_long_user_name_is_a_field_error_and_never_a_crash(db):
    response = sign_in(Client(REMOTE_ADDR=ATTACKER), "x" * 10_000, "guess")
    assert response.status_code == 200
    assert "at most 150 characters" in response.content.decode()
    assert AccessAttempt.objects.count() == 0  # the form stopped it before authenticate()

    # a caller that skips the form still cannot overflow the counter's column
    request = RequestFactory().post("/login/", REMOTE_ADDR=ATTACKER)
    assert authenticate(request, username="é" * 301, password="guess") is None
    assert AccessAttempt.objects.get().username == "é" * 255


@pytest.mark.parametrize("env", [{"ATRIUM_LOGIN_FAILURE_LIMIT": "0"}, {"ATRIUM_LOGIN_LOCKOUT_MINUTES": "soon"}])
def test_an_unusable_throttle_setting_stops_start_up_with_one_sentence(env):
    from portal.tests.test_foundation import PROD_ENV, manage

    result = manage("check", env={**PROD_ENV, **env})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("Atrium cannot start:") and "ATRIUM_LOGIN_" in result.stderr

"""The metering writer (serving.meterwriter): answered requests are written by one thread per
process, in batches, exactly once each, also across a dropped database connection and
through a graceful stop of gunicorn while a write is blocked.

A batch is made observable by holding the hourly rollup row's lock from another connection:
the writer's statement waits on it while the requests answered meanwhile queue up."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests
from django.conf import settings
from django.utils import timezone

from portal.tests.test_faults import _get_status, free_port, wait_for
from serving import meterwriter, ratelimit
from serving import services as svc
from serving.models import GatewayRequest, TokenUsage
from serving.tests.conftest import admin_connection, chat_body, server_env

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def rollup_row_locked(key, service):
    """Another session holds the lock of the key's hourly rollup rows until the block ends."""
    with admin_connection() as other:
        other.autocommit = False
        rows = other.execute(f"SELECT id FROM {TokenUsage._meta.db_table} WHERE api_key_id = %s AND service_id = %s "  # noqa: S608 # nosec B608 # table name from model metadata
                             "FOR UPDATE", [key.pk, service.pk]).fetchall()
        assert rows, "the rollup row exists before it is locked"
        try:
            yield
        finally:
            other.rollback()


HALF_PAST = timezone.now().replace(minute=30, second=0, microsecond=0)  # one hour for every usage here


def _usage(key, service, n: int, *, uid=None):
    usage = svc.usage_of(uid=uid or uuid.uuid4(), key=key, service=service, endpoint="chat", input_tokens=n,
                         output_tokens=2 * n)
    return dataclasses.replace(usage, time=HALF_PAST)


def clear_of_the_hour(margin: float = 40.0) -> None:
    """Requests metered by a server carry their own time: keep a test's requests in one hour."""
    now = timezone.now()
    to_next = 3600 - (now.minute * 60 + now.second + now.microsecond / 1e6)
    if to_next < margin:
        time.sleep(to_next + 1)


def test_requests_answered_while_a_write_waits_are_written_together_exactly_once(world):
    w = world
    writer = meterwriter.MeterWriter()
    key, service = w.key["alpha"], w.service["alpha"]
    limits = (ratelimit.Limit("key", key.pk, None, 10**9),)
    try:
        writer.submit(_usage(key, service, 1), limits)  # creates the hour's rollup row
        assert writer.flush()
        first = writer.batches
        usages = [_usage(key, service, n) for n in range(1, 61)]
        with rollup_row_locked(key, service):
            writer.submit(usages[0], limits)  # its statement now waits for the lock
            wait_for(lambda: writer.pending() == 1 and not writer._queue, 10, what="the writer to be blocked")
            with ThreadPoolExecutor(10) as pool:  # requests of many threads, and a retried uid among them
                list(pool.map(lambda u: writer.submit(u, limits), usages[1:] + usages[5:10]))
            assert writer.pending() == 1 + 59 + 5
        assert writer.flush()
        assert writer.batches - first <= 3 < len(usages)  # the blocked one, then the queue in one or two
    finally:
        assert writer.stop()
    row = TokenUsage.objects.get(api_key=key, service=service)
    expected_in = 1 + sum(range(1, 61))
    assert (row.requests, row.input_tokens, row.output_tokens) == (61, expected_in, 2 * expected_in)
    assert GatewayRequest.objects.filter(api_key=key).count() == 61
    minute = int(time.time() // ratelimit.WINDOW)  # the writes happened in this minute or the one before
    counted = sum(int(ratelimit.client().get(f"{ratelimit.NAMESPACE}:tok:key:{key.pk}:{m}") or 0)
                  for m in (minute - 1, minute))
    assert counted == 3 * expected_in  # every recorded request's tokens once; the retried uids not again


def test_a_dropped_connection_loses_nothing_and_counts_nothing_twice(world, caplog):
    w = world
    writer = meterwriter.MeterWriter()
    key, service = w.key["alpha"], w.service["alpha"]
    sessions = ("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend'")
    with admin_connection() as admin:
        before = {r[0] for r in admin.execute(sessions)}
    try:
        writer.submit(_usage(key, service, 1))
        assert writer.flush()
        with admin_connection() as admin:
            new = {r[0] for r in admin.execute(sessions)} - before
            assert len(new) == 1, new  # the writer's own connection
            admin.execute("SELECT pg_terminate_backend(%s)", [new.pop()])
        usages = [_usage(key, service, n) for n in range(2, 12)]
        with caplog.at_level("WARNING", logger="atrium.gateway"):
            for u in usages:
                writer.submit(u)
            assert writer.flush()
        for u in usages[:4]:  # written again, as after a commit lost with its connection
            writer.submit(u)
        assert writer.flush()
    finally:
        assert writer.stop()
    assert "writing them again" in caplog.text  # the first attempt met the dead connection
    row = TokenUsage.objects.get(api_key=key, service=service)
    assert (row.requests, row.input_tokens) == (11, sum(range(1, 12)))
    assert GatewayRequest.objects.filter(api_key=key).count() == 11


def test_a_request_that_cannot_be_written_does_not_hold_back_the_others(world, caplog):
    w = world
    writer = meterwriter.MeterWriter()
    key, service = w.key["alpha"], w.service["alpha"]
    first = _usage(key, service, 100)
    good = [_usage(key, service, n) for n in range(1, 6)]
    bad = dataclasses.replace(_usage(key, service, 1), input_tokens=2**40)  # out of the column's range
    try:
        writer.submit(first)
        assert writer.flush()
        with rollup_row_locked(key, service), caplog.at_level("ERROR", logger="atrium.gateway"):
            writer.submit(good[0])
            wait_for(lambda: not writer._queue, 10, what="the writer to be blocked")
            for u in [good[1], bad, *good[2:]]:  # to be written as one batch, which fails
                writer.submit(u)
        assert writer.flush()
    finally:
        assert writer.stop()
    assert f"gateway request {bad.uid} was answered but could not be metered" in caplog.text
    assert set(GatewayRequest.objects.values_list("uid", flat=True)) == {first.uid} | {u.uid for u in good}
    assert TokenUsage.objects.get(api_key=key).requests == 6


def test_gunicorn_stopping_drains_the_writer_while_its_write_is_blocked(world):
    """SIGTERM while the metering statement waits for a lock: the worker answers, stops taking
    requests, and exits only once the queued requests are written (gunicorn's worker_exit
    hook drains the writer; atexit would too)."""
    w = world
    clear_of_the_hour()
    key, service = w.key["alpha"], w.service["alpha"]
    port = free_port()
    env = server_env()
    web = subprocess.Popen([sys.executable, "-m", "gunicorn", "portal.wsgi:application", "-b", f"127.0.0.1:{port}",
                            "-w", "1", "--threads", "8", "--graceful-timeout", "30"],
                           cwd=settings.BASE_DIR, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {w.secret['alpha']}"}
    try:
        wait_for(lambda: _get_status(f"http://127.0.0.1:{port}/healthz") == 200, 60, what="gunicorn to answer")
        first = requests.post(url, json=chat_body("first"), headers=headers, timeout=30)
        assert first.status_code == 200
        wait_for(lambda: TokenUsage.objects.filter(api_key=key).exists(), 10, what="the first request to be metered")
        with rollup_row_locked(key, service):
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda i: requests.post(url, json=chat_body(f"question {i}"),
                                                                headers=headers, timeout=30), range(20)))
            assert [a.status_code for a in answers] == [200] * 20  # answered while metering waits
            assert TokenUsage.objects.get(api_key=key).requests == 1
            web.send_signal(signal.SIGTERM)
            # a worker that did not drain would be gone in about 2 s (its loop wakes every second)
            deadline = time.monotonic() + 5
            while web.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert web.poll() is None, "the worker exited with requests not yet metered"
        web.wait(timeout=30)
    finally:
        if web.poll() is None:
            web.kill()
            web.wait(timeout=10)
    everything = [first, *answers]
    row = TokenUsage.objects.get(api_key=key)
    assert row.requests == 21 == GatewayRequest.objects.filter(api_key=key).count()
    assert row.input_tokens == sum(a.json()["usage"]["prompt_tokens"] for a in everything)
    assert row.output_tokens == sum(a.json()["usage"]["completion_tokens"] for a in everything)
    assert "not metered" not in web.stderr.read()


def test_inside_a_transaction_the_request_is_metered_on_its_own_connection(world):
    """What another connection could not see yet (the caller's own transaction) is metered
    right there: nothing is handed to the writer."""
    from django.db import transaction

    w = world
    key, service = w.key["alpha"], w.service["alpha"]
    before = meterwriter.writer.batches
    with transaction.atomic():
        meterwriter.meter(_usage(key, service, 3))
        assert TokenUsage.objects.get(api_key=key).input_tokens == 3  # written, inside this transaction
    assert meterwriter.writer.batches == before and meterwriter.writer.pending() == 0

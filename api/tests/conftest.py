"""Fixtures of the API tests: tokens of each scope for alpha's people, clients that send them,
and a clean rate-limit count in this test run's own Redis database."""

from __future__ import annotations

import datetime as dt

import pytest
import redis
from django.conf import settings
from django.test import Client

from api import tokens


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    # the org fixture makes a dozen accounts; the production hasher is slow on purpose
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _clean_rate_limits():
    r = redis.Redis.from_url(settings.REDIS_URL)
    for key in r.scan_iter("atrium:api:rate:*"):
        r.delete(key)
    yield


@pytest.fixture
def issue(org):
    """issue(user, scope="read", days=30) -> (token row, secret)."""

    def make(user, scope="read", days=30, name="test"):
        return tokens.create_token(user, name=name, scope=scope, days=days)

    return make


def bearer(secret: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {secret}")


def session(user, **kwargs) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


@pytest.fixture
def alpha_job(org):
    from scheduling import services as sched

    return sched.submit_job(org.people["alpha"]["user"], project=org.projects["alpha"], spec=org.specs["h1"],
                            priority_class=org.prio["batch"], name="alpha-train", image="busybox",
                            command=["sleep", "60"])


@pytest.fixture
def beta_job(org):
    from scheduling import services as sched

    return sched.submit_job(org.people["beta"]["user"], project=org.projects["beta"], spec=org.specs["h1"],
                            priority_class=org.prio["batch"], name="beta-train", image="busybox",
                            command=["sleep", "60"])


def past(days: int = 1) -> dt.timedelta:
    return dt.timedelta(days=days)


@pytest.fixture
def reports(org):
    """A queued report of each tenant, requested by its tenant admin (not built: no worker)."""
    import datetime as dt

    from metering import services as metering

    out = {}
    for slug in ("alpha", "beta"):
        out[slug] = metering.request_report(org.people[slug]["admin"], period_start=dt.date(2026, 1, 1),
                                            period_end=dt.date(2026, 2, 1), grouping="project", mode="showback",
                                            tenant=org.tenants[slug], enqueue=False)
    return out

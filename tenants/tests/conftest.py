"""Fixtures of the tenancy tests. The password hasher is the fast one: the `org` fixture makes
a dozen accounts per test, and PBKDF2's deliberate slowness buys nothing in a test database."""

import pytest


@pytest.fixture(autouse=True)
def _fast_password_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

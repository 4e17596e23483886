"""API key material: generation, the keyed hash that is stored, and constant-time checking.

A key is `atr_` + secrets.token_urlsafe(32) (256 bits). The database keeps only
HMAC-SHA256(server secret, key): a stolen table cannot be replayed against the gateway, and
the secret is never logged or stored anywhere. The server secret is ATRIUM_API_KEY_SECRET
(setting or environment variable) or, failing that, derived from SECRET_KEY; changing it
invalidates every key, which is the intended break-glass.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from functools import lru_cache

from django.conf import settings

PREFIX = "atr_"
RANDOM_BYTES = 32
SHOWN_PREFIX_LEN = 12  # "atr_" + 8 characters of the random part: enough to recognise, useless to guess
KEY_RE = re.compile(r"^atr_[A-Za-z0-9_-]{40,60}$")


@lru_cache(maxsize=4)
def _secret(secret_key: str, dedicated: str) -> bytes:
    if dedicated:
        return dedicated.encode()
    # Derived, not SECRET_KEY itself, so the two can never be confused in another HMAC use.
    return hmac.new(secret_key.encode(), b"atrium api key hashing v1", hashlib.sha256).digest()


def server_secret() -> bytes:
    dedicated = getattr(settings, "ATRIUM_API_KEY_SECRET", "") or os.environ.get("ATRIUM_API_KEY_SECRET", "")
    return _secret(settings.SECRET_KEY, dedicated)


def generate() -> str:
    return PREFIX + secrets.token_urlsafe(RANDOM_BYTES)


def digest(key: str) -> str:
    return hmac.new(server_secret(), key.encode(), hashlib.sha256).hexdigest()


def well_formed(key: str) -> bool:
    return bool(KEY_RE.match(key))


def matches(key: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(key), stored_digest)


def digests_match(computed: str, stored_digest: str) -> bool:
    """`matches` for a digest already computed (the lookup's own): one HMAC per request, not two."""
    return hmac.compare_digest(computed, stored_digest)

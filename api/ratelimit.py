"""Per-caller rate limit of the API's state-changing calls, counted in Redis.

A fixed window per token (or per signed-in user for session calls): INCR of one key per
window, the key expiring with the window, so every web process shares one count. Over the
limit, the call is refused with 429 and Retry-After (the seconds left in the window). If
Redis cannot be reached the call passes and a warning is logged: Redis is also the job
queue, so the portal is degraded anyway and refusing every submission would not help.
"""

from __future__ import annotations

import logging
import time

import redis
from django.conf import settings

from api.problems import ApiProblem

log = logging.getLogger(__name__)

_client = None


def _redis():
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    return _client


def limit() -> tuple[int, int]:
    """(calls, window seconds) from ATRIUM_API_RATE_LIMIT, e.g. "60/60" (default)."""
    raw = str(getattr(settings, "ATRIUM_API_RATE_LIMIT", "60/60"))
    calls, _, window = raw.partition("/")
    return int(calls), int(window or 60)


def caller_key(request) -> str:
    token = getattr(request, "api_token", None)
    return f"token:{token.pk}" if token is not None else f"user:{request.user.pk}"


def check(request) -> None:
    """Count one state-changing call of this caller; raise a 429 problem when over the limit."""
    calls, window = limit()
    now = time.time()
    bucket = int(now // window)
    key = f"atrium:api:rate:{caller_key(request)}:{bucket}"
    try:
        pipe = _redis().pipeline()
        pipe.incr(key)
        pipe.expire(key, window + 1)
        count, _ = pipe.execute()
    except redis.RedisError as exc:
        log.warning("API rate limit not enforced: Redis unavailable (%s)", exc)
        return
    if count > calls:
        retry = max(int((bucket + 1) * window - now) + 1, 1)
        raise ApiProblem("rate-limited", f"At most {calls} changes per {window} s; try again in {retry} s.",
                         retry_after=retry)

"""Per-key and per-project request and token rate limits in Redis (fixed one-minute windows).

A request increments the request counters of its key and project for the current minute in
one pipeline and is refused when a counter passes its limit; tokens are added after the
upstream reported them, and a new request is refused while the minute's tokens are at or
over the limit. Counters expire on their own. This module only counts: it never decides who
a caller is, and it never touches the database.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import lru_cache

import redis
from django.conf import settings

WINDOW = 60
NAMESPACE = "atr:rl"


@lru_cache(maxsize=1)
def client(url: str | None = None) -> redis.Redis:
    return redis.Redis.from_url(url or settings.REDIS_URL, socket_timeout=0.5, socket_connect_timeout=0.5)


@dataclass(frozen=True)
class Limit:
    scope: str  # "key" or "project"
    ident: int
    requests_per_minute: int | None
    tokens_per_minute: int | None


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after: int


def _window(now: float) -> tuple[int, int]:
    minute = int(now // WINDOW)
    retry = max(1, math.ceil((minute + 1) * WINDOW - now))
    return minute, retry


def check(limits: list[Limit], now: float | None = None) -> Refusal | None:
    """Count this request; a Refusal when any limit is exceeded (RedisError propagates)."""
    limits = [lim for lim in limits if lim.requests_per_minute is not None or lim.tokens_per_minute is not None]
    if not limits:
        return None
    now = time.time() if now is None else now
    minute, retry = _window(now)
    pipe = client().pipeline(transaction=False)
    for lim in limits:
        if lim.requests_per_minute is not None:
            k = f"{NAMESPACE}:req:{lim.scope}:{lim.ident}:{minute}"
            pipe.incr(k)
            pipe.expire(k, WINDOW * 2)
        if lim.tokens_per_minute is not None:
            pipe.get(f"{NAMESPACE}:tok:{lim.scope}:{lim.ident}:{minute}")
    results = iter(pipe.execute())
    for lim in limits:
        if lim.requests_per_minute is not None:
            count = int(next(results))
            next(results)
            if count > lim.requests_per_minute:
                return Refusal(f"Rate limit reached for this {_label(lim)}: {lim.requests_per_minute} requests per "
                               f"minute.", retry)
        if lim.tokens_per_minute is not None:
            used = int(next(results) or 0)
            if used >= lim.tokens_per_minute:
                return Refusal(f"Rate limit reached for this {_label(lim)}: {lim.tokens_per_minute} tokens per "
                               f"minute.", retry)
    return None


def add_tokens_many(spent: list[tuple[list[Limit], int]], now: float | None = None) -> None:
    """Add each request's tokens to the minute's counters of its limits, in one pipeline."""
    totals: dict[str, int] = {}
    for limits, tokens in spent:
        if tokens <= 0:
            continue
        for lim in limits:
            if lim.tokens_per_minute is not None:
                k = f"{NAMESPACE}:tok:{lim.scope}:{lim.ident}"
                totals[k] = totals.get(k, 0) + tokens
    if not totals:
        return
    minute, _ = _window(time.time() if now is None else now)
    pipe = client().pipeline(transaction=False)
    for k, tokens in totals.items():
        pipe.incrby(f"{k}:{minute}", tokens)
        pipe.expire(f"{k}:{minute}", WINDOW * 2)
    pipe.execute()


def _label(lim: Limit) -> str:
    return "API key" if lim.scope == "key" else "project"


def clear() -> None:
    """Remove every rate-limit counter (tests; never called by the gateway)."""
    c = client()
    for k in c.scan_iter(f"{NAMESPACE}:*", count=500):
        c.delete(k)

"""Per-key and per-project request and token rate limits in Redis (fixed one-minute windows).

A request increments the request counters of its key and project for the current minute in
one pipeline and is refused when a counter passes its limit; tokens are added after the
upstream reported them, and a new request is refused while the minute's tokens are at or
over the limit. Counters expire on their own. A request whose key check came from memory
(serving.authcache) is validated, budget-checked and counted by one Lua script in one round
trip (admit_cached). The metering writer also keeps each project's tokens of the month here,
for the budgets of those cached checks. This module only counts: it never decides who a
caller is, and it never touches the database.
"""

from __future__ import annotations

import datetime as dt
import math
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache

import redis
from django.conf import settings

WINDOW = 60
NAMESPACE = "atr:rl"
GENERATION_KEY = "atr:authz:gen"  # serving.authcache's generation of the cached key checks


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
        count = used = 0
        if lim.requests_per_minute is not None:
            count = int(next(results))
            next(results)
        if lim.tokens_per_minute is not None:
            used = int(next(results) or 0)
        refusal = _refusal(lim, count, used, retry)
        if refusal is not None:
            return refusal
    return None


def _refusal(lim: Limit, count: int, used: int, retry: int) -> Refusal | None:
    """The refusal of a request that made `count` requests and found `used` tokens this minute."""
    if lim.requests_per_minute is not None and count > lim.requests_per_minute:
        return Refusal(f"Rate limit reached for this {_label(lim)}: {lim.requests_per_minute} requests per minute.",
                       retry)
    if lim.tokens_per_minute is not None and used >= lim.tokens_per_minute:
        return Refusal(f"Rate limit reached for this {_label(lim)}: {lim.tokens_per_minute} tokens per minute.",
                       retry)
    return None


def add_tokens_many(spent: list[tuple[list[Limit], int]], now: float | None = None,
                    months: list[tuple[int, dt.datetime, int]] = ()) -> None:
    """Add each request's tokens to the minute's counters of its limits and `months`'
    (project, month start, tokens) to the projects' month counters, in one pipeline."""
    totals: dict[str, int] = {}
    minute, _ = _window(time.time() if now is None else now)
    for limits, tokens in spent:
        if tokens <= 0:
            continue
        for lim in limits:
            if lim.tokens_per_minute is not None:
                k = f"{NAMESPACE}:tok:{lim.scope}:{lim.ident}:{minute}"
                totals[k] = totals.get(k, 0) + tokens
    month_totals: dict[str, int] = {}
    for project_id, month, tokens in months:
        if tokens > 0:
            k = month_key(project_id, month)
            month_totals[k] = month_totals.get(k, 0) + tokens
    if not totals and not month_totals:
        return
    pipe = client().pipeline(transaction=False)
    for k, tokens in totals.items():
        pipe.incrby(k, tokens)
        pipe.expire(k, WINDOW * 2)
    for k, tokens in month_totals.items():
        pipe.incrby(k, tokens)
        pipe.expire(k, MONTH_TTL)
    pipe.execute()


# --- the cached key checks' admission (serving.authcache) --------------------------------

MONTH_TTL = 40 * 24 * 3600


def month_key(project_id: int, month: dt.datetime) -> str:
    """The Redis counter of a project's gateway tokens in the month starting at `month`."""
    return f"{NAMESPACE}:month:{project_id}:{month:%Y%m}"


# One round trip for a request whose key check came from serving.authcache: the generation
# it was read under must still be current (else nothing is counted and 'stale' comes back),
# then the monthly budget (refused: nothing counted), then what check() does.
# KEYS: generation, month counter, then per limit its request and token counters.
# ARGV: expected generation, month base ('' = no budget), budget, month counter at the entry,
#       window expiry, then per limit '1'/'0' for requests counted and tokens read.
_ADMIT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'stale'} end
if ARGV[2] ~= '' then
  local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
  if counter < tonumber(ARGV[4]) then return {'stale'} end
  local used = tonumber(ARGV[2]) + counter
  if used >= tonumber(ARGV[3]) then return {'budget', used} end
end
local out = {'ok'}
for i = 3, #KEYS, 2 do
  local j = 6 + (i - 3)
  local n = 0
  if ARGV[j] == '1' then
    n = redis.call('INCR', KEYS[i])
    redis.call('EXPIRE', KEYS[i], ARGV[5])
  end
  local t = 0
  if ARGV[j + 1] == '1' then t = redis.call('GET', KEYS[i + 1]) or 0 end
  out[#out + 1] = n
  out[#out + 1] = t
end
return out
"""


def admit_script(redis_client):
    """_ADMIT registered on `redis_client` (EVALSHA, loaded on first use)."""
    return redis_client.register_script(_ADMIT)


_admit_script = lru_cache(maxsize=4)(admit_script)  # the synchronous client's, made once


@dataclass(frozen=True)
class Stale:
    """The cached key check is no longer current: check the key in the database."""


@dataclass(frozen=True)
class OverBudget:
    used: int


def admit_cached(limits: list[Limit], *, generation: str, project_id: int, month: dt.datetime,
                 month_base: int | None, budget: int | None, month_counter: int,
                 now: float | None = None) -> Stale | OverBudget | Refusal | None:
    """check() for a cached key check, in one round trip with its validation (see _ADMIT)."""
    keys, args, retry = _admit_call(limits, generation=generation, project_id=project_id, month=month,
                                    month_base=month_base, budget=budget, month_counter=month_counter, now=now)
    c = client()
    return _admit_outcome(_admit_script(c)(keys=keys, args=args, client=c), limits, retry)


async def admit_cached_async(redis_client, script, limits: list[Limit], **ticket) -> Stale | OverBudget | Refusal | None:
    """admit_cached() on an asyncio Redis client (serving.dataplane); `script` is _ADMIT registered on it."""
    keys, args, retry = _admit_call(limits, **ticket)
    return _admit_outcome(await script(keys=keys, args=args, client=redis_client), limits, retry)


def _admit_call(limits: list[Limit], *, generation: str, project_id: int, month: dt.datetime,
                month_base: int | None, budget: int | None, month_counter: int, now: float | None = None):
    minute, retry = _window(time.time() if now is None else now)
    keys = [GENERATION_KEY, month_key(project_id, month)]
    args = [generation, "" if month_base is None or budget is None else month_base, budget or 0, month_counter,
            WINDOW * 2]
    for lim in limits:
        keys += [f"{NAMESPACE}:req:{lim.scope}:{lim.ident}:{minute}", f"{NAMESPACE}:tok:{lim.scope}:{lim.ident}:{minute}"]
        args += ["1" if lim.requests_per_minute is not None else "0", "1" if lim.tokens_per_minute is not None else "0"]
    return keys, args, retry


def _admit_outcome(result: list, limits: list[Limit], retry: int) -> Stale | OverBudget | Refusal | None:
    if result[0] == b"stale":
        return Stale()
    if result[0] == b"budget":
        return OverBudget(int(result[1]))
    counts = iter(result[1:])
    for lim in limits:
        count, used = int(next(counts)), int(next(counts) or 0)
        refusal = _refusal(lim, count, used, retry)
        if refusal is not None:
            return refusal
    return None


def snapshot(project_id: int | None, month: dt.datetime) -> tuple[str, int]:
    """(the current generation, creating one if Redis has none; the project's month counter),
    read before the database when a key check is to be cached."""
    pipe = client().pipeline(transaction=False)
    pipe.set(GENERATION_KEY, uuid.uuid4().hex, nx=True)
    pipe.get(GENERATION_KEY)
    pipe.get(month_key(project_id or 0, month))
    _, generation, counter = pipe.execute()
    return generation.decode(), int(counter or 0)


def _label(lim: Limit) -> str:
    return "API key" if lim.scope == "key" else "project"


def clear() -> None:
    """Remove every rate-limit counter (tests; never called by the gateway)."""
    c = client()
    for k in c.scan_iter(f"{NAMESPACE}:*", count=500):
        c.delete(k)

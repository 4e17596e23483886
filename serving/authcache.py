"""Keys the gateway has just checked, kept in each process, and the one number in Redis that
says whether they are still what the database holds.

Why: the key check is one PostgreSQL round trip per gateway request, and on a two-core machine
the round trips, not the SQL, are what the gateway's added latency is made of
(bench/gateway.py, 32 clients x 100 ms upstream: +27 to +31 ms at p50 with the check at every
request, +10 ms with it answered from memory, everything else equal). A request whose key is
here needs no database at all: its rate limits already take one Redis round trip, and the
same round trip, a Lua script (serving.ratelimit.admit_cached), first compares the entry's
generation with the current one and refuses to count the request when they differ.

The generation (GENERATION_KEY in Redis, a random token) changes whenever something a key
check reads changes: keys and their scope, projects, tenants, serving limits, model services,
users, group memberships and project permissions (signal receivers connected in
serving.apps; each change bumps it at once and again when its transaction commits, so a
request that read the database between the two cannot keep what it read). Any change, to any
of these rows, anywhere: entries are cheap to refill and changes are rare next to requests.

An entry is never trusted for longer than TTL (30 s, the resolution of a key's last-used
time, which the database read then writes): changes made past Django's signals (raw SQL, a
queryset's update() in a shell) and a bump lost while Redis was unreachable take effect within
that time. Redis unreachable also means the gateway answers 503, so no stale entry is used
meanwhile. Inside a transaction (a test, ATOMIC_REQUESTS) nothing is cached or served from
here: the caller may hold changes no other process can see.

Monthly budgets: an entry of a project with a budget keeps the month's tokens read from the
database minus the project's month counter in Redis read before it (serving.ratelimit,
added to by the metering writer after each commit); at a hit, base + the counter now is the
month's use. Tokens committed between the two reads count twice (a few, too many, never too
few); a counter found smaller than when the entry was made (Redis restarted) discards the
entry.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from django.db import transaction
from redis.exceptions import RedisError

from serving import ratelimit
from serving.ratelimit import GENERATION_KEY

log = logging.getLogger("atrium.gateway")

TTL = 30.0
MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class Ticket:
    """What a cached caller carries to the admission script: the generation it was read under
    and, for a project with a budget, the month's use then."""

    generation: str
    month: dt.datetime  # start of the month the budget figures are for
    month_base: int | None = None  # tokens in the database minus the Redis month counter, read before it
    month_counter: int = 0  # that counter when the entry was made


@dataclass(frozen=True)
class Entry:
    caller: object  # serving.services.Caller (its key, project, tenant, limits and service are never modified)
    ticket: Ticket
    made: float  # time.monotonic()


_entries: dict[tuple[str, str | None], Entry] = {}
_projects: dict[str, int] = {}  # digest -> project of keys seen once (a key never changes project)
_lock = threading.Lock()


def get(digest: str, service: str | None) -> Entry | None:
    entry = _entries.get((digest, service))
    if entry is not None and time.monotonic() - entry.made > TTL:
        with _lock:
            _entries.pop((digest, service), None)
        return None
    return entry


def put(digest: str, service: str | None, caller, ticket: Ticket) -> None:
    with _lock:
        if len(_entries) >= MAX_ENTRIES:
            _entries.clear()  # many keys x names: start again rather than grow without bound
        _entries[(digest, service)] = Entry(caller, ticket, time.monotonic())


def forget(digest: str, service: str | None) -> None:
    with _lock:
        _entries.pop((digest, service), None)


def remember_project(digest: str, project_id: int) -> None:
    with _lock:
        if len(_projects) >= MAX_ENTRIES:
            _projects.clear()
        _projects[digest] = project_id


def known_project(digest: str) -> int | None:
    return _projects.get(digest)


def clear() -> None:
    """Forget every entry of this process (tests)."""
    with _lock:
        _entries.clear()
        _projects.clear()


# --- the generation ---------------------------------------------------------------------


def bump() -> None:
    """Make every cached key check of every gateway process stale: now and at commit."""
    _set_generation()
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(_set_generation)


def _set_generation() -> None:
    try:
        ratelimit.client().set(GENERATION_KEY, uuid.uuid4().hex)
    except RedisError as exc:
        log.error("the gateway's cached key checks could not be invalidated (%s); they expire within %.0f s",
                  type(exc).__name__, TTL)


def _changed(sender, instance=None, update_fields=None, **kwargs) -> None:
    if update_fields and set(update_fields) <= IGNORED_FIELDS.get(sender, set()):
        return
    bump()


def _m2m_changed(sender, action, **kwargs) -> None:
    if action.startswith("post_"):
        bump()


# Saves that change nothing a key check reads: a sign-in's last_login, a key's last_used.
IGNORED_FIELDS: dict = {}


def connect_signals() -> None:
    """Receivers for every model the key check (serving.services._key_check_sql) reads."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group, Permission
    from django.db.models.signals import m2m_changed, post_delete, post_save

    from serving.models import ApiKey, ModelService, ServingLimits
    from tenants.models import Project, ProjectGroupObjectPermission, ProjectUserObjectPermission, Tenant

    user = get_user_model()
    IGNORED_FIELDS.update({user: {"last_login"}, ApiKey: {"last_used"}})
    for model in (ApiKey, ModelService, ServingLimits, Project, Tenant, ProjectGroupObjectPermission,
                  ProjectUserObjectPermission, user, Group, Permission):
        post_save.connect(_changed, sender=model, dispatch_uid=f"authcache-save-{model._meta.label}")
        post_delete.connect(_changed, sender=model, dispatch_uid=f"authcache-delete-{model._meta.label}")
    for through in (ApiKey.services.through, user.groups.through):
        m2m_changed.connect(_m2m_changed, sender=through, dispatch_uid=f"authcache-m2m-{through._meta.label}")

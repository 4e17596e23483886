"""The acting request's context (who, from where, which request id), for audit and jobs.

Set by middleware for web requests and by the RQ job wrapper for background work, read by
the audit service. It carries identity facts only; it must never be used for permission
decisions, which always take the acting user explicitly.
"""

from __future__ import annotations

import contextvars
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RequestContext:
    request_id: str = ""
    source_ip: str = ""
    user_agent: str = ""
    actor_label: str = ""  # "service:scheduler", "apikey:12" when no user acts
    sudo: bool = False


_current: contextvars.ContextVar[RequestContext] = contextvars.ContextVar(
    "atrium_request_context", default=RequestContext()  # noqa: B039 (frozen, so never mutated)
)


def current() -> RequestContext:
    return _current.get()


def new_request_id() -> str:
    return uuid.uuid4().hex


@contextmanager
def bound(**fields):
    """Run a block with context fields set (and the previous context restored after)."""
    base = _current.get()
    token = _current.set(replace(base, **fields))
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def set_context(ctx: RequestContext):
    return _current.set(ctx)


def reset_context(token) -> None:
    _current.reset(token)

"""How Atrium behaves when a part it depends on is away: the database or the job queue.

Two pieces, both cheap on the happy path:

* `DatabaseUnavailableMiddleware` turns a lost PostgreSQL connection (django.db OperationalError
  with a connection-level cause, or InterfaceError, wherever in the request it surfaces: a view,
  a middleware, the session save) into a 503 with `Retry-After`: a small HTML page for people, RFC 9457 problem+json
  under /api/, OpenAI-shaped JSON under /v1/. Django reconnects on the next request
  (CONN_HEALTH_CHECKS), so the web process recovers by itself when the database returns.
* `background_status` (a context processor) tells signed-in users that background work is
  paused when Redis does not answer. The answer is cached per process for a few seconds and
  the probe uses 0.2 s socket timeouts, so a dead or hanging Redis never slows every page.

This module must never hide a programming error as "unavailable" (only connection-level
database errors are mapped; a deadlock, a lock timeout, an IntegrityError or a bug stays a 500
and is logged), and never
touch the database itself while rendering the 503 (the page has no context processors).
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from django.conf import settings
from django.core.signals import got_request_exception
from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse
from django.template.loader import render_to_string

log = logging.getLogger("atrium.resilience")

DB_UNAVAILABLE = (OperationalError, InterfaceError)
OUTAGE_SQLSTATES = {"57P01", "57P02", "57P03"}
RETRY_AFTER_SECONDS = 5
REDIS_CHECK_SECONDS = 5.0  # how long one Redis probe's answer is believed
REDIS_TIMEOUT_SECONDS = 0.2
PAUSED_MESSAGE = ("Background work is paused: the job queue cannot be reached. Submissions are saved and will be "
                  "scheduled automatically when it is back.")

_FLAG = "_atrium_db_unavailable"


# --- the database ----------------------------------------------------------------------


def is_db_outage(exc: BaseException | None) -> bool:
    """A lost or refused connection, or a server shutting down: not a deadlock, a lock timeout or a bug."""
    if isinstance(exc, InterfaceError):
        return True
    if not isinstance(exc, OperationalError):
        return False
    # psycopg's error is the cause; no SQLSTATE means the connection itself failed, class 08 is
    # "connection exception", 57P01-03 are admin/crash shutdown and "cannot connect now" (starting up)
    sqlstate = getattr(exc.__cause__, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in OUTAGE_SQLSTATES


def unavailable_response(request) -> HttpResponse:
    """The 503 every client kind understands; it never touches the database."""
    path = getattr(request, "path", "") or ""
    rid = getattr(request, "request_id", "")
    detail = "The database is unavailable for a moment; retry shortly. Nothing was changed by this request."
    if path.startswith("/api/"):
        response = JsonResponse(
            {"type": "urn:atrium:problem:service-unavailable", "title": "Service temporarily unavailable",
             "status": 503, "detail": detail, "instance": path, "retry_after": RETRY_AFTER_SECONDS},
            status=503, content_type="application/problem+json")
    elif path.startswith("/v1/"):
        response = JsonResponse({"error": {"message": "The gateway is temporarily unavailable; retry shortly.",
                                           "type": "server_error", "param": None, "code": "service_unavailable"}},
                                status=503)
    else:
        html = render_to_string("503.html", {"request_id": rid, "retry_after": RETRY_AFTER_SECONDS})
        response = HttpResponse(html, status=503, content_type="text/html; charset=utf-8")
    response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    response["Cache-Control"] = "no-store"
    # CSPMiddleware sits inside this middleware, so the page carries its own (strict) policy
    response.setdefault("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'; form-action 'self'")
    response.setdefault("X-Content-Type-Options", "nosniff")
    return response


def _mark_outage(sender, request=None, **kwargs) -> None:
    # got_request_exception fires inside Django's except block, so sys.exc_info() is the
    # exception that a middleware below raised (process_exception only sees view errors).
    exc = sys.exc_info()[1]
    if request is not None and is_db_outage(exc):
        setattr(request, _FLAG, exc)


got_request_exception.connect(_mark_outage, dispatch_uid="atrium.resilience.mark_outage")


class DatabaseUnavailableMiddleware:
    """503 + Retry-After instead of a 500 (or a traceback) while the database is away."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        try:
            response = self.get_response(request)
        except DB_UNAVAILABLE as exc:  # the 500 handler itself could not render (it needs the database too)
            if not is_db_outage(exc):
                raise
            return self._unavailable(request, exc)
        exc = getattr(request, _FLAG, None)
        if exc is not None and response.status_code >= 500:
            return self._unavailable(request, exc)
        return response

    def process_exception(self, request, exception):
        if is_db_outage(exception):
            return self._unavailable(request, exception)
        return None

    @staticmethod
    def _unavailable(request, exc) -> HttpResponse:
        log.warning("database unavailable, answering 503 (request %s): %s: %s",
                    getattr(request, "request_id", ""), type(exc).__name__, str(exc).strip().splitlines()[:1])
        return unavailable_response(request)


# --- Redis (the job queue) ---------------------------------------------------------------

_redis_state: dict[str, tuple[float, str]] = {}  # url -> (monotonic time checked, problem or "")
_redis_lock = threading.Lock()


def _queue_url() -> str:
    queue = settings.RQ_QUEUES.get("scheduling") or settings.RQ_QUEUES.get("default") or {}
    return queue.get("URL") or settings.REDIS_URL


def _probe(url: str) -> str:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                                  socket_timeout=REDIS_TIMEOUT_SECONDS, retry_on_timeout=False)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return type(exc).__name__
    finally:
        client.close()
    return ""


def redis_problem(*, max_age: float = REDIS_CHECK_SECONDS) -> str:
    """"" when the job queue answered within the last few seconds, else why it did not."""
    url = _queue_url()
    now = time.monotonic()
    checked = _redis_state.get(url)
    if checked is not None and now - checked[0] < max_age:
        return checked[1]
    # One thread probes; the others keep the last answer instead of queueing behind it.
    if not _redis_lock.acquire(blocking=checked is None):
        return checked[1] if checked else ""
    try:
        problem = _probe(url)
        if problem and not (checked and checked[1]):
            log.warning("Redis at the job queue URL does not answer (%s): background work is paused", problem)
        elif checked and checked[1] and not problem:
            log.info("Redis answers again: background work resumes")
        _redis_state[url] = (time.monotonic(), problem)
        return problem
    finally:
        _redis_lock.release()


def forget_redis_state() -> None:
    """Drop the cached answer (tests; an operator's readiness check wants a fresh one)."""
    _redis_state.clear()


def background_status(request) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"background_paused": ""}
    return {"background_paused": PAUSED_MESSAGE if redis_problem() else ""}

"""The gateway's data plane: asyncio processes (ASGI; uvicorn's worker under gunicorn) that
answer the OpenAI endpoints' common case themselves and hand everything else to the Django
gateway.

Why a second server for the same endpoints: under gunicorn's threads, the CPU a gateway
request costs on top of the model server was mostly threads handing the GIL to each other
(strace: about 110 futex calls per request at 32 clients) and each request's round trips;
on the two cores of bench/gateway.py that added +9 to +31 ms at p50 and +43 to +127 ms at p99,
where the issue asks +5 / +25. One event loop per process has no such hand-offs, and a request
whose key check is in memory (serving.authcache) needs one Redis round trip and the model
server, nothing else.

What it answers itself: POST /v1/chat/completions, /v1/completions and /v1/embeddings when
the key check is in this process's memory, the request is valid and not streamed. It runs the
Django gateway's own functions for every decision (serving.gateway: body and header checks,
service and scope, the rate limits; serving.ratelimit's admission script, which also
validates the cached key check; the same upstream errors, never billed; the same metering,
exactly once, through serving.meterwriter), and answers with the headers Django's middleware
would add. Anything else goes, with its body, to the Django WSGI application in a thread of
this process (ATRIUM_GATEWAY_DJANGO_THREADS): a key not yet in memory (the database check then fills it),
any request that would be refused before admission (401/403/404/400/413/415: the same answer,
from the same code), a budget refusal (it raises the alarm), streams (a thread per stream, as
under gunicorn), every other path. A request is handed over only before anything was counted
or sent, so nothing happens twice.

Run it as production does (deploy/k8s/gateway.yaml; serving/dataplane_worker.py says why gunicorn):
    gunicorn serving.dataplane:application -k serving.dataplane_worker.Worker -w 2
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from tempfile import SpooledTemporaryFile

import aiohttp
import redis.asyncio as aredis
from asgiref.wsgi import WsgiToAsgiInstance
from django.conf import settings
from django.http import HttpResponse
from django.http.request import split_domain_port, validate_host
from django.middleware.security import SecurityMiddleware
from django.test import RequestFactory
from redis.exceptions import RedisError

from portal.middleware import GATEWAY_CSP, request_id_from
from portal.wsgi import application as django_application
from serving import authcache, gateway, meterwriter, ratelimit
from serving import keys as keymat
from serving import services as svc

log = logging.getLogger("atrium.gateway")

FAST = {f"/v1/{name}": spec for name, spec in gateway.PROXIED.items()}


class _State:
    http: aiohttp.ClientSession
    redis: aredis.Redis
    admit: object
    threads: ThreadPoolExecutor
    headers: dict[bool, list[tuple[bytes, bytes]]]  # secure request? -> what Django's middleware adds


state = _State()


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http":
        raise ValueError(f"{scope['type']} is not served here")
    route = FAST.get(scope["path"]) if scope["method"] == "POST" else None
    body = None
    if route is not None:
        body = await _read_body(receive)
        try:
            if await _answer_fast(scope, route, body, send):
                return
        except Exception:  # a bug: answer in the API's shape, as serving.gateway.gateway_view does
            rid = _request_id(_headers(scope))
            log.exception("gateway error (request %s)", rid)
            await _send_error(send, gateway.GatewayError(500, f"Internal gateway error (request {rid}).",
                                                         type_="server_error", code="internal_error"),
                              _is_secure(scope, _headers(scope)), rid)
            return
    await _DjangoRequest(django_application)(scope, receive, send, body)


# --- the fast path ----------------------------------------------------------------------


async def _answer_fast(scope, route, raw: bytes, send) -> bool:
    """Answer the request (True), or leave it untouched for Django (False)."""
    endpoint, path, check = route
    headers = _headers(scope)
    secure = _is_secure(scope, headers)
    if not _host_allowed(headers) or (settings.SECURE_SSL_REDIRECT and not secure):
        return False  # Django answers 400 DisallowedHost or redirects to HTTPS
    try:
        gateway.check_body_headers(_content_type(headers), headers.get("content-length"))
        token = gateway.bearer_token(headers.get("authorization", ""))
        body = gateway.parse_json_body(raw)
    except gateway.GatewayError:
        return False
    if not keymat.well_formed(token):
        return False
    named = gateway.model_name(body.get("model"))
    digest = keymat.digest(token)
    caller = svc.cached_caller(digest, named)
    if caller is None:
        return False  # the database check, which keeps its result for the next requests
    try:
        service = gateway._service(caller, body.get("model"))
        check(body)
    except gateway.GatewayError:
        return False  # decided on the database's word, not on memory
    if body.get("stream") and endpoint != "embeddings":
        return False
    rid = _request_id(headers)
    limits, checks = gateway.admission_checks(caller)
    ticket = caller.ticket
    try:
        outcome = await ratelimit.admit_cached_async(
            state.redis, state.admit, checks, generation=ticket.generation, project_id=caller.key.project_id,
            month=ticket.month, month_base=ticket.month_base, budget=limits.monthly_token_budget,
            month_counter=ticket.month_counter)
    except RedisError:
        log.exception("gateway dependency unavailable (request %s)", rid)
        await _send_error(send, gateway.unavailable(), secure, rid)
        return True
    if isinstance(outcome, ratelimit.Stale):
        authcache.forget(digest, named)
        return False
    if isinstance(outcome, ratelimit.OverBudget):
        return False  # nothing was counted; Django refuses it and raises the alarm
    if outcome is not None:
        await _send_error(send, gateway.rate_limited(outcome), secure, rid)
        return True
    uid = uuid.uuid4()
    try:
        status, answer = await _post(service, path, gateway.upstream_body(service, body, endpoint))
        if status != 200:
            raise gateway.upstream_error(service, status)
        payload = gateway.upstream_payload(answer)
    except gateway.GatewayError as exc:
        await _send_error(send, exc, secure, rid)
        return True
    usage = payload.get("usage")
    payload["model"] = service.slug
    try:
        await _send_json(send, 200, payload, secure, rid)
    finally:  # answered, or the client went away after the model server answered: metered, as under gunicorn
        try:
            gateway.meter_usage(rid, caller.key, service, endpoint, uid, usage, checks)
        except Exception:
            log.exception("gateway request %s was answered but could not be metered", uid)
    return True


async def _post(service, path: str, body: dict) -> tuple[int, bytes]:
    """serving.gateway._post on the event loop: same timeouts, retries and errors."""
    data = json.dumps(body, allow_nan=False).encode()
    timeout = aiohttp.ClientTimeout(sock_connect=service.connect_timeout, sock_read=service.read_timeout)
    url = service.upstream_url.rstrip("/") + path
    for attempt in range(gateway.RETRIES + 1):
        last = attempt == gateway.RETRIES
        try:
            async with state.http.post(url, data=data, headers=gateway._JSON, timeout=timeout,
                                       allow_redirects=False) as resp:
                if resp.status in (502, 503) and not last:
                    await resp.read()
                else:
                    return resp.status, await resp.read()
        except aiohttp.SocketTimeoutError:  # connected, no answer within the read timeout
            raise gateway.upstream_timeout() from None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:  # refused, reset, bad URL
            if last:
                raise gateway.upstream_unreachable(service, exc) from None
        await asyncio.sleep(gateway.BACKOFF * (attempt + 1))
    raise AssertionError("unreachable")


async def _send_json(send, status: int, payload: dict, secure: bool, rid: str, extra: dict | None = None) -> None:
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
               *state.headers[secure], (b"x-request-id", rid.encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _send_error(send, exc: gateway.GatewayError, secure: bool, rid: str) -> None:
    payload = gateway.error_payload(exc.message, type_=exc.type, code=exc.code, param=exc.param)
    await _send_json(send, exc.status, payload, secure, rid, exc.headers)


# --- the request as Django's middleware would see it ------------------------------------


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def _content_type(headers: dict) -> str:
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _is_secure(scope, headers: dict) -> bool:
    """HttpRequest.is_secure(): the trusted proxy's header when one is configured, else the scheme."""
    if settings.SECURE_PROXY_SSL_HEADER:
        name, expected = settings.SECURE_PROXY_SSL_HEADER
        value = headers.get(name.removeprefix("HTTP_").replace("_", "-").lower())
        if value is not None:
            return value.split(",", 1)[0].strip() == expected
    return scope.get("scheme") == "https"


def _host_allowed(headers: dict) -> bool:
    """HttpRequest.get_host()'s check (false: Django answers it, with its 400)."""
    host = headers.get("x-forwarded-host") if settings.USE_X_FORWARDED_HOST else None
    host = host or headers.get("host", "")
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    domain, _ = split_domain_port(host)
    return bool(domain) and validate_host(domain, allowed)


def _request_id(headers: dict) -> str:
    return request_id_from(headers.get("x-request-id", ""))


def _gateway_headers(secure: bool) -> list[tuple[bytes, bytes]]:
    """What Django adds to a /v1/ answer: SecurityMiddleware's headers, then
    portal.middleware.GatewayShortPathMiddleware's X-Frame-Options and CSP."""
    request = RequestFactory().get("/v1/models", secure=secure)
    response = SecurityMiddleware(lambda r: HttpResponse()).process_response(request, HttpResponse())
    response.headers.setdefault("X-Frame-Options", settings.X_FRAME_OPTIONS)
    response.headers.setdefault("Content-Security-Policy", GATEWAY_CSP)
    return [(k.lower().encode(), v.encode()) for k, v in response.headers.items() if k.lower() != "content-type"]


async def _read_body(receive) -> bytes:
    """The request body, at most MAX_BODY + 1 bytes of it (more is refused with 413 either way)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        if size <= gateway.MAX_BODY:
            chunks.append(chunk)
            size += len(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)[: gateway.MAX_BODY + 1]


# --- everything else: the Django application, in a thread -------------------------------


class _DjangoRequest(WsgiToAsgiInstance):
    """asgiref's WSGI bridge (its environ and start_response) with three differences: it runs in
    this process's thread pool (asgiref runs every request on one thread), it closes the
    response as PEP 3333 requires (Django's request_finished, and serving.gateway's metering
    of an answered request, happen there; asgiref never closes it), and it replays a body the
    fast path already read."""

    async def __call__(self, scope, receive, send, body: bytes | None = None):
        self.scope = scope
        loop = asyncio.get_running_loop()
        self.sync_send = lambda message: asyncio.run_coroutine_threadsafe(send(message), loop).result()
        if body is not None:
            await loop.run_in_executor(state.threads, self._run, io.BytesIO(body))
            return
        with SpooledTemporaryFile(max_size=65536) as spool:  # all of it, as asgiref reads it: Django limits it
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away before its request was complete
                spool.write(message.get("body", b""))
                if not message.get("more_body"):
                    break
            spool.seek(0)
            await loop.run_in_executor(state.threads, self._run, spool)

    def _run(self, body) -> None:
        try:
            environ = self.build_environ(self.scope, body)
        except ValueError:  # more duplicate headers than asgiref accepts
            self.sync_send({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"text/plain")]})
            self.sync_send({"type": "http.response.body", "body": b"Bad Request"})
            return
        result = self.wsgi_application(environ, self.start_response)
        try:
            for output in result:
                if not self.response_started:
                    self.response_started = True
                    self.sync_send(self.response_start)
                if output:
                    self.sync_send({"type": "http.response.body", "body": output, "more_body": True})
            if not self.response_started:
                self.response_started = True
                self.sync_send(self.response_start)
            self.sync_send({"type": "http.response.body"})
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()


# --- start and stop ---------------------------------------------------------------------


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            state.threads = ThreadPoolExecutor(max_workers=settings.ATRIUM_GATEWAY_DJANGO_THREADS,
                                               thread_name_prefix="atrium-django")
            state.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False)
            state.redis = aredis.Redis.from_url(settings.REDIS_URL, socket_timeout=0.5, socket_connect_timeout=0.5)
            state.admit = ratelimit.admit_script(state.redis)
            state.headers = {secure: _gateway_headers(secure) for secure in (False, True)}
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            # in-flight requests have been answered (the server waits for them); write what they metered
            await asyncio.get_running_loop().run_in_executor(None, meterwriter.writer.stop)
            await state.http.close()
            await state.redis.aclose()
            state.threads.shutdown(wait=True)
            await send({"type": "lifespan.shutdown.complete"})
            return

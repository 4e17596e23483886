"""The OpenAI-compatible gateway: /v1/models, /v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/applications/<slug>/chat and /v1/knowledge_bases/<id>/search.

Every request: Bearer key -> serving.services.authenticate_key (the key, its project, tenant,
limits, creator's membership, the named service inside the key's tenant with the key's scope
on it, and the month's tokens in one prepared statement; for the proxied endpoints possibly
from memory, serving.authcache, validated by the admission below or the request starts again
from the database) -> another tenant's object answers 404, a known one outside the key's
scope 403 -> monthly budget -> Redis rate limits (429 + Retry-After) -> proxy with connect/read timeouts and
bounded retries (one urllib3 pool per process, kept-alive connections) -> the answer -> meter
the upstream's `usage` exactly once when the server has written the answer (MeteredResponse;
a stream when it ends), handed to the process's metering writer (serving.meterwriter) so the
client's connection is free for its next request. Errors are JSON in OpenAI's shape;
upstream failures become 502/504 without their internals, and are never billed. This view
never trusts a tenant, project or id from the client and never logs a key. It reads no
session: portal.middleware.GatewayShortPathMiddleware sends it requests past the session,
CSRF and page middleware.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import urllib3
from django.conf import settings
from django.db import DatabaseError
from django.db.models import Q
from django.http import JsonResponse, StreamingHttpResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from redis.exceptions import RedisError

from serving import meterwriter, ratelimit
from serving import services as svc
from serving.models import ApiKey, Application, ModelService, ServiceStatus, Visibility

log = logging.getLogger("atrium.gateway")

MAX_BODY = getattr(settings, "ATRIUM_GATEWAY_MAX_BODY_BYTES", 1024 * 1024)
RETRIES = 2  # extra attempts after a connection failure or a 502/503 from the upstream
BACKOFF = 0.05


class GatewayError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def response(self) -> JsonResponse:
        return error_response(self.status, self.message, type_=self.type, code=self.code, param=self.param,
                              headers=self.headers)


def error_payload(message: str, *, type_: str = "invalid_request_error", code: str | None = None,
                  param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, *, type_: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None, headers: dict | None = None) -> JsonResponse:
    resp = JsonResponse(error_payload(message, type_=type_, code=code, param=param), status=status)
    for k, v in (headers or {}).items():
        resp[k] = v
    return resp


def unavailable() -> GatewayError:
    return GatewayError(503, "The gateway is temporarily unavailable; retry shortly.", type_="server_error",
                        code="service_unavailable", headers={"Retry-After": "5"})


def gateway_view(methods: tuple[str, ...]):
    """csrf_exempt, method check, and the promise that nothing escapes as an HTML error page."""

    def wrap(fn):
        @csrf_exempt
        def view(request, *args, **kwargs):
            if request.method not in methods:
                return error_response(405, f"Use {' or '.join(methods)} here.", headers={"Allow": ", ".join(methods)})
            try:
                try:
                    return fn(request, *args, **kwargs)
                except (GatewayError, StaleCaller):
                    if not getattr(request, "atrium_unvalidated", False):
                        raise
                    # decided on a key check from memory that the admission script has not
                    # validated (serving.authcache): check the key in the database and start again
                    request.atrium_refresh, request.atrium_unvalidated = True, False
                    return fn(request, *args, **kwargs)
            except GatewayError as exc:
                return exc.response()
            except (DatabaseError, RedisError):
                log.exception("gateway dependency unavailable (request %s)", getattr(request, "request_id", ""))
                return unavailable().response()
            except Exception:  # a bug: answer in the API's shape, with the id to find it in the log
                log.exception("gateway error (request %s)", getattr(request, "request_id", ""))
                return error_response(500, f"Internal gateway error (request {getattr(request, 'request_id', '')}).",
                                      type_="server_error", code="internal_error")

        view.__name__ = fn.__name__
        view.__doc__ = fn.__doc__
        view.key_authenticated = True  # portal.middleware.GatewayShortPathMiddleware: no session middleware
        return view

    return wrap


# --- request parsing and authorisation --------------------------------------------------


def _bearer(request) -> str:
    return bearer_token(request.META.get("HTTP_AUTHORIZATION", ""))


def bearer_token(header: str) -> str:
    if not header:
        raise GatewayError(401, "No API key provided. Send 'Authorization: Bearer atr_...'.", code="invalid_api_key")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise GatewayError(401, "Malformed Authorization header; expected 'Bearer <key>'.", code="invalid_api_key")
    return token.strip()


class StaleCaller(Exception):
    """The key check from memory is no longer current (serving.ratelimit.admit_cached)."""


def _authenticate(request, *, model=None, cache: bool = False) -> svc.Caller:
    """The caller behind the Bearer key (401/403 when it cannot be used), with the service named
    `model` looked up inside the key's tenant in the same statement. With `cache` (the proxied
    endpoints, which all pass _admit) it may come from memory, unvalidated until _admit."""
    token = _bearer(request)
    named = model_name(model)
    try:
        caller = svc.authenticate_key(token, service=named, cache=cache,
                                      refresh=getattr(request, "atrium_refresh", False))
    except svc.KeyRejected as exc:
        raise GatewayError(exc.status, str(exc), code=exc.code) from None
    request.atrium_unvalidated = caller.ticket is not None
    return caller


def model_name(model) -> str | None:
    """The service name a request's `model` can be looked up by (None: no service has it)."""
    return model if isinstance(model, str) and 0 < len(model) <= 200 and "\x00" not in model else None


def _authenticate_with_body(request) -> tuple[svc.Caller, dict]:
    """Key and body of a POST that names its model: an unusable key answers 401 before a bad body."""
    _bearer(request)
    try:
        body, problem = _json_body(request), None
    except GatewayError as exc:
        body, problem = {}, exc
    caller = _authenticate(request, model=body.get("model"), cache=True)
    if problem is not None:
        raise problem
    return caller, body


def _json_body(request) -> dict:
    check_body_headers(request.content_type, request.META.get("CONTENT_LENGTH"))
    raw = getattr(request, "atrium_body", None)
    if raw is None:  # read once: a request started again (gateway_view) parses the same bytes
        raw = request.atrium_body = request.read(MAX_BODY + 1)
    return parse_json_body(raw)


def check_body_headers(content_type: str, content_length: str | None) -> None:
    if content_type != "application/json":
        raise GatewayError(415, "Send the request body as application/json.", code="unsupported_media_type")
    try:
        declared = int(content_length or 0)
    except ValueError:
        raise GatewayError(400, "Invalid Content-Length.") from None
    if declared > MAX_BODY:
        raise GatewayError(413, f"Request body too large (limit {MAX_BODY} bytes).", code="request_too_large")


def parse_json_body(raw: bytes) -> dict:
    """The request's JSON object, from at most MAX_BODY + 1 bytes of it."""
    if len(raw) > MAX_BODY:
        raise GatewayError(413, f"Request body too large (limit {MAX_BODY} bytes).", code="request_too_large")
    try:
        # NaN/Infinity and 1e999 are not JSON (RFC 8259) and could not be forwarded; a deeply
        # nested body exhausts the parser's recursion: both are the client's malformed JSON
        body = json.loads(raw, parse_constant=_not_json, parse_float=_finite_float)
    except (ValueError, RecursionError):
        raise GatewayError(400, "The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def _not_json(token: str):
    raise ValueError(f"{token} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("number out of range")
    return value


MAX_TOKENS_LIMIT = 1_000_000


def _check_generation_params(body: dict) -> None:
    """Refuse what no model server can honour, before it costs an upstream call."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS_LIMIT:
            raise GatewayError(400, f"'{name}' must be an integer from 1 to {MAX_TOKENS_LIMIT}.", param=name)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise GatewayError(400, "'stream' must be true or false.", param="stream")


def _reachable(key: ApiKey, service: ModelService) -> bool:
    return (service.tenant_id == key.tenant_id and service.status == ServiceStatus.PUBLISHED
            and (service.project_id == key.project_id or service.visibility == Visibility.TENANT))


def _service(caller: svc.Caller, model) -> ModelService:
    if not isinstance(model, str) or not model:
        raise GatewayError(400, "Say which model to call in 'model'.", param="model", code="missing_model")
    # looked up with the key, inside the key's tenant: another tenant's service of the same
    # name is not found; the key's scope on it came back in the same statement
    service = caller.service
    if service is None or not _reachable(caller.key, service):
        raise GatewayError(404, f"The model '{model[:80]}' does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
    if not caller.service_in_scope:
        _scope_denied(service)
    return service


def _scope_rows(key: ApiKey):
    return ApiKey.services.through.objects.filter(apikey_id=key.pk)


def _require_scope(key: ApiKey, service: ModelService) -> None:
    if not _scope_rows(key).filter(modelservice_id=service.pk).exists():
        _scope_denied(service)


def _scope_denied(service: ModelService):
    raise GatewayError(403, f"This API key is not allowed to call '{service.slug}'.", param="model",
                       code="scope_denied", type_="permission_error")


def _admit(request, caller: svc.Caller) -> list[ratelimit.Limit]:
    """Monthly budget, then per-key and per-project rate limits. Returns the limits to add tokens to.
    A key check from memory is validated here, in the same Redis round trip (StaleCaller if not)."""
    key = caller.key
    limits, checks = admission_checks(caller)
    ticket = caller.ticket
    if ticket is not None:
        outcome = ratelimit.admit_cached(checks, generation=ticket.generation, project_id=key.project_id,
                                         month=ticket.month, month_base=ticket.month_base,
                                         budget=limits.monthly_token_budget, month_counter=ticket.month_counter)
        if isinstance(outcome, ratelimit.Stale):
            raise StaleCaller()
        request.atrium_unvalidated = False
        if isinstance(outcome, ratelimit.OverBudget):
            _over_budget(key, limits, outcome.used)
        refusal = outcome
    else:
        if limits.monthly_token_budget is not None:
            used = caller.month_tokens if caller.month_tokens is not None else svc.tokens_this_month(key.project)
            if used >= limits.monthly_token_budget:
                _over_budget(key, limits, used)
        refusal = ratelimit.check(checks)
    if refusal is not None:
        raise rate_limited(refusal)
    return checks


def admission_checks(caller: svc.Caller) -> tuple:
    """(the project's serving limits, the rate limits a request of this caller counts against)."""
    key = caller.key
    limits = svc.limits_for(key.project)
    return limits, [
        ratelimit.Limit("key", key.pk, key.requests_per_minute, key.tokens_per_minute),
        ratelimit.Limit("project", key.project_id, limits.requests_per_minute, limits.tokens_per_minute),
    ]


def rate_limited(refusal: ratelimit.Refusal) -> GatewayError:
    return GatewayError(429, refusal.message, type_="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(refusal.retry_after)})


def _over_budget(key: ApiKey, limits, used: int):
    svc.raise_budget_alarm(key, used, limits.monthly_token_budget)
    now = timezone.now()
    nxt = (svc.month_start(now) + timezone.timedelta(days=32)).replace(day=1)
    raise GatewayError(
        429, f"Project {key.project.slug} has used its monthly token budget ({used} of "
             f"{limits.monthly_token_budget} tokens). Ask a tenant admin to raise it.",
        type_="insufficient_quota", code="budget_exceeded",
        headers={"Retry-After": str(int((nxt - now).total_seconds()))},
    )


# --- upstream ---------------------------------------------------------------------------

# One connection pool per model server and process, shared by its threads: kept-alive
# connections, never a proxy from the environment, no redirects followed, retries done below.
_pools: dict[str, tuple[urllib3.HTTPConnectionPool, str]] = {}
_pools_lock = threading.Lock()
_JSON = {"Content-Type": "application/json", "Accept": "application/json"}


def _pool(upstream_url: str) -> tuple[urllib3.HTTPConnectionPool, str]:
    """(the pool of this model server, the path prefix of its API), made once per URL."""
    found = _pools.get(upstream_url)
    if found is None:
        prefix = urllib3.util.parse_url(upstream_url).path or ""
        pool = urllib3.connection_from_url(upstream_url, maxsize=64, block=False, retries=False)
        with _pools_lock:
            if len(_pools) > 256:  # URLs changed many times over: start again rather than grow
                _pools.clear()
            found = _pools.setdefault(upstream_url, (pool, prefix.rstrip("/")))
    return found


def _post(service: ModelService, path: str, body: dict, *, stream: bool = False) -> urllib3.BaseHTTPResponse:
    data = json.dumps(body, allow_nan=False).encode()
    timeout = urllib3.Timeout(connect=service.connect_timeout, read=service.read_timeout)
    for attempt in range(RETRIES + 1):
        last = attempt == RETRIES
        try:
            pool, prefix = _pool(service.upstream_url)
            resp = pool.urlopen("POST", prefix + path, body=data, headers=_JSON, timeout=timeout, retries=False,
                                redirect=False, preload_content=not stream)
        except urllib3.exceptions.ReadTimeoutError:
            raise upstream_timeout() from None
        except urllib3.exceptions.HTTPError as exc:  # refused, reset, connect timeout, bad URL
            if last:
                raise upstream_unreachable(service, exc) from None
            time.sleep(BACKOFF * (attempt + 1))
            continue
        if resp.status in (502, 503) and not last:
            _discard(resp)
            time.sleep(BACKOFF * (attempt + 1))
            continue
        return resp
    raise AssertionError("unreachable")


def upstream_timeout() -> GatewayError:
    return GatewayError(504, "The model server did not answer in time; the request was not billed.",
                        type_="server_error", code="upstream_timeout")


def upstream_unreachable(service: ModelService, exc: Exception) -> GatewayError:
    log.warning("upstream %s unreachable: %s", service.slug, type(exc).__name__)
    return GatewayError(502, "The model server is unreachable; the request was not billed.", type_="server_error",
                        code="upstream_unavailable")


def upstream_payload(raw: bytes) -> dict:
    """The model server's JSON answer (502 when it is not a JSON object)."""
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        raise GatewayError(502, "The model server sent an invalid answer; the request was not billed.",
                           type_="server_error", code="upstream_invalid")
    return payload


def upstream_body(service: ModelService, body: dict, endpoint: str) -> dict:
    """The request as the model server gets it: its own model name; embeddings never stream."""
    body = dict(body)
    body["model"] = service.model_name_upstream
    if endpoint == "embeddings":
        body.pop("stream", None)
    return body


def _discard(resp: urllib3.BaseHTTPResponse) -> None:
    """Give the connection back: reusable when the answer was read to its end, closed otherwise."""
    if not resp.isclosed():
        resp.close()
    resp.release_conn()


def _upstream_failure(service: ModelService, resp: urllib3.BaseHTTPResponse) -> GatewayError:
    status = resp.status
    _discard(resp)
    return upstream_error(service, status)


def upstream_error(service: ModelService, status: int) -> GatewayError:
    """What the client is told when the model server answered `status` (not 200); never billed."""
    log.warning("upstream %s answered %s", service.slug, status)
    if status == 429:
        return GatewayError(503, "The model server is overloaded; retry shortly. The request was not billed.",
                            type_="server_error", code="upstream_overloaded", headers={"Retry-After": "2"})
    if 400 <= status < 500:
        return GatewayError(400 if status not in (404, 413, 422) else status,
                            f"The model server rejected the request (HTTP {status}); it was not billed.",
                            code="upstream_rejected")
    return GatewayError(502, "The model server failed; the request was not billed.", type_="server_error",
                        code="upstream_error")


def _usage_counts(usage, endpoint: str) -> tuple[int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None
    p = usage.get("prompt_tokens")
    c = usage.get("completion_tokens", 0 if endpoint == "embeddings" else None)
    if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (p, c)):
        return p, c
    return None, None


def _meter(request, key, service, endpoint, uid, usage, checks, application=None, note="") -> None:
    meter_usage(getattr(request, "request_id", ""), key, service, endpoint, uid, usage, checks, application, note)


def meter_usage(request_id, key, service, endpoint, uid, usage, checks, application=None, note="") -> None:
    """Hand an answered request to the metering writer, with the upstream's `usage` as counted."""
    inp, out = _usage_counts(usage, endpoint)
    meterwriter.meter(svc.usage_of(uid=uid, key=key, service=service, endpoint=endpoint, input_tokens=inp,
                                   output_tokens=out, application=application, note=note,
                                   request_id=request_id), checks)


def _proxy(request, caller: svc.Caller, service: ModelService, body: dict, endpoint: str, path: str, *,
           application: Application | None = None, extra: dict | None = None):
    key = caller.key
    checks = _admit(request, caller)
    uid = uuid.uuid4()  # the gateway's own id: the client cannot make two requests count as one
    body = upstream_body(service, body, endpoint)
    if body.get("stream"):
        return _proxy_stream(request, key, service, body, endpoint, path, uid, checks, application)
    resp = _post(service, path, body)
    if resp.status != 200:
        raise _upstream_failure(service, resp)
    payload = upstream_payload(resp.data)
    usage = payload.get("usage")
    payload["model"] = service.slug
    if extra:
        payload["atrium"] = extra
    return MeteredResponse(payload, uid=uid,
                           meter=lambda: _meter(request, key, service, endpoint, uid, usage, checks, application))


class MeteredResponse(JsonResponse):
    """An answer that meters its request when the WSGI server closes it.

    The server calls close() after the last byte is written (PEP 3333; gunicorn, uWSGI and
    wsgiref all do, also when writing failed), so metering is never between the model
    server's answer and the client. close() hands the request, once, to the process's
    metering writer (serving.meterwriter), which writes it exactly once (inside a caller's
    transaction it is written right there, on the caller's connection). A failure to meter
    is logged with the request's id (Django's close() would swallow it)."""

    def __init__(self, data, *, uid, meter):
        super().__init__(data)
        self.uid, self._meter = uid, meter

    def close(self):
        meter, self._meter = self._meter, None
        if meter is not None:
            try:
                meter()
            except Exception:
                log.exception("gateway request %s was answered but could not be metered", self.uid)
        super().close()


def _proxy_stream(request, key, service, body, endpoint, path, uid, checks, application):
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    resp = _post(service, path, body, stream=True)
    if resp.status != 200:
        raise _upstream_failure(service, resp)

    def events():
        usage = None
        note = ""
        buffer = b""
        try:
            for piece in resp.stream(None, decode_content=True):
                buffer += piece
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    out = _rewrite_event(event, service.slug, wants_usage)
                    if out is not None and out[1] is not None:
                        usage = out[1]
                    if out is not None and out[0] is not None:
                        yield out[0] + b"\n\n"
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            note = "upstream stream interrupted"
            log.warning("stream of request %s from %s interrupted: %s", uid, service.slug, type(exc).__name__)
            err = {"error": {"message": "The model server stream was interrupted.", "type": "server_error",
                             "param": None, "code": "upstream_interrupted"}}
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
        finally:
            _discard(resp)
            if usage is None and not note:
                note = "stream ended without usage (client went away or upstream did not report)"
            _meter(request, key, service, endpoint, uid, usage, checks, application, note=note)

    out = StreamingHttpResponse(events(), content_type="text/event-stream")
    out["Cache-Control"] = "no-cache"
    out["X-Accel-Buffering"] = "no"
    return out


def _rewrite_event(event: bytes, slug: str, wants_usage: bool) -> tuple[bytes | None, dict | None] | None:
    """(bytes to forward or None, usage reported in it or None)."""
    line = event.strip()
    if not line.startswith(b"data:"):
        return (event, None) if line else None
    data = line[5:].strip()
    if data == b"[DONE]":
        return b"data: [DONE]", None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
    if usage is not None and not obj.get("choices") and not wants_usage:
        return None, usage  # the client did not ask for the usage chunk: keep it for metering only
    if "model" in obj:
        obj["model"] = slug
    return b"data: " + json.dumps(obj).encode(), usage


# --- endpoints --------------------------------------------------------------------------


@gateway_view(("GET",))
def models(request):
    key = _authenticate(request).key
    services = (key.services.filter(tenant_id=key.tenant_id, status=ServiceStatus.PUBLISHED)
                .filter(Q(project_id=key.project_id) | Q(visibility=Visibility.TENANT)).order_by("slug"))
    data = [{"id": s.slug, "object": "model", "created": int((s.published or s.created).timestamp()),
             "owned_by": key.project.tenant.slug} for s in services]
    return JsonResponse({"object": "list", "data": data})


def _check_chat(body: dict) -> None:
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise GatewayError(400, "'messages' must be a non-empty list.", param="messages")
    _check_generation_params(body)


def _check_completion(body: dict) -> None:
    if not isinstance(body.get("prompt"), (str, list)):
        raise GatewayError(400, "'prompt' must be a string or a list of strings.", param="prompt")
    _check_generation_params(body)


def _check_embedding(body: dict) -> None:
    if not isinstance(body.get("input"), (str, list)):
        raise GatewayError(400, "'input' must be a string or a list.", param="input")


# The proxied OpenAI endpoints: (metering endpoint, path at the model server, body check).
# serving.dataplane serves the same table.
PROXIED = {
    "chat/completions": ("chat", "/chat/completions", _check_chat),
    "completions": ("completions", "/completions", _check_completion),
    "embeddings": ("embeddings", "/embeddings", _check_embedding),
}


def _proxied_view(name: str):
    endpoint, path, check = PROXIED[name]

    def view(request):
        caller, body = _authenticate_with_body(request)
        service = _service(caller, body.get("model"))
        check(body)
        return _proxy(request, caller, service, body, endpoint, path)

    view.__name__ = name.replace("/", "_")
    return gateway_view(("POST",))(view)


chat_completions = _proxied_view("chat/completions")
completions = _proxied_view("completions")
embeddings = _proxied_view("embeddings")


def _key_kbs(key: ApiKey):
    """Knowledge bases this key may read: shared with its project AND in its scope, its tenant only."""
    return svc.kbs_for_project(key.project).filter(
        pk__in=key.knowledge_bases.through.objects.filter(apikey_id=key.pk).values("knowledgebase_id"))


@gateway_view(("POST",))
def application_chat(request, slug: str):
    caller = _authenticate(request)
    key = caller.key
    body = _json_body(request)
    app = Application.objects.select_related("service").filter(project_id=key.project_id, slug=slug).first()
    if app is None:
        raise GatewayError(404, f"No application '{slug[:80]}' in this key's project.", code="application_not_found")
    service = app.service
    if not _reachable(key, service):
        raise GatewayError(404, "The application's model service is not available.", code="model_not_found")
    _require_scope(key, service)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise GatewayError(400, "'messages' must be a non-empty list of message objects.", param="messages")
    _check_generation_params(body)
    question = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    kb_ids = list(_key_kbs(key).filter(pk__in=app.knowledge_bases.values("pk")).values_list("pk", flat=True))
    hits = svc.search_chunks(tenant_id=key.tenant_id, kb_ids=kb_ids,
                             query=question if isinstance(question, str) else "", top_k=app.top_k)
    context = "\n---\n".join(h.text for h in hits)
    system = app.system_prompt + ("\n\nAnswer from this context:\n" + context if context else "")
    upstream_body = {k: v for k, v in body.items() if k not in ("messages", "model")}
    upstream_body["messages"] = ([{"role": "system", "content": system}] if system else []) + messages
    sources = [{"knowledge_base": h.knowledge_base, "document": h.document, "chunk": h.chunk_id,
                "score": round(h.score, 4)} for h in hits]
    return _proxy(request, caller, service, upstream_body, "application", "/chat/completions", application=app,
                  extra={"application": app.slug, "sources": sources})


@gateway_view(("POST",))
def kb_search(request, kb_id: int):
    caller = _authenticate(request)
    key = caller.key
    body = _json_body(request)
    kb = svc.kbs_for_project(key.project).filter(pk=kb_id).first()
    if kb is None:
        raise GatewayError(404, "No such knowledge base.", code="knowledge_base_not_found")
    if not key.knowledge_bases.filter(pk=kb.pk).exists():
        raise GatewayError(403, "This API key may not read this knowledge base.", type_="permission_error",
                           code="scope_denied")
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise GatewayError(400, "'query' must be a non-empty string.", param="query")
    top_k = body.get("top_k", 5)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 20:
        raise GatewayError(400, "'top_k' must be an integer from 1 to 20.", param="top_k")
    _admit(request, caller)
    hits = svc.search_chunks(tenant_id=key.tenant_id, kb_ids=[kb.pk], query=query, top_k=top_k)
    return JsonResponse({"object": "list", "knowledge_base": kb.slug, "data": [
        {"chunk": h.chunk_id, "document": h.document, "text": h.text, "score": round(h.score, 4)} for h in hits]})

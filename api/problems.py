"""RFC 9457 problem details: every error the API answers, with a stable `type` per kind.

Handlers here turn the exceptions that services and the framework raise (PermissionDenied,
Http404, Django and pydantic validation errors, authentication and rate-limit refusals) into
`application/problem+json`. A client branches on `type`, never on `detail` (a sentence for
people that may change). Nothing here decides access; it only says what was decided.
"""

from __future__ import annotations

import logging

from django.core.exceptions import PermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, HttpResponse, JsonResponse
from ninja import Schema
from ninja.errors import AuthenticationError, HttpError
from ninja.errors import ValidationError as NinjaValidationError

from portal.services import SudoRequired

log = logging.getLogger(__name__)

CONTENT_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:atrium:problem:"

# slug -> (status, title). The slugs are part of the API contract: never rename one.
PROBLEMS: dict[str, tuple[int, str]] = {
    "malformed-request": (400, "The request body cannot be parsed"),
    "unauthenticated": (401, "Authentication required"),
    "invalid-token": (401, "Invalid access token"),
    "insufficient-scope": (403, "The access token's scope does not allow this"),
    "forbidden": (403, "Not allowed"),
    "sudo-required": (403, "Recent re-authentication required"),
    "csrf-failed": (403, "CSRF check failed"),
    "not-found": (404, "Not found"),
    "method-not-allowed": (405, "Method not allowed"),
    "conflict": (409, "Conflicts with the current state"),
    "validation-error": (422, "The request is not valid"),
    "rate-limited": (429, "Too many requests"),
    "server-error": (500, "Internal error"),
}


class FieldError(Schema):
    field: str
    message: str


class Problem(Schema):
    """An RFC 9457 problem document."""

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[FieldError] | None = None
    retry_after: int | None = None


class ApiProblem(Exception):
    """Raised by endpoint code to answer a problem of one of the PROBLEMS kinds."""

    def __init__(self, slug: str, detail: str, *, errors: list[dict] | None = None, headers: dict | None = None,
                 retry_after: int | None = None):
        if slug not in PROBLEMS:  # a programming error, checked even under python -O
            raise ValueError(f"unknown problem kind {slug!r}")
        super().__init__(detail)
        self.slug, self.detail, self.errors, self.headers, self.retry_after = slug, detail, errors, headers or {}, retry_after


def problem_response(request, slug: str, detail: str, *, errors=None, headers=None, retry_after=None) -> HttpResponse:
    status, title = PROBLEMS[slug]
    body = {"type": TYPE_PREFIX + slug, "title": title, "status": status, "detail": detail,
            "instance": getattr(request, "path", None)}
    if errors is not None:
        body["errors"] = errors
    if retry_after is not None:
        body["retry_after"] = retry_after
    response = JsonResponse(body, status=status, content_type=CONTENT_TYPE)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="atrium"'
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    for k, v in (headers or {}).items():
        response[k] = v
    return response


def field_errors_from_django(exc: DjangoValidationError) -> list[dict]:
    if hasattr(exc, "error_dict"):
        return [{"field": "" if f == "__all__" else f, "message": m}
                for f, msgs in exc.message_dict.items() for m in msgs]
    return [{"field": "", "message": m} for m in exc.messages]


def _loc_to_field(loc) -> str:
    # ("body", "payload", "spec") -> "spec"; ("query", "limit") -> "limit"; list items keep their index
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie", "form"):
        parts = parts[1:]
    if parts and parts[0] == "payload":
        parts = parts[1:]
    return ".".join(parts) or "body"


def install(api) -> None:
    """Register the handlers on a NinjaAPI instance."""

    @api.exception_handler(ApiProblem)
    def _problem(request, exc: ApiProblem):
        return problem_response(request, exc.slug, exc.detail, errors=exc.errors, headers=exc.headers,
                                retry_after=exc.retry_after)

    @api.exception_handler(Http404)
    def _not_found(request, exc):
        return problem_response(request, "not-found", "No such object, or it is outside your reach.")

    @api.exception_handler(SudoRequired)
    def _sudo(request, exc):
        return problem_response(request, "sudo-required", f"{exc} Access tokens never carry a re-authentication; "
                                "use the portal for this change.")

    @api.exception_handler(PermissionDenied)
    def _denied(request, exc):
        return problem_response(request, "forbidden", str(exc) or "You may not do this.")

    @api.exception_handler(DjangoValidationError)
    def _invalid(request, exc):
        errors = field_errors_from_django(exc)
        detail = "; ".join(f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in errors)
        return problem_response(request, "validation-error", detail, errors=errors)

    @api.exception_handler(NinjaValidationError)
    def _schema_invalid(request, exc):
        errors = [{"field": _loc_to_field(e.get("loc", ())), "message": e.get("msg", "invalid")} for e in exc.errors]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return problem_response(request, "validation-error", detail, errors=errors)

    @api.exception_handler(AuthenticationError)
    def _unauthenticated(request, exc):
        return problem_response(request, "unauthenticated",
                                "Sign in to the portal, or send an access token as 'Authorization: Bearer atp_...'.")

    @api.exception_handler(HttpError)
    def _http(request, exc: HttpError):
        if exc.status_code == 403 and "CSRF" in str(exc):
            return problem_response(request, "csrf-failed",
                                    "A signed-in browser session must send the X-CSRFToken header on changes.")
        if exc.status_code == 400:
            return problem_response(request, "malformed-request", "The request body is not valid JSON.",
                                    errors=[{"field": "body", "message": str(exc)}])
        if exc.status_code == 405:
            return problem_response(request, "method-not-allowed", str(exc))
        slug = {401: "unauthenticated", 403: "forbidden", 404: "not-found", 409: "conflict",
                429: "rate-limited"}.get(exc.status_code, "validation-error" if exc.status_code < 500 else "server-error")
        return problem_response(request, slug, str(exc))

    @api.exception_handler(Exception)
    def _crash(request, exc):
        from portal.resilience import is_db_outage, unavailable_response

        if is_db_outage(exc):  # the database is away: 503 + Retry-After, not a 500
            return unavailable_response(request)
        log.exception("API request %s failed", getattr(request, "path", "?"))
        return problem_response(request, "server-error", "Something went wrong on our side; the request id names it.")


def documented(*statuses: int) -> dict:
    """Response map entries for the error statuses an operation may answer (for the schema)."""
    return {s: Problem for s in statuses}

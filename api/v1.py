"""Atrium's JSON API, version 1 (django-ninja): jobs, catalogue, quotas, audit, tokens and project API keys.

Every endpoint is thin in the way the pages are: rows come from tenants.access.visible_to
(so another tenant's object answers 404 exactly like a missing one), changes go through the
domain services (which check permission again and write the one audit event), and errors
leave as RFC 9457 problems (api.problems). State-changing calls pass api.ratelimit first.
This module must never write a model itself, except through api.tokens for tokens.
"""

from __future__ import annotations

import datetime as dt
import posixpath
from collections import defaultdict

from django.core.exceptions import ValidationError
from django.db.models import Q
from django.shortcuts import render
from django.utils import timezone
from ninja import NinjaAPI, Query, Status
from ninja.openapi.docs import Swagger

from api import ratelimit, tokens
from api.auth import AUTH, caller_scope, require_scope
from api.models import PersonalAccessToken, TokenScope
from api.problems import CONTENT_TYPE, ApiProblem, Problem, documented, install
from api.schemas import (
    NO_NUL,
    ApiKeyCreated,
    ApiKeyIn,
    ApiKeyOut,
    ApiKeyRevokeIn,
    AuditPage,
    CancelIn,
    JobDetail,
    JobIn,
    JobPage,
    Me,
    PriorityClassOut,
    ProjectOut,
    QuotaOut,
    SpecOut,
    TokenCreated,
    TokenIn,
    TokenOut,
)
from portal.models import AuditEvent
from scheduling import services as sched
from scheduling.models import Job, JobState, PriorityClass, Quota, QuotaResource, ResourceSpec
from serving import services as serving
from serving.models import ApiKey
from tenants import access
from tenants.models import PlatformRoleAssignment, Project

PROJECT_PERMS_SHOWN = ("view_project_jobs", "submit_job", "cancel_project_jobs", "view_project_usage", "manage_api_keys")


class SelfHostedSwagger(Swagger):
    """Swagger UI from our own static files (the CSP forbids the CDN ninja defaults to)."""

    template = "api/swagger.html"

    def render_page(self, request, api, **kwargs):
        self.settings["url"] = self.get_openapi_url(api, kwargs)
        return render(request, self.template, {"swagger_settings": self.settings, "api": api})


class AtriumAPI(NinjaAPI):
    def get_openapi_schema(self, *, path_prefix=None, path_params=None):
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        # problems are served as application/problem+json; say so in the schema too
        for item in schema.get("paths", {}).values():
            for op in item.values():
                for status, response in op.get("responses", {}).items():
                    content = response.get("content", {})
                    body = content.get("application/json")
                    if body and body.get("schema", {}).get("$ref", "").endswith("/Problem"):
                        response["content"] = {CONTENT_TYPE: body}
                        if str(status) == "429":
                            response["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                                                   "description": "seconds to wait"}}
        return schema


api = AtriumAPI(
    title="Atrium API",
    version="1",
    description="Jobs, quotas, resource specs and audit of the Atrium GPU portal. "
                "Authenticate with `Authorization: Bearer atp_...` (a personal access token) or the portal session "
                "(with the X-CSRFToken header on changes). Errors are RFC 9457 problem documents.",
    urls_namespace="api-v1",
    auth=AUTH,
    docs=SelfHostedSwagger(),
    docs_url="/docs",
    openapi_url="/openapi.json",
)
install(api)

READ_ERRORS = documented(401, 403, 422)
OBJECT_ERRORS = documented(401, 403, 404, 422)
CHANGE_ERRORS = documented(400, 401, 403, 404, 409, 422, 429)


# --- helpers --------------------------------------------------------------------------------


def _project_ref(p: Project) -> dict:
    return {"id": p.pk, "tenant": p.tenant.slug, "slug": p.slug}


def _job_out(job: Job) -> dict:
    return {
        "id": job.pk, "name": job.name, "kind": job.kind, "project": _project_ref(job.project),
        "submitter": job.submitter.get_username(), "spec": job.spec.name, "priority_class": job.priority_class.name,
        "replicas": job.replicas, "state": job.state, "wait_reason": job.wait_reason, "wait_message": job.wait_message,
        "queue_position": job.queue_position, "submitted": job.submitted, "started": job.started, "finished": job.finished,
    }


def _job_detail(job: Job) -> dict:
    bindings = job.bindings.select_related("accelerator__node", "accelerator__model")
    return {
        **_job_out(job),
        "image": job.image, "command": list(job.command or []), "expected_minutes": job.expected_minutes,
        "time_limit_minutes": job.time_limit_minutes, "admitted": job.admitted, "borrowed": job.borrowed,
        "preemptions": job.preemptions,
        "bindings": [{
            "replica": b.replica, "node": b.accelerator.node.name, "accelerator": b.accelerator.uuid,
            "accelerator_model": b.accelerator.model.name, "share": b.share_milli / 1000, "mig_profile": b.mig_profile,
            "start": b.start, "end": b.end, "end_reason": b.end_reason,
        } for b in bindings],
        "events": [{"time": e.time, "kind": e.kind, "message": e.message} for e in job.events.all()],
    }


def _jobs():
    # nosemgrep: atrium-queryset-outside-visible-to -- base queryset; callers narrow it with access or re-read a returned job
    return Job.objects.select_related("project__tenant", "submitter", "spec", "priority_class")


def _field_error(field: str, message: str) -> ApiProblem:
    return ApiProblem("validation-error", f"{field}: {message}", errors=[{"field": field, "message": message}])


def _is_id(raw: str) -> bool:
    # str.isdigit() is also true for "³" or "١", which int() refuses: ids are ASCII digits only
    return raw.isascii() and raw.isdigit() and len(raw) <= 18


def _resolve_project(user, raw: str) -> Project:
    """A project the caller can see, by id, "tenant/slug" or a slug unique among theirs.
    A project out of reach is answered exactly like one that does not exist."""
    visible = access.visible_to(user, Project).select_related("tenant")
    raw = raw.strip()
    if _is_id(raw):
        found = list(visible.filter(pk=int(raw)))
    elif "/" in raw:
        tenant, _, slug = raw.partition("/")
        found = list(visible.filter(tenant__slug=tenant, slug=slug))
    else:
        found = list(visible.filter(slug=raw))
        if len(found) > 1:
            raise _field_error("project", f"several of your projects are called {raw!r}; write tenant/{raw}")
    if not found:
        raise _field_error("project", f"no project {raw!r} within your reach")
    return found[0]


def _resolve_spec(raw: str) -> ResourceSpec:
    specs = ResourceSpec.objects.filter(active=True)
    spec = specs.filter(pk=int(raw)).first() if _is_id(raw) else specs.filter(name=raw).first()
    if spec is None:
        names = ", ".join(specs.values_list("name", flat=True)[:20])
        raise _field_error("spec", f"no active resource spec {raw!r} (choose one of: {names})")
    return spec


def _changing(request, scope: str = TokenScope.SUBMIT) -> None:
    require_scope(request, scope)
    ratelimit.check(request)


# --- who am I, projects, catalogue ------------------------------------------------------------


@api.get("/me", response={200: Me, **READ_ERRORS}, tags=["identity"], summary="The calling person and credential")
def me(request):
    token = getattr(request, "api_token", None)
    roles = list(PlatformRoleAssignment.objects.filter(user=request.user).values_list("role", flat=True))
    return {"username": request.user.get_username(), "email": request.user.email or "",
            "auth": "token" if token else "session", "token_scope": token.scope if token else None,
            "token_expires": token.expires if token else None, "platform_roles": sorted(roles)}


@api.get("/projects", response={200: list[ProjectOut], **READ_ERRORS}, tags=["catalogue"],
         summary="Projects within the caller's reach")
def project_list(request):
    user = request.user
    out = []
    for p in access.visible_to(user, Project).select_related("tenant"):
        perms = [perm for perm in PROJECT_PERMS_SHOWN if access.can(user, perm, p)]
        out.append({**_project_ref(p), "name": p.name, "project_class": p.project_class, "active": p.is_active,
                    "permissions": perms})
    return out


@api.get("/specs", response={200: list[SpecOut], **READ_ERRORS}, tags=["catalogue"],
         summary="Active resource specs (the catalogue every project picks from)")
def spec_list(request):
    out = []
    for s in ResourceSpec.objects.filter(active=True).prefetch_related("accelerator_models"):
        out.append({
            "id": s.pk, "name": s.name, "description": s.description, "mode": s.mode, "gpu_count": s.gpu_count,
            "mig_profile": s.mig_profile, "card_fraction": round(s.card_fraction, 4), "cpu_cores": s.cpu_milli / 1000,
            "memory_gib": round(s.memory_mib / 1024, 3), "accelerator_models": [m.name for m in s.accelerator_models.all()],
            "isolation": s.isolation,
        })
    return out


@api.get("/projects/{project_id}/priority-classes", response={200: list[PriorityClassOut], **OBJECT_ERRORS},
         tags=["catalogue"], summary="Priority classes the caller may use in this project")
def priority_class_list(request, project_id: int):
    project = access.get_visible_or_404(request.user, Project.objects.select_related("tenant"), pk=project_id)
    allowed = sched.allowed_priority_classes(request.user, project) if access.can(request.user, "submit_job", project) else []
    return [{"name": pc.name, "value": pc.value, "preemptible": pc.preemptible, "description": pc.description}
            for pc in allowed]


# --- jobs --------------------------------------------------------------------------------------


@api.get("/jobs", response={200: JobPage, **READ_ERRORS}, tags=["jobs"], summary="Jobs within reach, newest first")
def job_list(
    request,
    state: JobState | None = None,
    project: int | None = Query(None, description="project id"),
    mine: bool = Query(False, description="only jobs the caller submitted"),
    q: str = Query("", max_length=120, pattern=NO_NUL, description="part of the job name"),
    limit: int = Query(25, ge=1, le=200),
    offset: int = Query(0, ge=0, le=1_000_000),
):
    jobs = access.visible_to(request.user, _jobs())
    if state:
        jobs = jobs.filter(state=state)
    if project is not None:
        jobs = jobs.filter(project_id=project)
    if mine:
        jobs = jobs.filter(submitter=request.user)
    if q:
        jobs = jobs.filter(name__icontains=q)
    jobs = jobs.order_by("-submitted", "-id")
    return {"count": jobs.count(), "limit": limit, "offset": offset,
            "items": [_job_out(j) for j in jobs[offset:offset + limit]]}


@api.post("/jobs", response={201: JobDetail, **CHANGE_ERRORS}, tags=["jobs"],
          summary="Submit a job (scope submit)", description="Stored PENDING; a scheduling cycle decides when it runs.")
def job_submit(request, payload: JobIn):
    _changing(request)
    project = _resolve_project(request.user, payload.project)
    spec = _resolve_spec(payload.spec)
    pc = PriorityClass.objects.filter(name=payload.priority_class).first()
    if pc is None:
        allowed = ", ".join(p.name for p in sched.allowed_priority_classes(request.user, project)) or "none"
        raise _field_error("priority_class", f"no priority class {payload.priority_class!r} (yours here: {allowed})")
    name = payload.name.strip() or posixpath.basename(payload.command[0])[:120] or "job"
    job = sched.submit_job(
        request.user, project=project, spec=spec, priority_class=pc, name=name, image=payload.image,
        command=payload.command, replicas=payload.replicas, expected_minutes=payload.expected_minutes,
        time_limit_minutes=payload.time_limit_minutes,
    )
    return Status(201, _job_detail(_jobs().get(pk=job.pk)))


@api.get("/jobs/{job_id}", response={200: JobDetail, **OBJECT_ERRORS}, tags=["jobs"],
         summary="One job with its wait reason, bindings and events")
def job_detail(request, job_id: int):
    return _job_detail(access.get_visible_or_404(request.user, _jobs(), pk=job_id))


@api.post("/jobs/{job_id}/cancel", response={200: JobDetail, **CHANGE_ERRORS}, tags=["jobs"],
          summary="Cancel a job (scope submit)")
def job_cancel(request, job_id: int, payload: CancelIn | None = None):
    _changing(request)
    job = access.get_visible_or_404(request.user, _jobs(), pk=job_id)
    if job.is_final:
        raise ApiProblem("conflict", f"Job {job.pk} is already {job.state}.")
    try:
        sched.cancel_job(request.user, job, reason=(payload.reason if payload else "").strip())
    except ValidationError as exc:
        if hasattr(exc, "error_dict") and "state" in exc.error_dict:
            raise ApiProblem("conflict", " ".join(exc.messages))
        raise
    return _job_detail(_jobs().get(pk=job.pk))


# --- quotas ------------------------------------------------------------------------------------


@api.get("/quotas", response={200: list[QuotaOut], **READ_ERRORS}, tags=["quotas"],
         summary="Quota lines of the caller's tenants and projects, with current use")
def quota_list(request, tenant: str | None = Query(None, max_length=40, pattern=NO_NUL, description="tenant slug"),
               project: int | None = Query(None, description="project id")):
    from portal.dashboard import _allocated  # the measure the scheduling cycle admits against

    lines = access.visible_to(request.user, Quota).select_related("tenant", "project", "accelerator_model")
    if tenant:
        lines = lines.filter(tenant__slug=tenant)
    if project is not None:
        lines = lines.filter(Q(project_id=project) | Q(project__isnull=True, tenant__projects=project))
    lines = list(lines.order_by("tenant__slug", "project__slug", "resource", "accelerator_model__name"))
    now = timezone.now()
    usage: dict[int, dict] = {}
    for tenant_id in {q.tenant_id for q in lines}:
        per_project = _allocated(Q(tenant_id=tenant_id), "project_id", now)
        total: dict = defaultdict(float)
        for values in per_project.values():
            for k, v in values.items():
                total[k] += v
        usage[tenant_id] = {"projects": per_project, "total": total}
    out = []
    for q in lines:
        key = f"gpus:{q.accelerator_model_id}" if q.resource == QuotaResource.GPUS else q.resource
        u = usage[q.tenant_id]
        in_use = (u["projects"].get(q.project_id, {}) if q.project_id else u["total"]).get(key, 0.0)
        out.append({
            "id": q.pk, "tenant": q.tenant.slug, "project": q.project.slug if q.project_id else None,
            "resource": q.resource, "accelerator_model": q.accelerator_model.name if q.accelerator_model_id else None,
            "guaranteed": float(q.guaranteed), "limit": float(q.limit), "in_use": round(float(in_use), 3),
        })
    return out


# --- audit ---------------------------------------------------------------------------------------


@api.get("/audit-events", response={200: AuditPage, **READ_ERRORS}, tags=["audit"],
         summary="Audit events (security admins and auditors: all; tenant admins: their tenant)")
def audit_list(
    request,
    action: str = Query("", max_length=80, pattern=NO_NUL, description="exact action, or a prefix ending in '.' (job.)"),
    outcome: str = Query("", max_length=10, pattern=NO_NUL),
    tenant: str = Query("", max_length=40, pattern=NO_NUL, description="tenant slug"),
    since: str = Query("", max_length=40, pattern=NO_NUL, description="ISO 8601 time; events at or after"),
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0, le=1_000_000),
):
    user = request.user
    if not (access.has_platform_perm(user, "view_all_audit") or access.tenant_ids(user, "view_tenant_audit")):
        raise ApiProblem("forbidden", "Reading audit events needs the auditor or security admin role, "
                                      "or tenant admin for one tenant.")
    events = access.visible_to(user, AuditEvent).select_related("tenant", "project")
    if action:
        events = events.filter(action__startswith=action) if action.endswith(".") else events.filter(action=action)
    if outcome:
        events = events.filter(outcome=outcome)
    if tenant:
        events = events.filter(tenant__slug=tenant)
    if since:
        from django.utils.dateparse import parse_datetime

        try:
            when = parse_datetime(since)
        except ValueError:
            when = None
        if when is None:
            raise _field_error("since", "not an ISO 8601 date-time, e.g. 2026-11-01T00:00:00Z")
        if timezone.is_naive(when):
            when = timezone.make_aware(when, dt.UTC)
        events = events.filter(time__gte=when)
    events = events.order_by("-id")
    items = [{
        "id": e.pk, "time": e.time, "actor": e.actor_label, "action": e.action, "outcome": e.outcome,
        "tenant": e.tenant.slug if e.tenant_id else None, "project": e.project.slug if e.project_id else None,
        "target_type": e.target_type, "target_id": e.target_id, "target_label": e.target_label, "reason": e.reason,
        "before": e.before, "after": e.after, "source_ip": e.source_ip, "request_id": e.request_id, "sudo": e.sudo,
    } for e in events[offset:offset + limit]]
    return {"count": events.count(), "limit": limit, "offset": offset, "items": items}


# --- personal access tokens ---------------------------------------------------------------------


def _token_out(t: PersonalAccessToken) -> dict:
    return {"id": t.pk, "name": t.name, "prefix": t.prefix, "scope": t.scope, "created": t.created,
            "expires": t.expires, "last_used": t.last_used, "revoked": t.revoked}


@api.get("/tokens", response={200: list[TokenOut], **READ_ERRORS}, tags=["tokens"],
         summary="The caller's own access tokens (never their secrets)")
def token_list(request):
    require_scope(request, TokenScope.ADMIN)
    return [_token_out(t) for t in PersonalAccessToken.objects.filter(user=request.user)]


@api.post("/tokens", response={201: TokenCreated, **CHANGE_ERRORS}, tags=["tokens"],
          summary="Create an access token for the caller (scope admin); the secret is in this answer only")
def token_create(request, payload: TokenIn):
    _changing(request, TokenScope.ADMIN)
    token, secret = tokens.create_token(request.user, name=payload.name, scope=payload.scope,
                                        days=payload.expires_in_days, max_scope=caller_scope(request))
    return Status(201, {"token": _token_out(token), "secret": secret})


@api.delete("/tokens/{token_id}", response={200: TokenOut, **CHANGE_ERRORS}, tags=["tokens"],
            summary="Revoke one of the caller's tokens (scope admin, or the token revoking itself)")
def token_revoke(request, token_id: int):
    current = getattr(request, "api_token", None)
    if current is None or current.pk != token_id:
        require_scope(request, TokenScope.ADMIN)
    ratelimit.check(request)
    token = PersonalAccessToken.objects.filter(user=request.user, pk=token_id).first()
    if token is None:
        raise ApiProblem("not-found", "No such object, or it is outside your reach.")
    if token.revoked is not None:
        raise ApiProblem("conflict", f"Token {token.prefix}… is already revoked.")
    return _token_out(tokens.revoke_token(request.user, token))


# --- API keys of a project ------------------------------------------------------------------------
# Keys belong to a project; managing them needs serving's KEY_PERM there. A project (or a key of
# a project) outside the caller's reach is a 404; a project they see without KEY_PERM is a 403,
# which for changes the service itself decides (deny() audits the refusal). The secret leaves
# only in the answer of create and rotate; the services write the one audit event per change.


def _key_out(key: ApiKey) -> dict:
    return {"id": key.pk, "name": key.name, "prefix": key.prefix, "state": key.state,
            "services": [{"id": s.pk, "slug": s.slug} for s in key.services.all()],
            "knowledge_bases": [{"id": kb.pk, "slug": kb.slug} for kb in key.knowledge_bases.all()],
            "created": key.created, "expires": key.expires, "revoked": key.revoked, "last_used": key.last_used,
            "replaced_by": key.replaced_by_id}


def _keys():
    # nosemgrep: atrium-queryset-outside-visible-to -- base queryset; callers narrow it with access or re-read a returned key
    return ApiKey.objects.select_related("project__tenant").prefetch_related("services", "knowledge_bases")


def _key_in_reach(user, key_id: int) -> ApiKey:
    # A key of a project the caller sees is found (the service then says 403 without KEY_PERM);
    # any other key answers exactly like a missing one.
    visible = access.visible_to(user, Project).values("pk")
    key = _keys().filter(pk=key_id, project__in=visible).first()
    if key is None:
        raise ApiProblem("not-found", "No such object, or it is outside your reach.")
    return key


def _pick(rows, ids: list[int], field: str, what: str) -> list:
    found = {r.pk: r for r in rows.filter(pk__in=ids)}
    unknown = [i for i in dict.fromkeys(ids) if i not in found]
    if unknown:
        raise _field_error(field, f"no {what} {unknown[0]} available to this project")
    return [found[i] for i in dict.fromkeys(ids)]


def _key_conflict(exc: ValidationError) -> None:
    # the service's "key" errors are about the key's state (already rotated or revoked): a conflict
    if hasattr(exc, "error_dict") and "key" in exc.error_dict:
        raise ApiProblem("conflict", " ".join(exc.messages)) from exc
    raise exc


@api.get("/projects/{project_id}/api-keys", response={200: list[ApiKeyOut], **OBJECT_ERRORS}, tags=["api keys"],
         summary="The project's API keys (never their secrets)")
def api_key_list(request, project_id: int):
    user = request.user
    project = access.get_visible_or_404(user, Project.objects.select_related("tenant"), pk=project_id)
    if not (access.can(user, serving.KEY_PERM, project) or access.has_platform_perm(user, "view_all_tenants")):
        raise ApiProblem("forbidden", "Seeing this project's API keys needs the permission to manage them.")
    keys = access.visible_to(user, _keys()).filter(project=project).order_by("-created", "-id")
    return [_key_out(k) for k in keys]


@api.post("/projects/{project_id}/api-keys", response={201: ApiKeyCreated, **CHANGE_ERRORS}, tags=["api keys"],
          summary="Create an API key of the project (scope admin); the secret is in this answer only")
def api_key_create(request, project_id: int, payload: ApiKeyIn):
    _changing(request, TokenScope.ADMIN)
    project = access.get_visible_or_404(request.user, Project.objects.select_related("tenant"), pk=project_id)
    expires = payload.expires
    if expires is not None:
        if timezone.is_naive(expires):
            expires = timezone.make_aware(expires, dt.UTC)
        try:
            expires = expires.astimezone(dt.UTC)
        except OverflowError:
            raise _field_error("expires", "not a date-time we can store") from None
    # the service checks KEY_PERM first, so a caller without it learns nothing about services or KBs
    if not access.can(request.user, serving.KEY_PERM, project):
        serving.create_api_key(request.user, project=project, name=payload.name)  # raises PermissionDenied, audited
    services = _pick(serving.services_for_project(project), payload.services, "services", "model service")
    kbs = _pick(serving.kbs_for_project(project), payload.knowledge_bases, "knowledge_bases", "knowledge base")
    key, secret = serving.create_api_key(request.user, project=project, name=payload.name.strip() or "key",
                                         services=services, knowledge_bases=kbs, expires=expires)
    return Status(201, {"key": _key_out(_keys().get(pk=key.pk)), "secret": secret})


@api.post("/api-keys/{key_id}/rotate", response={201: ApiKeyCreated, **CHANGE_ERRORS}, tags=["api keys"],
          summary="Rotate an API key (scope admin): a new key with the same scope; the old one stops after 24 h",
          description="The new key's secret is in this answer only.")
def api_key_rotate(request, key_id: int):
    _changing(request, TokenScope.ADMIN)
    key = _key_in_reach(request.user, key_id)
    try:
        new, secret = serving.rotate_api_key(request.user, key)
    except ValidationError as exc:
        _key_conflict(exc)
    return Status(201, {"key": _key_out(_keys().get(pk=new.pk)), "secret": secret})


@api.post("/api-keys/{key_id}/revoke", response={200: ApiKeyOut, **CHANGE_ERRORS}, tags=["api keys"],
          summary="Revoke an API key at once (scope admin)")
def api_key_revoke(request, key_id: int, payload: ApiKeyRevokeIn | None = None):
    _changing(request, TokenScope.ADMIN)
    key = _key_in_reach(request.user, key_id)
    try:
        serving.revoke_api_key(request.user, key, reason=(payload.reason if payload else "").strip())
    except ValidationError as exc:
        _key_conflict(exc)
    return _key_out(_keys().get(pk=key.pk))


__all__ = ["api", "Problem"]


# usage and reports live beside metering's own code, registered on the same API
from api import metering_routes  # noqa: E402

metering_routes.register(api)

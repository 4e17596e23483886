"""Domain operations of serving: services, knowledge bases, applications, API keys, metering.

The only place that changes serving state. Each function takes the acting user, checks the
permission through tenants.access, changes state in one transaction and writes exactly one
audit event for sensitive actions. Reach is always computed on the server from the acting
user or key: a knowledge-base or service id a client sends is only ever looked up inside
that reach, and every chunk query filters by the caller's tenant column first. This module
never stores or logs an API key's secret, and never guesses token counts.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import logging
import re
import uuid
from dataclasses import dataclass

from django.conf import settings
from django.contrib.postgres.search import SearchQuery, SearchRank, SearchVector
from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import F, Q, QuerySet, Sum
from django.utils import timezone

from portal import audit
from portal.prepared import Statement, from_row, select_columns
from portal.services import deny
from scheduling import services as scheduling
from serving import authcache, ingest, ratelimit
from serving import keys as keymat
from serving.models import (
    ApiKey,
    Application,
    Chunk,
    Document,
    GatewayRequest,
    KnowledgeBase,
    ModelService,
    ServiceStatus,
    ServingAlarm,
    ServingLimits,
    TokenUsage,
    Visibility,
)
from tenants import access
from tenants.models import Project, Tenant, TenantState

log = logging.getLogger("atrium.serving")

USE_PERM = "use_model_services"  # call and browse services / KBs of a project
KEY_PERM = "manage_api_keys"
PUBLISH_PERM = "manage_project_members"  # publishing/retiring is a project admin's call (or the tenant admin's)
KB_ADMIN_PERM = "manage_tenant_projects"  # tenant perm: create and share knowledge bases
SERVICE_JOB_MINUTES = 30 * 24 * 60  # a service is long-lived: the scheduler sees a 30-day job
MAX_DOCUMENT_BYTES = ingest.MAX_DOCUMENT_BYTES
CHUNK_INSERT_BATCH = 500


# --- reach ------------------------------------------------------------------------------


def services_for_user(user) -> QuerySet:
    """Services a person may see: by the visibility rule, plus published tenant-wide services of
    tenants in which they use model services in some project."""
    use_projects = access.project_ids(user, USE_PERM)
    tenant_wide = Q(visibility=Visibility.TENANT, status=ServiceStatus.PUBLISHED,
                    tenant__in=Project.objects.filter(pk__in=use_projects).values("tenant"))
    return ModelService.objects.filter(
        Q(pk__in=access.visible_to(user, ModelService).values("pk")) | tenant_wide
    )


def services_for_project(project: Project) -> QuerySet:
    """Services a project (and so its keys and apps) may use: its own, and its tenant's shared ones."""
    return ModelService.objects.filter(tenant_id=project.tenant_id).filter(
        Q(project_id=project.pk) | Q(visibility=Visibility.TENANT)
    )


def kbs_for_project(project: Project) -> QuerySet:
    through = KnowledgeBase.projects.through
    return KnowledgeBase.objects.filter(tenant_id=project.tenant_id).filter(
        Q(all_projects=True) | Q(pk__in=through.objects.filter(project_id=project.pk).values("knowledgebase_id"))
    )


def kbs_for_user(user) -> QuerySet:
    """Knowledge bases a person may read: the tenant admins' (visibility rule) and those shared
    with a project where the person uses model services."""
    use_projects = access.project_ids(user, USE_PERM)
    through = KnowledgeBase.projects.through
    return KnowledgeBase.objects.filter(
        Q(pk__in=access.visible_to(user, KnowledgeBase).values("pk"))
        | Q(all_projects=True, tenant__in=Project.objects.filter(pk__in=use_projects).values("tenant"))
        | Q(pk__in=through.objects.filter(project_id__in=use_projects).values("knowledgebase_id"))
    )


def _require_project(actor, perm: str, project: Project, action: str, what: str) -> None:
    if not access.can(actor, perm, project):
        if project.pk in access.project_ids(actor, "view_project"):
            deny(actor, action, f"you may not {what} in this project", target=project, project=project)
        deny(actor, action, "project not in reach", target_label=str(project.pk))
    if not project.is_active:
        raise ValidationError({"project": "this project is archived or its tenant suspended"})


# --- model services ---------------------------------------------------------------------


def create_model_service(actor, *, project: Project, slug: str, name: str, base_model: str, spec, priority_class,
                         upstream_url: str, replicas: int = 1, model_version: str = "", upstream_model: str = "",
                         visibility: str = Visibility.PROJECT, image: str = "vllm/vllm-openai:latest") -> ModelService:
    _require_project(actor, USE_PERM, project, "service.create", "create model services")
    if visibility not in Visibility.values:
        raise ValidationError({"visibility": "choose project or tenant"})
    service = ModelService(
        tenant=project.tenant, project=project, slug=slug, name=name, base_model=base_model, spec=spec,
        priority_class=priority_class, replicas=replicas, model_version=model_version, image=image,
        upstream_url=upstream_url.rstrip("/"), upstream_model=upstream_model, visibility=visibility, created_by=actor,
    )
    service.full_clean()
    with transaction.atomic():
        service.save()
        audit.record("service.create", actor=actor, target=service, project=project,
                     after={"slug": slug, "base_model": base_model, "visibility": visibility})
    return service


def publish_service(actor, service: ModelService) -> ModelService:
    """Draft -> published: submits the long-lived scheduling job (kind service) and opens the gateway."""
    _require_project(actor, PUBLISH_PERM, service.project, "service.publish", "publish model services")
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        service = ModelService.objects.select_for_update().get(pk=service.pk)
        if service.status != ServiceStatus.DRAFT:
            raise ValidationError({"status": f"only a draft can be published; this service is {service.status}"})
        job = scheduling.submit_job(
            actor, project=service.project, spec=service.spec, priority_class=service.priority_class,
            name=f"service {service.slug}", image=service.image,
            command=["serve", service.base_model, "--served-model-name", service.model_name_upstream],
            replicas=service.replicas, time_limit_minutes=SERVICE_JOB_MINUTES, expected_minutes=SERVICE_JOB_MINUTES,
            kind="service",
        )
        service.job = job
        service.status = ServiceStatus.PUBLISHED
        service.published = timezone.now()
        service.save(update_fields=["job", "status", "published"])
        audit.record("service.publish", actor=actor, target=service, project=service.project,
                     before={"status": ServiceStatus.DRAFT}, after={"status": service.status, "job": job.pk,
                                                                     "visibility": service.visibility})
    return service


def retire_service(actor, service: ModelService, *, reason: str = "") -> ModelService:
    _require_project(actor, PUBLISH_PERM, service.project, "service.retire", "retire model services")
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        service = ModelService.objects.select_for_update().get(pk=service.pk)
        if service.status == ServiceStatus.RETIRED:
            raise ValidationError({"status": "this service is already retired"})
        before = service.status
        if service.job_id and not service.job.is_final:
            scheduling.cancel_job(actor, service.job, reason=f"model service {service.slug} retired")
        service.status = ServiceStatus.RETIRED
        service.retired = timezone.now()
        service.save(update_fields=["status", "retired"])
        audit.record("service.retire", actor=actor, target=service, project=service.project, reason=reason,
                     before={"status": before}, after={"status": service.status})
    return service


# --- knowledge bases --------------------------------------------------------------------


def _check_share(tenant: Tenant, projects) -> list[Project]:
    projects = list(projects)
    if any(p.tenant_id != tenant.pk for p in projects):
        raise ValidationError({"projects": "a knowledge base is shared only with projects of its own tenant"})
    return projects


def create_knowledge_base(actor, *, tenant: Tenant, slug: str, name: str, description: str = "",
                          all_projects: bool = False, projects=()) -> KnowledgeBase:
    if not access.can(actor, KB_ADMIN_PERM, tenant):
        deny(actor, "kb.create", "only the tenant's admins create knowledge bases", target=tenant, tenant=tenant)
    projects = _check_share(tenant, projects)
    kb = KnowledgeBase(tenant=tenant, slug=slug, name=name, description=description, all_projects=all_projects,
                       created_by=actor)
    kb.full_clean()
    with transaction.atomic():
        kb.save()
        kb.projects.set(projects)
        audit.record("kb.create", actor=actor, target=kb, tenant=tenant,
                     after={"slug": slug, "all_projects": all_projects, "projects": [p.slug for p in projects]})
    return kb


def share_knowledge_base(actor, kb: KnowledgeBase, *, all_projects: bool, projects=()) -> KnowledgeBase:
    if not access.can(actor, KB_ADMIN_PERM, kb.tenant):
        deny(actor, "kb.share", "only the tenant's admins share knowledge bases", target=kb, tenant=kb.tenant)
    projects = _check_share(kb.tenant, projects)
    with transaction.atomic():
        before = {"all_projects": kb.all_projects, "projects": sorted(p.slug for p in kb.projects.all())}
        kb.all_projects = all_projects
        kb.save(update_fields=["all_projects"])
        kb.projects.set(projects)
        audit.record("kb.share", actor=actor, target=kb, tenant=kb.tenant, before=before,
                     after={"all_projects": all_projects, "projects": sorted(p.slug for p in projects)})
    return kb


def may_upload(user, kb: KnowledgeBase) -> bool:
    """Writing a document needs a role in the knowledge base's own tenant: its admins, or a
    user of model services in a project the base is shared with. Platform read access (which
    sees every tenant's bases) never reaches writing into them."""
    if access.can(user, KB_ADMIN_PERM, kb.tenant):
        return True
    use_projects = Project.objects.filter(pk__in=access.project_ids(user, USE_PERM), tenant_id=kb.tenant_id)
    if kb.all_projects:
        return use_projects.exists()
    return kb.projects.filter(pk__in=use_projects.values("pk")).exists()


# What a file is and how its text is chunked live in serving.ingest (no database there).
extract_text = ingest.extract_text
chunk_text = ingest.chunk_text


def upload_document(actor, kb: KnowledgeBase, *, filename: str, content_type: str, data) -> Document:
    """Index one file (bytes, or a binary file object of which at most MAX_DOCUMENT_BYTES + 1
    bytes are read) into a knowledge base. Every check runs before the transaction: a refused
    file leaves no Document, no chunk and no audit event behind."""
    if not may_upload(actor, kb):
        deny(actor, "kb.document.upload", "knowledge base not in reach", target_label=str(kb.pk))
    if kb.tenant.state != TenantState.ACTIVE:
        raise ValidationError({"file": "the tenant is suspended"})
    filename = ingest.clean_label(filename, 200)
    content_type = ingest.clean_label(content_type, 60)
    data = ingest.read_bounded(data, MAX_DOCUMENT_BYTES)
    pieces = chunk_text(extract_text(filename, content_type, data))
    if not pieces:
        raise ValidationError({"file": "no text found in this file"})
    with transaction.atomic():
        doc = Document.objects.create(
            tenant_id=kb.tenant_id, knowledge_base=kb, title=filename or "untitled",
            content_type=content_type, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
            chunk_count=len(pieces), uploaded_by=actor,
        )
        for start in range(0, len(pieces), CHUNK_INSERT_BATCH):
            Chunk.objects.bulk_create([
                Chunk(tenant_id=kb.tenant_id, knowledge_base=kb, document=doc, ordinal=i, text=pieces[i])
                for i in range(start, min(start + CHUNK_INSERT_BATCH, len(pieces)))
            ])
        if connection.vendor == "postgresql":
            Chunk.objects.filter(document=doc).update(search_vector=SearchVector("text", config="english"))
        audit.record("kb.document.upload", actor=actor, target=doc, tenant=kb.tenant,
                     after={"kb": kb.slug, "size": len(data), "chunks": len(pieces), "sha256": doc.sha256})
    return doc


@dataclass(frozen=True)
class Hit:
    chunk_id: int
    knowledge_base: str
    document: str
    text: str
    score: float


_WORD = re.compile(r"[\w-]+", re.UNICODE)


def search_chunks(*, tenant_id: int, kb_ids, query: str, top_k: int = 5) -> list[Hit]:
    """Ranked chunks of the given knowledge bases of ONE tenant. Callers pass the tenant from
    the key or session, never from the client; the tenant column is filtered in the query."""
    words = [w for w in _WORD.findall(query.lower()) if len(w) > 1][:32]
    kb_ids = list(kb_ids)
    if not words or not kb_ids:
        return []
    top_k = max(1, min(int(top_k), 20))
    qs = Chunk.objects.filter(tenant_id=tenant_id, knowledge_base_id__in=kb_ids,
                              knowledge_base__tenant_id=tenant_id).select_related("document", "knowledge_base")
    if connection.vendor == "postgresql":
        # OR of the terms: a question matches chunks holding any of its words, ranked by how well.
        sq = SearchQuery(" or ".join(words), config="english", search_type="websearch")
        rows = qs.filter(search_vector=sq).annotate(score=SearchRank(F("search_vector"), sq)).order_by("-score", "pk")
    else:  # SQLite demo: a plain containment match, still tenant-filtered
        cond = Q()
        for w in words:
            cond |= Q(text__icontains=w)
        rows = qs.filter(cond).order_by("pk")
    return [
        Hit(c.pk, c.knowledge_base.slug, c.document.title, c.text, float(getattr(c, "score", 1.0)))
        for c in rows[:top_k]
    ]


def search_for_user(user, kb: KnowledgeBase, query: str, top_k: int = 5) -> list[Hit]:
    # Re-resolve inside the user's reach: the kb object may come from anywhere.
    kb = kbs_for_user(user).filter(pk=kb.pk).first()
    if kb is None:
        return []
    return search_chunks(tenant_id=kb.tenant_id, kb_ids=[kb.pk], query=query, top_k=top_k)


# --- applications -----------------------------------------------------------------------


def create_application(actor, *, project: Project, slug: str, name: str, service: ModelService,
                       knowledge_bases=(), system_prompt: str = "", top_k: int = 4) -> Application:
    _require_project(actor, USE_PERM, project, "application.create", "create applications")
    if not services_for_project(project).filter(pk=service.pk).exists():
        raise ValidationError({"service": "this model service is not available to the project"})
    kbs = list(knowledge_bases)
    allowed = set(kbs_for_project(project).values_list("pk", flat=True))
    if any(kb.pk not in allowed for kb in kbs):
        raise ValidationError({"knowledge_bases": "a knowledge base is not shared with this project"})
    app = Application(tenant=project.tenant, project=project, slug=slug, name=name, service=service,
                      system_prompt=system_prompt, top_k=top_k, created_by=actor)
    app.full_clean()
    with transaction.atomic():
        app.save()
        app.knowledge_bases.set(kbs)
        audit.record("application.create", actor=actor, target=app, project=project,
                     after={"service": service.slug, "knowledge_bases": [kb.slug for kb in kbs]})
    return app


# --- API keys ---------------------------------------------------------------------------


def _check_scope(project: Project, services, kbs) -> tuple[list, list]:
    services, kbs = list(services), list(kbs)
    ok_services = set(services_for_project(project).values_list("pk", flat=True))
    if any(s.pk not in ok_services for s in services):
        raise ValidationError({"services": "a service is not available to this project"})
    ok_kbs = set(kbs_for_project(project).values_list("pk", flat=True))
    if any(kb.pk not in ok_kbs for kb in kbs):
        raise ValidationError({"knowledge_bases": "a knowledge base is not shared with this project"})
    return services, kbs


def _new_key(actor, project, name, services, kbs, expires, rpm, tpm) -> tuple[ApiKey, str]:
    secret = keymat.generate()
    key = ApiKey(tenant_id=project.tenant_id, project=project, name=name, prefix=secret[: keymat.SHOWN_PREFIX_LEN],
                 digest=keymat.digest(secret), created_by=actor, expires=expires, requests_per_minute=rpm,
                 tokens_per_minute=tpm)
    key.full_clean()
    key.save()
    key.services.set(services)
    key.knowledge_bases.set(kbs)
    return key, secret


def create_api_key(actor, *, project: Project, name: str, services=(), knowledge_bases=(),
                   expires: dt.datetime | None = None, requests_per_minute: int | None = None,
                   tokens_per_minute: int | None = None) -> tuple[ApiKey, str]:
    """Returns the key row and its secret. The secret exists only in this return value."""
    _require_project(actor, KEY_PERM, project, "apikey.create", "manage API keys")
    if expires is not None and expires <= timezone.now():
        raise ValidationError({"expires": "the expiry must be in the future"})
    services, kbs = _check_scope(project, services, knowledge_bases)
    with transaction.atomic():
        key, secret = _new_key(actor, project, name, services, kbs, expires, requests_per_minute, tokens_per_minute)
        audit.record("apikey.create", actor=actor, target=key, project=project,
                     after={"name": name, "prefix": key.prefix, "services": [s.slug for s in services],
                            "knowledge_bases": [kb.slug for kb in kbs], "expires": expires})
    return key, secret


def rotate_api_key(actor, key: ApiKey, *, grace: dt.timedelta = dt.timedelta(hours=24)) -> tuple[ApiKey, str]:
    """A new key with the same scope; the old one keeps working for `grace`, then stops."""
    _require_project(actor, KEY_PERM, key.project, "apikey.rotate", "manage API keys")
    if grace < dt.timedelta(0) or grace > dt.timedelta(days=30):
        raise ValidationError({"grace": "the grace period is between 0 and 30 days"})
    now = timezone.now()
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        key = ApiKey.objects.select_for_update().get(pk=key.pk)
        if not key.is_usable(now) or key.replaced_by_id:
            raise ValidationError({"key": "only an active key that was not rotated yet can be rotated"})
        new, secret = _new_key(actor, key.project, key.name, key.services.all(), key.knowledge_bases.all(),
                               key.expires, key.requests_per_minute, key.tokens_per_minute)
        old_expires = key.expires
        key.expires = min(key.expires, now + grace) if key.expires else now + grace
        key.replaced_by = new
        key.save(update_fields=["expires", "replaced_by"])
        audit.record("apikey.rotate", actor=actor, target=key, project=key.project,
                     before={"prefix": key.prefix, "expires": old_expires},
                     after={"old_expires": key.expires, "new_key": new.pk, "new_prefix": new.prefix})
    return new, secret


def revoke_api_key(actor, key: ApiKey, *, reason: str = "") -> ApiKey:
    _require_project_keys_even_archived(actor, key)
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        key = ApiKey.objects.select_for_update().get(pk=key.pk)
        if key.revoked:
            raise ValidationError({"key": "this key is already revoked"})
        key.revoked = timezone.now()
        key.save(update_fields=["revoked"])
        audit.record("apikey.revoke", actor=actor, target=key, project=key.project, reason=reason,
                     after={"prefix": key.prefix, "revoked": key.revoked})
    return key


def _require_project_keys_even_archived(actor, key: ApiKey) -> None:
    # Revoking must stay possible on an archived project (it only ever narrows access).
    if not access.can(actor, KEY_PERM, key.project):
        deny(actor, "apikey.revoke", "you may not manage this project's keys", target_label=str(key.pk))


def set_serving_limits(actor, project: Project, *, requests_per_minute: int | None, tokens_per_minute: int | None,
                       monthly_token_budget: int | None) -> ServingLimits:
    if not access.can(actor, KB_ADMIN_PERM, project.tenant):
        deny(actor, "serving.limits", "only the tenant's admins set gateway limits", target=project, project=project)
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        limits, _ = ServingLimits.objects.select_for_update().get_or_create(project=project,
                                                                            defaults={"tenant": project.tenant})
        before = {"rpm": limits.requests_per_minute, "tpm": limits.tokens_per_minute,
                  "budget": limits.monthly_token_budget}
        limits.requests_per_minute = requests_per_minute
        limits.tokens_per_minute = tokens_per_minute
        limits.monthly_token_budget = monthly_token_budget
        limits.save()
        audit.record("serving.limits", actor=actor, target=project, project=project, before=before,
                     after={"rpm": requests_per_minute, "tpm": tokens_per_minute, "budget": monthly_token_budget})
    return limits


# --- gateway: authentication and metering -----------------------------------------------


class KeyRejected(Exception):
    """The presented key cannot be used now. `status` is 401 (not a usable key) or 403."""

    def __init__(self, message: str, *, status: int = 401, code: str = "invalid_api_key"):
        super().__init__(message)
        self.status = status
        self.code = code


LAST_USED_RESOLUTION = dt.timedelta(seconds=30)  # last_used is written at most this often per key


@dataclass(frozen=True)
class Caller:
    """What one gateway request may do, read in one statement at the start of the request."""

    key: ApiKey  # with key.project, key.project.tenant and the project's serving limits loaded
    service: ModelService | None = None  # the service the request named, if the key's tenant has one by that name
    service_in_scope: bool = False  # the key's scope lists that service
    month_tokens: int | None = None  # the project's gateway tokens this month (only read when it has a budget)
    ticket: authcache.Ticket | None = None  # read from serving.authcache: to be validated by the admission script


def _key_check_sql() -> str:
    from django.contrib.auth import get_user_model

    scope = ApiKey.services.through
    limits_budget = ServingLimits._meta.get_field("monthly_token_budget").column
    return (
        f"SELECT {select_columns(ApiKey, 'k')}, {select_columns(Project, 'p')}, "  # noqa: S608 # nosec B608 # identifiers from model metadata, values are parameters
        f"{select_columns(Tenant, 't')}, l.id IS NOT NULL, {select_columns(ServingLimits, 'l')}, "
        f"s.id IS NOT NULL, {select_columns(ModelService, 's')}, "
        f"u.is_active AND {access.project_perm_sql(user='k.created_by_id', project='k.project_id', perm='%(perm)s')}, "
        f"EXISTS (SELECT 1 FROM {scope._meta.db_table} ks WHERE ks.{scope._meta.get_field('apikey').column} = k.id "
        f"AND ks.{scope._meta.get_field('modelservice').column} = s.id), "
        f"CASE WHEN l.{limits_budget} IS NOT NULL THEN (SELECT COALESCE(SUM(tu.input_tokens + tu.output_tokens), 0) "
        f"FROM {TokenUsage._meta.db_table} tu WHERE tu.project_id = k.project_id AND tu.hour >= %(month)s) END "
        f"FROM {ApiKey._meta.db_table} k JOIN {Project._meta.db_table} p ON p.id = k.project_id "
        f"JOIN {Tenant._meta.db_table} t ON t.id = p.tenant_id "
        f"JOIN {get_user_model()._meta.db_table} u ON u.id = k.created_by_id "
        f"LEFT JOIN {ServingLimits._meta.db_table} l ON l.project_id = k.project_id "
        f"LEFT JOIN {ModelService._meta.db_table} s ON s.tenant_id = k.tenant_id AND s.slug = %(service)s "
        f"WHERE k.digest = %(digest)s"
    )


_KEY_CHECK = Statement(_key_check_sql)


def authenticate_key(raw: str, *, service: str | None = None, cache: bool = False, refresh: bool = False) -> Caller:
    """The usable key for a presented secret: revoked, expired, project archived, tenant
    suspended and the creator's lost membership all stop it here.

    One prepared statement reads the key, its project, tenant and limits, the creator's
    permission on the project, the service named `service` in the key's tenant with the key's
    scope on it, and (for a project with a budget) its tokens this month.

    With `cache`, a check made by this process under the current generation is answered from
    memory (serving.authcache) and carries a `ticket`: the caller must have it validated by
    serving.ratelimit.admit_cached before acting on it, and start again with `refresh` (read
    the database, whatever is cached) when it is stale. A check read from the database is
    kept for the next requests and returned without a ticket. Without `cache`, or inside a
    transaction, nothing is kept or taken from memory: a change committed before the request
    started is what the request sees.
    """
    if not keymat.well_formed(raw):
        raise KeyRejected("Malformed API key.")
    digest = keymat.digest(raw)
    now = timezone.now()
    month = month_start(now)
    cache = cache and not connection.in_atomic_block
    snapshot = None
    if cache:
        hit = None if refresh else cached_caller(digest, service, now)
        if hit is not None:
            return hit
        authcache.forget(digest, service)
        snapshot = ratelimit.snapshot(authcache.known_project(digest), month)  # before the database, see authcache
    row = _key_check_row({"digest": digest, "service": service, "month": month, "perm": USE_PERM})
    if row is None or not keymat.digests_match(digest, row[_K.digest]):
        raise KeyRejected("Invalid API key.")
    key, project, tenant, limits, svc, creator_may_use, in_scope, month_tokens = _caller_parts(row)
    if key.revoked is not None:
        raise KeyRejected("This API key was revoked.")
    if key.expires is not None and now >= key.expires:
        raise KeyRejected("This API key has expired." + (" It was rotated; use its replacement." if key.replaced_by_id
                                                         else ""))
    if project.archived is not None:
        raise KeyRejected("The project of this API key is archived.")
    if tenant.state != TenantState.ACTIVE:
        raise KeyRejected("The tenant of this API key is suspended.", status=403, code="tenant_suspended")
    if not creator_may_use:
        raise KeyRejected("The person who created this key no longer belongs to its project.")
    if key.last_used is None or now - key.last_used > LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=key.pk).update(last_used=now)
        key.last_used = now
    caller = Caller(key=key, service=svc, service_in_scope=bool(in_scope), month_tokens=month_tokens)
    if snapshot is not None:
        generation, counter = snapshot
        counted_project = authcache.known_project(digest) == key.project_id
        authcache.remember_project(digest, key.project_id)
        if month_tokens is None or counted_project:  # a budget needs the counter of this key's project
            base = None if month_tokens is None else int(month_tokens) - counter  # SUM() comes back as a Decimal
            ticket = authcache.Ticket(generation, month, base, counter)
            authcache.put(digest, service, dataclasses.replace(caller, ticket=ticket), ticket)
    return caller  # read from the database just now: no ticket, nothing to validate


def cached_caller(digest: str, service: str | None, now: dt.datetime | None = None) -> Caller | None:
    """The caller of a key check this process made under a generation not yet known to be stale
    (serving.authcache), carrying its ticket; None when there is none for this month or the key
    has expired since."""
    entry = authcache.get(digest, service)
    if entry is None:
        return None
    now = now or timezone.now()
    expires = entry.caller.key.expires
    if entry.ticket.month != month_start(now) or (expires is not None and now >= expires):
        return None
    return entry.caller


def _key_check_row(values: dict):
    """The key-check row, read as the request's first statement without Django's per-request
    health check (CONN_HEALTH_CHECKS: a SELECT 1 round trip before it). The check is made by
    the statement itself: when the persistent connection turns out to be one the server
    dropped, it is closed and the read runs once more on a new one. Inside a transaction (a
    caller's atomic block) nothing is retried and the ordinary check applies."""
    from portal.resilience import is_db_outage

    retry = not connection.in_atomic_block and connection.connection is not None and not connection.health_check_done
    if retry:
        connection.health_check_done = True
    try:
        return _KEY_CHECK.fetchone(values)
    except DatabaseError as exc:
        if not (retry and is_db_outage(exc)):
            raise
        log.warning("gateway: the database connection was gone, reconnecting (%s)", type(exc).__name__)
        connection.close()
    return _KEY_CHECK.fetchone(values)


class _K:  # where the parts of a key-check row start
    digest = [f.attname for f in ApiKey._meta.concrete_fields].index("digest")


def _caller_parts(row):
    n_key, n_project, n_tenant = (len(m._meta.concrete_fields) for m in (ApiKey, Project, Tenant))
    n_limits, n_service = len(ServingLimits._meta.concrete_fields), len(ModelService._meta.concrete_fields)
    i = 0
    key = from_row(ApiKey, row[i:i + n_key])
    i += n_key
    project = from_row(Project, row[i:i + n_project])
    i += n_project
    tenant = from_row(Tenant, row[i:i + n_tenant])
    i += n_tenant
    limits = from_row(ServingLimits, row[i + 1:i + 1 + n_limits]) if row[i] else None
    i += 1 + n_limits
    svc = from_row(ModelService, row[i + 1:i + 1 + n_service]) if row[i] else None
    i += 1 + n_service
    creator_may_use, in_scope, month_tokens = row[i:i + 3]
    Project.tenant.field.set_cached_value(project, tenant)
    Project.serving_limits.related.set_cached_value(project, limits)
    ApiKey.project.field.set_cached_value(key, project)
    if limits is not None:
        ServingLimits.project.field.set_cached_value(limits, project)
    return key, project, tenant, limits, svc, creator_may_use, in_scope, month_tokens


def hour_of(t: dt.datetime) -> dt.datetime:
    return t.astimezone(dt.UTC).replace(minute=0, second=0, microsecond=0)


def month_start(t: dt.datetime) -> dt.datetime:
    return t.astimezone(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def limits_for(project: Project) -> ServingLimits:
    rel = Project.serving_limits.related
    if rel.is_cached(project):  # loaded with the key by authenticate_key (None: no row)
        limits = rel.get_cached_value(project)
    else:
        limits = ServingLimits.objects.filter(project=project).first()
    if limits is None:
        limits = ServingLimits(
            project=project, tenant_id=project.tenant_id,
            requests_per_minute=getattr(settings, "ATRIUM_GATEWAY_PROJECT_RPM", None),
            tokens_per_minute=getattr(settings, "ATRIUM_GATEWAY_PROJECT_TPM", None),
            monthly_token_budget=None,
        )
    return limits


def tokens_this_month(project: Project, now: dt.datetime | None = None) -> int:
    now = now or timezone.now()
    agg = TokenUsage.objects.filter(project=project, hour__gte=month_start(now)).aggregate(
        i=Sum("input_tokens"), o=Sum("output_tokens"))
    return (agg["i"] or 0) + (agg["o"] or 0)


def raise_budget_alarm(key: ApiKey, used: int, budget: int) -> bool:
    """Once per project and month: an alarm row and one audit event. True when newly raised."""
    month = month_start(timezone.now()).date()
    message = f"Project {key.project} used {used} of its {budget} monthly gateway tokens; calls are refused."
    try:
        with transaction.atomic():
            ServingAlarm.objects.create(tenant_id=key.tenant_id, project=key.project, month=month,
                                        kind="token_budget", message=message)
            audit.record("serving.budget_exceeded", actor_label=f"apikey:{key.prefix}", target=key.project,
                         project=key.project, reason=message, after={"used": used, "budget": budget})
    except IntegrityError:
        return False
    log.warning("%s", message)
    return True


@dataclass(frozen=True)
class Usage:
    """One answered gateway request, as it is metered (`usage_of` builds it at the request)."""

    uid: uuid.UUID  # the gateway's own id of the request: the idempotency key
    time: dt.datetime
    tenant_id: int
    project_id: int
    key_id: int
    key_prefix: str
    service_id: int
    service_slug: str
    base_model: str
    application_id: int | None
    endpoint: str
    input_tokens: int
    output_tokens: int
    metered: bool  # False: the upstream reported no usage (recorded as unmetered, never guessed)
    note: str
    request_id: str

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def usage_of(*, uid: uuid.UUID, key: ApiKey, service: ModelService, endpoint: str, input_tokens: int | None,
             output_tokens: int | None, application: Application | None = None, note: str = "",
             request_id: str = "") -> Usage:
    """The usage of one answered request. With no usage reported (`input_tokens is None`) it is
    unmetered: zero tokens and metered=False, a count is never guessed."""
    metered = input_tokens is not None and output_tokens is not None
    return Usage(uid=uid, time=timezone.now(), tenant_id=key.tenant_id, project_id=key.project_id, key_id=key.pk,
                 key_prefix=key.prefix, service_id=service.pk, service_slug=service.slug,
                 base_model=service.base_model, application_id=application.pk if application else None,
                 endpoint=endpoint, input_tokens=max(0, int(input_tokens or 0)) if metered else 0,
                 output_tokens=max(0, int(output_tokens or 0)) if metered else 0, metered=metered,
                 note=(note if metered else (note or "no usage reported"))[:200], request_id=request_id[:64])


def record_usages(usages: list[Usage]) -> set[uuid.UUID]:
    """Meter answered gateway requests exactly once each; returns the uids recorded by this call
    (a uid already recorded is skipped, so a batch may be written again after a lost commit).

    On PostgreSQL one prepared statement, whatever the number of requests: their rows are
    inserted from arrays, and the hourly rollup is added to from the rows this statement
    inserted, one upsert per (hour, key, service) of the batch. So concurrent requests of one
    key written together take that rollup row's lock once, not once each.
    """
    seen: set[uuid.UUID] = set()
    usages = [u for u in usages if u.uid not in seen and not seen.add(u.uid)]  # a uid twice in one batch: once
    if not usages:
        return set()
    if connection.vendor == "postgresql":
        recorded = {row[0] for row in _METER.fetchall({
            "uid": [u.uid for u in usages], "time": [u.time for u in usages],
            "hour": [hour_of(u.time) for u in usages], "tenant": [u.tenant_id for u in usages],
            "project": [u.project_id for u in usages], "key": [u.key_id for u in usages],
            "service": [u.service_id for u in usages], "application": [u.application_id for u in usages],
            "base_model": [u.base_model for u in usages], "endpoint": [u.endpoint for u in usages],
            "inp": [u.input_tokens for u in usages], "out": [u.output_tokens for u in usages],
            "metered": [u.metered for u in usages], "note": [u.note for u in usages],
            "request_id": [u.request_id for u in usages]})}
    else:  # SQLite (development): no data-modifying CTE; the same two writes per request, each atomic
        recorded = {u.uid for u in usages if _record_one_sqlite(u)}
    for u in usages:
        if u.uid in recorded and not u.metered:
            log.warning("gateway request %s on %s (key %s) finished without usage from the upstream: recorded "
                        "unmetered", u.uid, u.service_slug, u.key_prefix)
    return recorded


def _record_one_sqlite(u: Usage) -> bool:
    values = {"uid": u.uid, "time": u.time, "tenant": u.tenant_id, "project": u.project_id, "key": u.key_id,
              "service": u.service_id, "application": u.application_id, "endpoint": u.endpoint,
              "inp": u.input_tokens, "out": u.output_tokens, "metered": u.metered, "note": u.note,
              "request_id": u.request_id, "hour": hour_of(u.time), "base_model": u.base_model,
              "unmetered": 0 if u.metered else 1}
    for name, field in (("uid", GatewayRequest._meta.get_field("uid")), ("time", GatewayRequest._meta.get_field("time")),
                        ("hour", TokenUsage._meta.get_field("hour"))):
        values[name] = field.get_db_prep_value(values[name], connection)  # as the ORM stores them
    try:
        with transaction.atomic(), connection.cursor() as cur:
            # nosemgrep: atrium-raw-sql-string-formatting -- table names from model metadata, values are parameters
            cur.execute(_request_insert_sql(), values)
            rollup = _rollup_upsert_sql("VALUES (%(hour)s, %(tenant)s, %(project)s, %(key)s, %(service)s, "
                                        "%(base_model)s, 1, %(inp)s, %(out)s, %(unmetered)s)")
            # nosemgrep: atrium-raw-sql-string-formatting -- table names from model metadata, values are parameters
            cur.execute(rollup, values)
    except IntegrityError:
        return False
    return True


def _request_columns() -> str:
    return ("uid, time, tenant_id, project_id, api_key_id, service_id, application_id, endpoint, input_tokens, "
            "output_tokens, metered, note, request_id")


def _request_insert_sql() -> str:
    return (
        f"INSERT INTO {GatewayRequest._meta.db_table} ({_request_columns()}) VALUES (%(uid)s, %(time)s, "  # noqa: S608 # nosec B608 # table name from model metadata, values are parameters
        "%(tenant)s, %(project)s, %(key)s, %(service)s, %(application)s, %(endpoint)s, %(inp)s, %(out)s, %(metered)s, "
        "%(note)s, %(request_id)s)"
    )


def _rollup_upsert_sql(rows: str) -> str:
    # atomic under concurrency: the unique (hour, key, service) row is created or added to
    table = TokenUsage._meta.db_table
    return (
        f"INSERT INTO {table} (hour, tenant_id, project_id, api_key_id, service_id, base_model, requests, "  # noqa: S608 # nosec B608 # table name from model metadata, values are parameters
        f"input_tokens, output_tokens, unmetered_requests) {rows} "
        "ON CONFLICT (hour, api_key_id, service_id) DO UPDATE SET "
        f"requests = {table}.requests + EXCLUDED.requests, "
        f"input_tokens = {table}.input_tokens + EXCLUDED.input_tokens, "
        f"output_tokens = {table}.output_tokens + EXCLUDED.output_tokens, "
        f"unmetered_requests = {table}.unmetered_requests + EXCLUDED.unmetered_requests"
    )


def _meter_sql() -> str:
    # One statement, one implicit transaction: the request rows are inserted unless their uid is
    # already there (a retry), and the rollup adds up only the rows this statement inserted,
    # grouped so that no rollup row is upserted twice by it, and in one order, so that two
    # processes' batches over the same rows wait for each other instead of deadlocking. The
    # arrays keep the statement the same for any number of requests: it is prepared once per
    # connection and array types (psycopg sends small integers as int2[], larger as int4[]).
    return (
        f"WITH req AS (INSERT INTO {GatewayRequest._meta.db_table} ({_request_columns()}) "  # noqa: S608 # nosec B608 # table names from model metadata, values are parameters
        "SELECT * FROM unnest(%(uid)s::uuid[], %(time)s::timestamptz[], %(tenant)s::bigint[], %(project)s::bigint[], "
        "%(key)s::bigint[], %(service)s::bigint[], %(application)s::bigint[], %(endpoint)s::text[], %(inp)s::int[], "
        "%(out)s::int[], %(metered)s::boolean[], %(note)s::text[], %(request_id)s::text[]) "
        "ON CONFLICT (uid) DO NOTHING "
        "RETURNING uid, tenant_id, project_id, api_key_id, service_id, input_tokens, output_tokens, metered), "
        "hours AS (SELECT * FROM unnest(%(uid)s::uuid[], %(hour)s::timestamptz[], %(base_model)s::text[]) "
        "AS h(uid, hour, base_model)), "
        "rollup AS ("
        + _rollup_upsert_sql("SELECT h.hour, max(req.tenant_id), max(req.project_id), req.api_key_id, req.service_id, "
                             "max(h.base_model), count(*), sum(req.input_tokens), sum(req.output_tokens), "
                             "count(*) FILTER (WHERE NOT req.metered) FROM req JOIN hours h USING (uid) "
                             "GROUP BY h.hour, req.api_key_id, req.service_id "
                             "ORDER BY h.hour, req.api_key_id, req.service_id")
        + ") SELECT uid FROM req"
    )


_METER = Statement(_meter_sql)

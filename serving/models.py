"""Model services, applications, knowledge bases, API keys and the gateway's token ledger.

Every row here carries a real `tenant` foreign key, and every query that reads it filters by
that column first: the compute pool is shared, services and data are not. API keys are stored
only as a keyed hash (the secret itself never touches the database), and token usage is
written once per gateway request (a per-request row whose unique id is the idempotency key)
and rolled into an hourly ledger in the same transaction. Nothing in this module changes
state on its own; serving.services does, with permission checks and audit.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.indexes import GinIndex
from django.contrib.postgres.search import SearchVectorField
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from tenants.models import slug_validator

__all__ = [
    "ApiKey", "Application", "Chunk", "Document", "GatewayRequest", "KnowledgeBase", "ModelService",
    "ServiceStatus", "ServingAlarm", "ServingLimits", "TokenUsage", "Visibility",
]


class ServiceStatus(models.TextChoices):
    DRAFT = "draft", "draft"
    PUBLISHED = "published", "published"
    RETIRED = "retired", "retired"


class Visibility(models.TextChoices):
    PROJECT = "project", "this project only"
    TENANT = "tenant", "every project of the tenant"


class ModelService(models.Model):
    """A deployed model: a long-lived scheduling Job (kind "service") plus its upstream endpoint."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="model_services")
    slug = models.CharField(
        max_length=40, validators=[slug_validator],
        help_text='what clients send as "model"; unique within the tenant',
    )
    name = models.CharField(max_length=120)
    base_model = models.CharField(max_length=120, help_text="e.g. meta-llama/Llama-3.1-8B-Instruct")
    model_version = models.CharField(max_length=60, blank=True)
    spec = models.ForeignKey("scheduling.ResourceSpec", on_delete=models.PROTECT, related_name="+")
    priority_class = models.ForeignKey("scheduling.PriorityClass", on_delete=models.PROTECT, related_name="+")
    replicas = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    image = models.CharField(max_length=300, default="vllm/vllm-openai:latest")
    upstream_url = models.URLField(
        max_length=300, help_text="OpenAI-compatible base URL of the model server, e.g. http://10.0.0.5:8000/v1"
    )
    upstream_model = models.CharField(max_length=200, blank=True, help_text='"model" sent upstream; default: base model')
    connect_timeout = models.FloatField(default=2.0)
    read_timeout = models.FloatField(default=60.0)
    status = models.CharField(max_length=10, choices=ServiceStatus.choices, default=ServiceStatus.DRAFT, db_index=True)
    visibility = models.CharField(max_length=8, choices=Visibility.choices, default=Visibility.PROJECT)
    job = models.ForeignKey("scheduling.Job", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    created = models.DateTimeField(default=timezone.now)
    published = models.DateTimeField(null=True, blank=True)
    retired = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["tenant", "slug"]
        default_permissions = ()
        constraints = [models.UniqueConstraint(fields=["tenant", "slug"], name="service_slug_per_tenant")]
        indexes = [models.Index(fields=["tenant", "status"])]

    def __str__(self) -> str:
        return self.slug

    @property
    def model_name_upstream(self) -> str:
        return self.upstream_model or self.base_model


class KnowledgeBase(models.Model):
    """Documents of one tenant; usable by every project of it or only by the chosen ones."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    slug = models.CharField(max_length=40, validators=[slug_validator])
    name = models.CharField(max_length=120)
    description = models.CharField(max_length=300, blank=True)
    all_projects = models.BooleanField(default=False, help_text="shared with every project of the tenant")
    projects = models.ManyToManyField("tenants.Project", blank=True, related_name="knowledge_bases",
                                      help_text="projects it is shared with (same tenant only)")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["tenant", "slug"]
        default_permissions = ()
        constraints = [models.UniqueConstraint(fields=["tenant", "slug"], name="kb_slug_per_tenant")]

    def __str__(self) -> str:
        return self.slug


class Document(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    knowledge_base = models.ForeignKey(KnowledgeBase, on_delete=models.CASCADE, related_name="documents")
    title = models.CharField(max_length=200)
    content_type = models.CharField(max_length=60)
    size = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64)
    chunk_count = models.PositiveIntegerField(default=0)
    uploaded_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    uploaded = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-uploaded"]
        default_permissions = ()

    def __str__(self) -> str:
        return self.title


class Chunk(models.Model):
    """A searchable piece of a document; `tenant` is repeated so every search filters on it first."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    knowledge_base = models.ForeignKey(KnowledgeBase, on_delete=models.CASCADE, related_name="chunks")
    document = models.ForeignKey(Document, on_delete=models.CASCADE, related_name="chunks")
    ordinal = models.PositiveIntegerField()
    text = models.TextField()
    # PostgreSQL tsvector; null on SQLite (the demo's fallback search is a containment match).
    search_vector = SearchVectorField(null=True, blank=True)

    class Meta:
        ordering = ["document", "ordinal"]
        default_permissions = ()
        indexes = [
            models.Index(fields=["tenant", "knowledge_base"]),
            GinIndex(fields=["search_vector"], name="serving_chunk_search_gin"),  # PostgreSQL only: migration 0002
        ]


class Application(models.Model):
    """A named app of a project: a model service, knowledge bases to retrieve from, a system prompt."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="applications")
    slug = models.CharField(max_length=40, validators=[slug_validator])
    name = models.CharField(max_length=120)
    service = models.ForeignKey(ModelService, on_delete=models.PROTECT, related_name="applications")
    knowledge_bases = models.ManyToManyField(KnowledgeBase, blank=True, related_name="applications")
    system_prompt = models.TextField(blank=True)
    top_k = models.PositiveSmallIntegerField(default=4)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["project", "slug"]
        default_permissions = ()
        constraints = [models.UniqueConstraint(fields=["project", "slug"], name="app_slug_per_project")]

    def __str__(self) -> str:
        return self.slug


class ApiKey(models.Model):
    """A project's key. Only `digest` (HMAC-SHA256 of the secret) is kept; `prefix` is for people."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=80)
    prefix = models.CharField(max_length=16, help_text="first characters of the key, to recognise it")
    digest = models.CharField(max_length=64, unique=True)
    services = models.ManyToManyField(ModelService, blank=True, related_name="api_keys")
    knowledge_bases = models.ManyToManyField(KnowledgeBase, blank=True, related_name="api_keys")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    created = models.DateTimeField(default=timezone.now)
    expires = models.DateTimeField(null=True, blank=True)
    revoked = models.DateTimeField(null=True, blank=True)
    replaced_by = models.OneToOneField("self", null=True, blank=True, on_delete=models.SET_NULL,
                                       related_name="replaces")
    last_used = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]
        default_permissions = ()
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… {self.name}"

    def is_usable(self, at=None) -> bool:
        at = at or timezone.now()
        return self.revoked is None and (self.expires is None or at < self.expires)

    @property
    def state(self) -> str:
        now = timezone.now()
        if self.revoked:
            return "revoked"
        if self.expires and now >= self.expires:
            return "expired"
        if self.replaced_by_id:
            return "rotating out"
        return "active"


class ServingLimits(models.Model):
    """Per-project gateway limits, set by the tenant's admins. Absent row = settings defaults."""

    project = models.OneToOneField("tenants.Project", on_delete=models.CASCADE, related_name="serving_limits")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    monthly_token_budget = models.BigIntegerField(null=True, blank=True, validators=[MinValueValidator(0)])

    class Meta:
        default_permissions = ()


class GatewayRequest(models.Model):
    """One metered gateway call. `uid` is generated by the gateway (never taken from the client):
    inserting it is the idempotency key that makes every request count exactly once."""

    uid = models.UUIDField(unique=True)
    time = models.DateTimeField(default=timezone.now)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="+")
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="requests")
    service = models.ForeignKey(ModelService, on_delete=models.PROTECT, related_name="requests")
    application = models.ForeignKey(Application, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    endpoint = models.CharField(max_length=40)
    input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    metered = models.BooleanField(default=True, help_text="false: the upstream reported no usage (never guessed)")
    note = models.CharField(max_length=200, blank=True)
    request_id = models.CharField(max_length=64, blank=True)

    class Meta:
        default_permissions = ()
        indexes = [models.Index(fields=["project", "time"]), models.Index(fields=["tenant", "time"])]


class TokenUsage(models.Model):
    """Hourly token ledger per (hour, key, service): what metering reads and prices."""

    hour = models.DateTimeField(help_text="start of the UTC hour")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="+")
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="usage")
    service = models.ForeignKey(ModelService, on_delete=models.PROTECT, related_name="usage")
    base_model = models.CharField(max_length=120)
    requests = models.PositiveIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    unmetered_requests = models.PositiveIntegerField(default=0)

    class Meta:
        default_permissions = ()
        constraints = [models.UniqueConstraint(fields=["hour", "api_key", "service"], name="token_usage_hour_key_service")]
        indexes = [models.Index(fields=["tenant", "hour"]), models.Index(fields=["project", "hour"])]

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class ServingAlarm(models.Model):
    """Raised once per (project, month, kind): e.g. the monthly token budget is used up."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="+")
    month = models.DateField()
    kind = models.CharField(max_length=30)
    message = models.CharField(max_length=300)
    raised = models.DateTimeField(default=timezone.now)

    class Meta:
        default_permissions = ()
        ordering = ["-raised"]
        constraints = [models.UniqueConstraint(fields=["project", "month", "kind"], name="serving_alarm_once")]

"""Request and response shapes of the API (pydantic models through django-ninja).

Outputs are built explicitly from rows the caller may see; no schema reads a relation the
caller could not see on its own (a job names its project, never the other jobs on its card).
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from ninja import Field, Schema

from api.models import TokenScope
from scheduling.models import JobState

# Django's form fields refuse NUL characters (ProhibitNullCharactersValidator) because PostgreSQL
# cannot store them in text or jsonb; every free-text input of the API says and enforces the same.
NO_NUL = r"^[^\x00]*$"
Text = Annotated[str, Field(pattern=NO_NUL)]


class Me(Schema):
    username: str
    email: str
    auth: str = Field(description='"token" or "session"')
    token_scope: str | None = None
    token_expires: dt.datetime | None = None
    platform_roles: list[str]


class ProjectRef(Schema):
    id: int
    tenant: str
    slug: str


class ProjectOut(ProjectRef):
    name: str
    project_class: str
    active: bool
    permissions: list[str] = Field(description="the caller's permissions on this project")


class SpecOut(Schema):
    id: int
    name: str
    description: str
    mode: str
    gpu_count: int
    mig_profile: str
    card_fraction: float = Field(description="cards per replica (a MIG slice counts its compute slices / 7)")
    cpu_cores: float
    memory_gib: float
    accelerator_models: list[str]
    isolation: str


class PriorityClassOut(Schema):
    name: str
    value: int
    preemptible: bool
    description: str


class JobIn(Schema):
    project: str = Field(description='project id, "tenant/project" or a project slug unique among your projects',
                         min_length=1, max_length=90, pattern=NO_NUL)
    spec: str = Field(description="resource spec name or id", min_length=1, max_length=40, pattern=NO_NUL)
    priority_class: str = Field(description="priority class name", min_length=1, max_length=30, pattern=NO_NUL)
    name: str = Field("", max_length=120, pattern=NO_NUL, description="defaults to the command's program name")
    image: str = Field(min_length=1, max_length=300, pattern=NO_NUL)
    command: list[Text] = Field(min_length=1, max_length=200)
    replicas: int = Field(1, ge=1, le=64)
    expected_minutes: int = Field(60, ge=1, le=60 * 24 * 30)
    time_limit_minutes: int = Field(24 * 60, ge=1, le=60 * 24 * 30)


class CancelIn(Schema):
    reason: str = Field("", max_length=300, pattern=NO_NUL)


class JobOut(Schema):
    id: int
    name: str
    kind: str
    project: ProjectRef
    submitter: str
    spec: str
    priority_class: str
    replicas: int
    state: JobState
    wait_reason: str = Field(description='machine-readable reason a pending job waits ("" when not waiting)')
    wait_message: str
    queue_position: int | None
    submitted: dt.datetime
    started: dt.datetime | None
    finished: dt.datetime | None


class BindingOut(Schema):
    replica: int
    node: str
    accelerator: str = Field(description="card uuid")
    accelerator_model: str
    share: float = Field(description="share of the card held (1.0 = whole card)")
    mig_profile: str
    start: dt.datetime
    end: dt.datetime | None
    end_reason: str


class JobEventOut(Schema):
    time: dt.datetime
    kind: str
    message: str


class JobDetail(JobOut):
    image: str
    command: list[str]
    expected_minutes: int
    time_limit_minutes: int
    admitted: dt.datetime | None
    borrowed: bool
    preemptions: int
    bindings: list[BindingOut]
    events: list[JobEventOut]


class JobPage(Schema):
    count: int
    limit: int
    offset: int
    items: list[JobOut]


class QuotaOut(Schema):
    id: int
    tenant: str
    project: str | None = Field(description="project slug; null for the tenant's own line")
    resource: str
    accelerator_model: str | None
    guaranteed: float
    limit: float
    in_use: float = Field(description="what running work holds now (card-hours so far this month for card_hours_month)")


class AuditEventOut(Schema):
    id: int
    time: dt.datetime
    actor: str
    action: str
    outcome: str
    tenant: str | None
    project: str | None
    target_type: str
    target_id: str
    target_label: str
    reason: str
    before: dict | list | None
    after: dict | list | None
    source_ip: str
    request_id: str
    sudo: bool


class AuditPage(Schema):
    count: int
    limit: int
    offset: int
    items: list[AuditEventOut]


class TokenIn(Schema):
    name: str = Field(min_length=1, max_length=80, pattern=NO_NUL)
    scope: TokenScope = TokenScope.READ
    expires_in_days: int = Field(30, ge=1, le=365)


class TokenOut(Schema):
    id: int
    name: str
    prefix: str
    scope: str
    created: dt.datetime
    expires: dt.datetime
    last_used: dt.datetime | None
    revoked: dt.datetime | None


class TokenCreated(Schema):
    token: TokenOut
    secret: str = Field(description="the token itself; shown this once and never again")


class ScopeRef(Schema):
    id: int
    slug: str


class ApiKeyOut(Schema):
    """A project's API key as people see it: never the secret, never its digest."""

    id: int
    name: str
    prefix: str
    state: str = Field(description="active, rotating out, expired or revoked")
    services: list[ScopeRef]
    knowledge_bases: list[ScopeRef]
    created: dt.datetime
    expires: dt.datetime | None
    revoked: dt.datetime | None
    last_used: dt.datetime | None
    replaced_by: int | None = Field(description="the key that replaced this one on rotation")


class ApiKeyIn(Schema):
    name: str = Field(min_length=1, max_length=80, pattern=NO_NUL)
    services: list[int] = Field([], max_length=100, description="ids of model services available to the project")
    knowledge_bases: list[int] = Field([], max_length=100, description="ids of knowledge bases shared with the project")
    expires: dt.datetime | None = Field(None, description="when the key stops working; none: never")


class ApiKeyCreated(Schema):
    key: ApiKeyOut
    secret: str = Field(description="the key itself; shown this once and never again")


class ApiKeyRevokeIn(Schema):
    reason: str = Field("", max_length=200, pattern=NO_NUL)

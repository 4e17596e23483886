"""Tenants, projects, who belongs to them in which role, and vendor access.

The tenant is the isolation boundary: every tenant-owned row elsewhere carries a real
`tenant` foreign key. Memberships are the source of truth for roles; the role groups and
their guardian object permissions are derived from them by tenants.services and must never
be edited by hand.
"""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone
from guardian.models import GroupObjectPermissionBase, UserObjectPermissionBase

from tenants.roles import PLATFORM_PERMS, PLATFORM_ROLES, PROJECT_PERMS, PROJECT_ROLES, TENANT_PERMS, TENANT_ROLES

slug_validator = RegexValidator(
    r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$",
    "Use 1-40 lowercase letters, digits and hyphens, starting and ending with a letter or digit.",
)


class TenantState(models.TextChoices):
    ACTIVE = "active", "active"
    SUSPENDED = "suspended", "suspended"


class ProjectClass(models.TextChoices):
    PRODUCTION = "production", "production"
    RESEARCH = "research", "research"
    DEVELOPMENT = "development", "development"


class Tenant(models.Model):
    slug = models.CharField(max_length=40, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=120)
    state = models.CharField(max_length=12, choices=TenantState.choices, default=TenantState.ACTIVE)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["slug"]
        default_permissions = ()
        permissions = list(TENANT_PERMS.items())

    def __str__(self) -> str:
        return self.slug


class Project(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="projects")
    slug = models.CharField(max_length=40, validators=[slug_validator])
    name = models.CharField(max_length=120)
    project_class = models.CharField(
        "class", max_length=12, choices=ProjectClass.choices, default=ProjectClass.RESEARCH
    )
    cost_centre = models.CharField(max_length=40, blank=True)
    archived = models.DateTimeField(null=True, blank=True)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["tenant__slug", "slug"]
        default_permissions = ()
        permissions = list(PROJECT_PERMS.items())
        constraints = [models.UniqueConstraint(fields=["tenant", "slug"], name="project_slug_per_tenant")]

    def __str__(self) -> str:
        return f"{self.tenant.slug}/{self.slug}"

    @property
    def is_active(self) -> bool:
        return self.archived is None and self.tenant.state == TenantState.ACTIVE


class MembershipSource(models.TextChoices):
    LOCAL = "local", "granted in Atrium"
    OIDC = "oidc", "from the identity provider"


class TenantMembership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=[(r, r) for r in TENANT_ROLES])
    source = models.CharField(max_length=8, choices=MembershipSource.choices, default=MembershipSource.LOCAL)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        default_permissions = ()
        constraints = [models.UniqueConstraint(fields=["user", "tenant", "role"], name="tenant_membership_unique")]

    def __str__(self) -> str:
        return f"{self.user} {self.role} of {self.tenant}"


class ProjectMembership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="project_memberships")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    role = models.CharField(max_length=20, choices=[(r, r) for r in PROJECT_ROLES])
    source = models.CharField(max_length=8, choices=MembershipSource.choices, default=MembershipSource.LOCAL)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        default_permissions = ()
        constraints = [models.UniqueConstraint(fields=["user", "project", "role"], name="project_membership_unique")]

    def __str__(self) -> str:
        return f"{self.user} {self.role} of {self.project}"


class PlatformRoleAssignment(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="platform_roles")
    role = models.CharField(max_length=20, choices=[(r, r) for r in PLATFORM_ROLES])
    source = models.CharField(max_length=8, choices=MembershipSource.choices, default=MembershipSource.LOCAL)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        default_permissions = ()
        # Platform permissions hang on this model's content type (model-level permissions,
        # given only to platform role groups).
        permissions = list(PLATFORM_PERMS.items())
        constraints = [models.UniqueConstraint(fields=["user", "role"], name="platform_role_unique")]

    def __str__(self) -> str:
        return f"{self.user} {self.role}"


class ExternalIdentity(models.Model):
    """A user as the OpenID Provider knows them: matched on (issuer, subject), never email."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="identities")
    issuer = models.CharField(max_length=300)
    subject = models.CharField(max_length=255)
    last_login = models.DateTimeField(null=True, blank=True)

    class Meta:
        default_permissions = ()
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="identity_unique")]


class WorkOrder(models.Model):
    """A vendor's reason to touch hardware: the nodes and cards it concerns."""

    title = models.CharField(max_length=200)
    reason = models.TextField()
    nodes = models.ManyToManyField("scheduling.Node", blank=True, related_name="work_orders")
    accelerators = models.ManyToManyField("scheduling.Accelerator", blank=True, related_name="work_orders")
    opened_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    opened = models.DateTimeField(default=timezone.now)
    closed = models.DateTimeField(null=True, blank=True)

    class Meta:
        default_permissions = ()
        ordering = ["-opened"]

    def __str__(self) -> str:
        return f"WO-{self.pk}: {self.title}"


class VendorGrant(models.Model):
    vendor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="vendor_grants")
    work_order = models.ForeignKey(WorkOrder, on_delete=models.CASCADE, related_name="grants")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    starts = models.DateTimeField()
    expires = models.DateTimeField()
    revoked = models.DateTimeField(null=True, blank=True)

    class Meta:
        default_permissions = ()
        ordering = ["-starts"]
        constraints = [
            models.CheckConstraint(condition=models.Q(expires__gt=models.F("starts")), name="grant_expires_after_start"),
        ]

    def __str__(self) -> str:
        return f"{self.vendor} on {self.work_order}"

    def is_valid(self, at=None) -> bool:
        at = at or timezone.now()
        return self.approved_by_id is not None and self.revoked is None and self.starts <= at < self.expires


# guardian: per-model permission tables with real foreign keys (NetBox/guardian "direct" mode).
class TenantGroupObjectPermission(GroupObjectPermissionBase):
    content_object = models.ForeignKey(Tenant, on_delete=models.CASCADE)


class TenantUserObjectPermission(UserObjectPermissionBase):
    content_object = models.ForeignKey(Tenant, on_delete=models.CASCADE)


class ProjectGroupObjectPermission(GroupObjectPermissionBase):
    content_object = models.ForeignKey(Project, on_delete=models.CASCADE)


class ProjectUserObjectPermission(UserObjectPermissionBase):
    content_object = models.ForeignKey(Project, on_delete=models.CASCADE)

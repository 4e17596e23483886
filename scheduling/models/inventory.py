"""The physical fleet: accelerator models, pools, nodes, cards and their health history.

Inventory is platform-owned (no tenant); what a card is doing for whom is answered by
Binding rows, never stored here. Health changes go through scheduling.services so they are
audited and placement stops seeing an unhealthy card at once.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class Vendor(models.TextChoices):
    NVIDIA = "nvidia", "NVIDIA"
    AMD = "amd", "AMD"


class AcceleratorModel(models.Model):
    name = models.CharField(max_length=60, unique=True, help_text="product name, e.g. H100-SXM5-80GB")
    short_name = models.CharField(max_length=20, help_text="what users call it, e.g. H100")
    vendor = models.CharField(max_length=10, choices=Vendor.choices)
    memory_gib = models.PositiveIntegerField()
    mig_profiles = models.JSONField(default=list, blank=True, help_text='e.g. ["1g.10gb", "3g.40gb"]')
    nvlink = models.BooleanField(default=False)

    class Meta:
        ordering = ["vendor", "name"]
        default_permissions = ()

    def __str__(self) -> str:
        return self.name


class ResourcePool(models.Model):
    name = models.SlugField(max_length=40, unique=True)
    description = models.CharField(max_length=200, blank=True)
    allows_sharing = models.BooleanField(default=False, help_text="fractional shares of a card")
    mig_enabled = models.BooleanField(default=False, help_text="cards are partitioned with MIG")

    class Meta:
        ordering = ["name"]
        default_permissions = ()

    def __str__(self) -> str:
        return self.name


class NodeState(models.TextChoices):
    READY = "ready", "ready"
    CORDONED = "cordoned", "cordoned"
    DOWN = "down", "down"


class Node(models.Model):
    pool = models.ForeignKey(ResourcePool, on_delete=models.PROTECT, related_name="nodes")
    name = models.CharField(max_length=120, unique=True)
    cpu_milli = models.PositiveIntegerField()
    memory_mib = models.PositiveBigIntegerField()
    labels = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=10, choices=NodeState.choices, default=NodeState.READY)
    state_reason = models.CharField(max_length=200, blank=True)
    state_since = models.DateTimeField(default=timezone.now)
    retired = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["pool__name", "name"]
        default_permissions = ()

    def __str__(self) -> str:
        return self.name


class Health(models.TextChoices):
    HEALTHY = "healthy", "healthy"
    DEGRADED = "degraded", "degraded"
    QUARANTINED = "quarantined", "quarantined"
    FAILED = "failed", "failed"


class Accelerator(models.Model):
    """One physical card."""

    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="accelerators")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=80, unique=True)
    model = models.ForeignKey(AcceleratorModel, on_delete=models.PROTECT, related_name="cards")
    nvlink_domain = models.PositiveSmallIntegerField(default=0)
    mig_enabled = models.BooleanField(default=False)
    health = models.CharField(max_length=12, choices=Health.choices, default=Health.HEALTHY)
    health_reason = models.CharField(max_length=300, blank=True)
    health_since = models.DateTimeField(default=timezone.now)
    retired = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node__name", "index"]
        default_permissions = ()
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="card_index_per_node")]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index}"


class HealthEventKind(models.TextChoices):
    XID = "xid", "XID error"
    ECC_DBE = "ecc_dbe", "double-bit ECC error"
    ROW_REMAP = "row_remap", "row-remap failure"
    THERMAL = "thermal", "thermal violation"
    MISSING = "missing", "device missing"
    INTERFERENCE = "interference", "share over its allotment"
    MANUAL = "manual", "manual change"


class HealthEvent(models.Model):
    accelerator = models.ForeignKey(Accelerator, on_delete=models.CASCADE, related_name="health_events")
    time = models.DateTimeField(default=timezone.now, db_index=True)
    kind = models.CharField(max_length=14, choices=HealthEventKind.choices)
    code = models.IntegerField(null=True, blank=True, help_text="e.g. the XID number")
    message = models.CharField(max_length=300)
    resulting_health = models.CharField(max_length=12, choices=Health.choices)

    class Meta:
        ordering = ["-time"]
        default_permissions = ()

    def __str__(self) -> str:
        return f"{self.accelerator} {self.kind} {self.code or ''}".strip()

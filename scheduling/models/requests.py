"""What users may ask for: standard resource specs, priority classes and quotas.

Specs hide the fleet's details behind a small catalogue; priority classes say who may jump
the queue and who may be preempted; quotas are hard limits (with a guaranteed part) checked
before a job competes for cards. All three are platform policy, changed only through
services that check `manage_policy` / quota permissions and audit.
"""

from __future__ import annotations

from django.db import models


class ShareMode(models.TextChoices):
    WHOLE = "whole", "whole card"
    MIG = "mig", "MIG slice"
    FRACTION = "fraction", "fractional share"


ISOLATION = {
    ShareMode.WHOLE: "whole card",
    ShareMode.MIG: "MIG: hardware-isolated memory and faults",
    ShareMode.FRACTION: "shared: no memory isolation",
}


class ResourceSpec(models.Model):
    name = models.CharField(max_length=40, unique=True, help_text='what users pick, e.g. "h100-80g x1"')
    description = models.CharField(max_length=200, blank=True)
    accelerator_models = models.ManyToManyField("scheduling.AcceleratorModel", related_name="specs")
    pools = models.ManyToManyField("scheduling.ResourcePool", blank=True, related_name="specs")
    mode = models.CharField(max_length=10, choices=ShareMode.choices, default=ShareMode.WHOLE)
    gpu_count = models.PositiveSmallIntegerField(default=1)
    mig_profile = models.CharField(max_length=20, blank=True)
    fraction_milli = models.PositiveSmallIntegerField(default=1000, help_text="share of one card, in thousandths")
    cpu_milli = models.PositiveIntegerField()
    memory_mib = models.PositiveIntegerField()
    active = models.BooleanField(default=True)

    class Meta:
        ordering = ["name"]
        default_permissions = ()

    def __str__(self) -> str:
        return self.name

    @property
    def isolation(self) -> str:
        return ISOLATION[ShareMode(self.mode)]

    @property
    def card_fraction(self) -> float:
        """Cards this spec takes per replica (a MIG slice counts its compute slices / 7)."""
        if self.mode == ShareMode.WHOLE:
            return float(self.gpu_count)
        if self.mode == ShareMode.FRACTION:
            return self.fraction_milli / 1000
        slices = int(self.mig_profile.split("g.", 1)[0]) if "g." in self.mig_profile else 7
        return slices / 7


class PriorityClass(models.Model):
    name = models.SlugField(max_length=30, unique=True)
    value = models.IntegerField(unique=True)
    preemptible = models.BooleanField(default=True)
    allowed_project_classes = models.JSONField(default=list, blank=True, help_text="empty = every class")
    allowed_roles = models.JSONField(default=list, blank=True, help_text="project roles that may use it; empty = all")
    description = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["-value"]
        default_permissions = ()
        verbose_name_plural = "priority classes"

    def __str__(self) -> str:
        return self.name


class QuotaResource(models.TextChoices):
    GPUS = "gpus", "GPUs"
    GPU_MEMORY_GIB = "gpu_memory_gib", "GPU memory (GiB)"
    CPU_CORES = "cpu_cores", "CPU cores"
    MEMORY_GIB = "memory_gib", "memory (GiB)"
    JOBS = "jobs", "concurrent jobs"
    CARD_HOURS_MONTH = "card_hours_month", "card-hours per month"


class Quota(models.Model):
    """One dimension of a tenant's or project's quota: guaranteed amount and hard limit."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="quotas")
    project = models.ForeignKey(
        "tenants.Project", null=True, blank=True, on_delete=models.CASCADE, related_name="quotas"
    )
    resource = models.CharField(max_length=20, choices=QuotaResource.choices)
    accelerator_model = models.ForeignKey(
        "scheduling.AcceleratorModel", null=True, blank=True, on_delete=models.PROTECT,
        help_text="for GPUs: the model this line counts",
    )
    guaranteed = models.DecimalField(max_digits=12, decimal_places=3, default=0)
    limit = models.DecimalField(max_digits=12, decimal_places=3)

    class Meta:
        default_permissions = ()
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "project", "resource", "accelerator_model"],
                name="quota_line_unique", nulls_distinct=False,
            ),
            models.CheckConstraint(condition=models.Q(limit__gte=models.F("guaranteed")), name="quota_limit_ge_guaranteed"),
            models.CheckConstraint(condition=models.Q(guaranteed__gte=0), name="quota_guaranteed_non_negative"),
        ]

    def __str__(self) -> str:
        owner = self.project or self.tenant
        what = f"{self.accelerator_model.short_name} " if self.accelerator_model_id else ""
        return f"{owner}: {what}{self.get_resource_display()} {self.guaranteed}/{self.limit}"

    @property
    def key(self) -> str:
        return f"gpu:{self.accelerator_model.name}" if self.resource == QuotaResource.GPUS else self.resource

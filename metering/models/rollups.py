"""Daily and monthly rollups of the ledger, and per-pool capacity (used, idle, faulty).

Every row is keyed by its period and its grouping and is written by upsert from the ledger
(recomputed, never incremented), so a rollup run twice, or killed half-way and retried,
holds the same totals. Rows are derived data: never edit them by hand, rebuild them.
"""

from __future__ import annotations

from django.db import models


class Granularity(models.TextChoices):
    DAY = "day", "day"
    MONTH = "month", "month"


class UsageRollup(models.Model):
    """Card time and list cost per (period, tenant, project, accelerator model, pool)."""

    granularity = models.CharField(max_length=5, choices=Granularity.choices)
    period = models.DateField(help_text="the day, or the first day of the month")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="+")
    accelerator_model = models.ForeignKey("scheduling.AcceleratorModel", on_delete=models.PROTECT, related_name="+")
    pool = models.ForeignKey("scheduling.ResourcePool", on_delete=models.PROTECT, related_name="+")
    milli_card_seconds = models.BigIntegerField()
    cost = models.DecimalField(max_digits=16, decimal_places=6, help_text="list cost at the prices of each hour")

    class Meta:
        default_permissions = ()
        constraints = [
            models.UniqueConstraint(
                fields=["granularity", "period", "tenant", "project", "accelerator_model", "pool"], name="usage_rollup_key",
            ),
        ]
        indexes = [models.Index(fields=["granularity", "period"]), models.Index(fields=["tenant", "period"])]


class PoolCapacity(models.Model):
    """Per (period, pool, accelerator model): healthy capacity, its use, idle and faulty time.

    Idle = healthy capacity that nobody used (idle cost, kept per pool). Faulty = card time
    on quarantined or failed cards: not idle cost, reported apart.
    """

    granularity = models.CharField(max_length=5, choices=Granularity.choices)
    period = models.DateField()
    pool = models.ForeignKey("scheduling.ResourcePool", on_delete=models.PROTECT, related_name="+")
    accelerator_model = models.ForeignKey("scheduling.AcceleratorModel", on_delete=models.PROTECT, related_name="+")
    healthy_milli_card_seconds = models.BigIntegerField(default=0)
    used_milli_card_seconds = models.BigIntegerField(default=0)
    idle_milli_card_seconds = models.BigIntegerField(default=0)
    faulty_milli_card_seconds = models.BigIntegerField(default=0)
    idle_cost = models.DecimalField(max_digits=16, decimal_places=6, default=0)
    faulty_cost = models.DecimalField(max_digits=16, decimal_places=6, default=0)

    class Meta:
        default_permissions = ()
        constraints = [
            models.UniqueConstraint(fields=["granularity", "period", "pool", "accelerator_model"], name="pool_capacity_key"),
        ]

"""The usage ledger and prices: card time by hour, attributed to tenant, project and model.

The ledger is derived from scheduling Bindings: one row per (binding, hour) holding the
milli-card-seconds of that binding inside that hour. Rows are upserted on that unique key, so
accruing the same interval twice, or after a crash half-way, never counts twice.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class UsageRecord(models.Model):
    hour = models.DateTimeField(help_text="start of the UTC hour")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="+")
    accelerator_model = models.ForeignKey("scheduling.AcceleratorModel", on_delete=models.PROTECT, related_name="+")
    pool = models.ForeignKey("scheduling.ResourcePool", on_delete=models.PROTECT, related_name="+")
    job = models.ForeignKey("scheduling.Job", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    binding = models.ForeignKey("scheduling.Binding", on_delete=models.PROTECT, related_name="usage")
    milli_card_seconds = models.BigIntegerField(help_text="seconds x share of the card in thousandths")

    class Meta:
        default_permissions = ()
        constraints = [models.UniqueConstraint(fields=["binding", "hour"], name="usage_binding_hour")]
        indexes = [
            models.Index(fields=["tenant", "hour"]),
            models.Index(fields=["project", "hour"]),
            models.Index(fields=["hour"]),
        ]

    @property
    def card_hours(self) -> float:
        return self.milli_card_seconds / 1000 / 3600


class Price(models.Model):
    """Price of one card-hour of an accelerator model, from a date on (past cost never moves)."""

    accelerator_model = models.ForeignKey("scheduling.AcceleratorModel", on_delete=models.PROTECT, related_name="prices")
    per_card_hour = models.DecimalField(max_digits=10, decimal_places=4)
    effective_from = models.DateTimeField(default=timezone.now)

    class Meta:
        default_permissions = ()
        ordering = ["accelerator_model", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["accelerator_model", "effective_from"], name="price_once_per_date"),
            models.CheckConstraint(condition=models.Q(per_card_hour__gte=0), name="price_non_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.accelerator_model} {self.per_card_hour}/card-hour from {self.effective_from:%Y-%m-%d}"


class TokenUsage(models.Model):
    """Tokens served by the gateway per (hour, API key, project, model service).

    The gateway (serving app) writes these rows by upsert on the unique key; until serving
    exists the key and service are plain identifiers, not foreign keys.
    """

    hour = models.DateTimeField(help_text="start of the UTC hour")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="+")
    api_key = models.CharField(max_length=64, blank=True, help_text="key prefix, never the secret")
    model_service = models.CharField(max_length=120)
    model_name = models.CharField(max_length=120, help_text="served model, the token price key")
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    requests = models.BigIntegerField(default=0)

    class Meta:
        default_permissions = ()
        constraints = [
            models.UniqueConstraint(fields=["hour", "api_key", "project", "model_service"], name="token_usage_key_hour"),
        ]
        indexes = [models.Index(fields=["project", "hour"]), models.Index(fields=["tenant", "hour"])]


class TokenPrice(models.Model):
    """Price per million input and output tokens of one served model, from a date on."""

    model_name = models.CharField(max_length=120)
    per_million_input = models.DecimalField(max_digits=10, decimal_places=4)
    per_million_output = models.DecimalField(max_digits=10, decimal_places=4)
    effective_from = models.DateTimeField(default=timezone.now)

    class Meta:
        default_permissions = ()
        ordering = ["model_name", "-effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["model_name", "effective_from"], name="token_price_once_per_date"),
            models.CheckConstraint(
                condition=models.Q(per_million_input__gte=0, per_million_output__gte=0), name="token_price_non_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model_name} {self.per_million_input}/{self.per_million_output} per M tokens"

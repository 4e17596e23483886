"""Budgets: a monthly limit on a tenant's or a project's spending, with alarm thresholds.

A budget applies to every calendar month (UTC) from its creation; spending is measured from
the ledger, so crossing is seen as soon as usage is accrued. `block` makes the scheduler hold
new jobs of the scope with wait reason `budget` until the month ends or the budget is raised.
Changed only through metering.services.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class BudgetUnit(models.TextChoices):
    MONEY = "money", "money"
    CARD_HOURS = "card_hours", "card-hours"
    TOKENS = "tokens", "tokens"


class BudgetMode(models.TextChoices):
    WARN = "warn", "warn only"
    BLOCK = "block", "block new jobs at 100 %"


def default_thresholds() -> list[int]:
    return [80, 100]


class Budget(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="budgets")
    project = models.ForeignKey(
        "tenants.Project", null=True, blank=True, on_delete=models.CASCADE, related_name="budgets",
        help_text="empty: the whole tenant",
    )
    unit = models.CharField(max_length=10, choices=BudgetUnit.choices, default=BudgetUnit.MONEY)
    amount = models.DecimalField(max_digits=14, decimal_places=2)
    thresholds = models.JSONField(default=default_thresholds, help_text="percent of the amount, e.g. [80, 100]")
    mode = models.CharField(max_length=5, choices=BudgetMode.choices, default=BudgetMode.WARN)
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        default_permissions = ()
        ordering = ["tenant__slug", "project__slug"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "unit"], condition=models.Q(project__isnull=True),
                                    name="budget_one_per_tenant_unit"),
            models.UniqueConstraint(fields=["project", "unit"], condition=models.Q(project__isnull=False),
                                    name="budget_one_per_project_unit"),
            models.CheckConstraint(condition=models.Q(amount__gt=0), name="budget_amount_positive"),
        ]

    def __str__(self) -> str:
        scope = self.project or self.tenant
        return f"{scope}: {self.amount} {self.get_unit_display()} per month ({self.mode})"

    @property
    def scope_label(self) -> str:
        return f"{self.tenant.slug} / {self.project.slug}" if self.project_id else f"{self.tenant.slug} (tenant)"

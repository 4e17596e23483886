"""Alarms: one row per condition a person should act on (quota nearly used, budget crossed,
card quarantined, job preempted or requeued, interference), shown on dashboards.

An alarm is keyed by `dedupe_key`, so the condition seen again on every cycle stays ONE
alarm; raising and resolving go through metering.services only, never through this module.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class AlarmKind(models.TextChoices):
    QUOTA_NEARLY_USED = "quota_nearly_used", "quota nearly used"
    BUDGET_THRESHOLD = "budget_threshold", "budget threshold crossed"
    CARD_QUARANTINED = "card_quarantined", "card quarantined"
    JOB_PREEMPTED = "job_preempted", "job preempted"
    INTERFERENCE = "interference", "interference"
    JOB_REQUEUED = "job_requeued", "job requeued"


class AlarmSeverity(models.TextChoices):
    INFO = "info", "info"
    WARNING = "warning", "warning"
    CRITICAL = "critical", "critical"


class Alarm(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="alarms")
    project = models.ForeignKey("tenants.Project", null=True, blank=True, on_delete=models.CASCADE, related_name="alarms")
    kind = models.CharField(max_length=24, choices=AlarmKind.choices)
    severity = models.CharField(max_length=8, choices=AlarmSeverity.choices, default=AlarmSeverity.WARNING)
    message = models.TextField(help_text="what happened, in words a person reads")
    action = models.TextField(blank=True, help_text="what to do about it")
    dedupe_key = models.CharField(max_length=200, unique=True)
    raised = models.DateTimeField(default=timezone.now, db_index=True)
    resolved = models.DateTimeField(null=True, blank=True)

    class Meta:
        default_permissions = ()
        ordering = ["-raised", "-id"]
        indexes = [
            models.Index(fields=["tenant", "resolved"]),
            models.Index(fields=["project", "resolved"]),
        ]

    def __str__(self) -> str:
        return f"[{self.severity}] {self.message}"

    @property
    def is_open(self) -> bool:
        return self.resolved is None

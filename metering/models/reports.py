"""Showback and chargeback reports: a request, built by an RQ job, downloaded as files.

The scope is fixed when the report is requested (every tenant, one tenant or one project)
and the rows are read again through the requester's visibility when the job runs, so a
report never holds a row its requester may not see.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class ReportGrouping(models.TextChoices):
    TENANT = "tenant", "tenant"
    PROJECT = "project", "project"
    ACCELERATOR_MODEL = "accelerator_model", "accelerator model"
    MODEL_SERVICE = "model_service", "model service"
    DAY = "day", "day"


class ReportMode(models.TextChoices):
    SHOWBACK = "showback", "showback (idle cost apart)"
    CHARGEBACK = "chargeback", "chargeback (idle cost shared by use)"


class ReportStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    DONE = "done", "done"
    FAILED = "failed", "failed"


class Report(models.Model):
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.PROTECT, related_name="+",
                               help_text="empty: every tenant the requester may see")
    project = models.ForeignKey("tenants.Project", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    period_start = models.DateField()
    period_end = models.DateField(help_text="exclusive")
    grouping = models.CharField(max_length=20, choices=ReportGrouping.choices, default=ReportGrouping.TENANT)
    mode = models.CharField(max_length=10, choices=ReportMode.choices, default=ReportMode.SHOWBACK)
    status = models.CharField(max_length=8, choices=ReportStatus.choices, default=ReportStatus.QUEUED)
    progress = models.PositiveSmallIntegerField(default=0, help_text="percent")
    error = models.TextField(blank=True)
    currency = models.CharField(max_length=3)
    total_card_hours = models.DecimalField(max_digits=18, decimal_places=6, null=True, blank=True)
    total_cost = models.DecimalField(max_digits=20, decimal_places=6, null=True, blank=True)
    lines = models.PositiveIntegerField(default=0)
    csv_file = models.FileField(upload_to="reports/", blank=True)
    xlsx_file = models.FileField(upload_to="reports/", blank=True)
    focus_file = models.FileField(upload_to="reports/", blank=True)
    created = models.DateTimeField(default=timezone.now, db_index=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        default_permissions = ()
        ordering = ["-created", "-id"]

    def __str__(self) -> str:
        return f"report #{self.pk} {self.period_start}..{self.period_end} by {self.grouping}"

    @property
    def scope_label(self) -> str:
        if self.project_id:
            return f"project {self.project.slug}"
        if self.tenant_id:
            return f"tenant {self.tenant.slug}"
        return "every tenant"

    @property
    def scope_filter(self) -> models.Q:
        """The report's scope on any usage row with tenant and project columns (every tenant: none)."""
        if self.project_id:
            return models.Q(project_id=self.project_id)
        if self.tenant_id:
            return models.Q(tenant_id=self.tenant_id)
        return models.Q()

    @property
    def is_finished(self) -> bool:
        return self.status in (ReportStatus.DONE, ReportStatus.FAILED)

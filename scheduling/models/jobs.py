"""Jobs, their event timeline and the job <-> card bindings with start and end.

A Binding is the history of who held which card (or share of it) and when: metering accrues
from it and the portal answers "what is on card X at time T" and "which cards did job Y
use" from it. Bindings are closed (end set), never deleted. Job state changes only through
scheduling.services and the cycle runner.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class JobState(models.TextChoices):
    PENDING = "pending", "pending"
    ADMITTED = "admitted", "admitted"
    RUNNING = "running", "running"
    SUCCEEDED = "succeeded", "succeeded"
    FAILED = "failed", "failed"
    CANCELLED = "cancelled", "cancelled"
    PREEMPTED = "preempted", "preempted"


ACTIVE_STATES = (JobState.ADMITTED, JobState.RUNNING)
FINAL_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class WaitReason(models.TextChoices):
    NONE = "", "not waiting"
    QUEUED = "queued", "waiting for the next scheduling cycle"
    QUOTA = "quota", "quota"
    CAPACITY = "capacity", "capacity"
    PRIORITY = "priority", "priority"
    HEALTH = "health", "health"
    BUDGET = "budget", "budget"
    SPEC_UNSATISFIABLE = "spec-unsatisfiable", "spec cannot be satisfied"
    PREEMPTED = "preempted", "preempted"
    INTERFERENCE = "interference", "requeued for interference on a shared card"


class JobKind(models.TextChoices):
    BATCH = "batch", "batch job"
    SERVICE = "service", "model service replica"


class Job(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="jobs")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="jobs")
    submitter = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=120)
    kind = models.CharField(max_length=8, choices=JobKind.choices, default=JobKind.BATCH)
    spec = models.ForeignKey("scheduling.ResourceSpec", on_delete=models.PROTECT, related_name="jobs")
    priority_class = models.ForeignKey("scheduling.PriorityClass", on_delete=models.PROTECT, related_name="jobs")
    replicas = models.PositiveSmallIntegerField(default=1)
    image = models.CharField(max_length=300)
    command = models.JSONField(default=list)
    time_limit_minutes = models.PositiveIntegerField(default=24 * 60)
    expected_minutes = models.PositiveIntegerField(
        default=60, help_text="declared run time; the simulated cluster runs the job this long"
    )
    state = models.CharField(max_length=10, choices=JobState.choices, default=JobState.PENDING, db_index=True)
    wait_reason = models.CharField(max_length=20, choices=WaitReason.choices, default=WaitReason.QUEUED, blank=True)
    wait_message = models.CharField(max_length=400, blank=True)
    queue_position = models.PositiveIntegerField(null=True, blank=True)
    borrowed = models.BooleanField(default=False, help_text="runs on capacity above the project's guarantee")
    submitted = models.DateTimeField(default=timezone.now, db_index=True)
    admitted = models.DateTimeField(null=True, blank=True)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)
    preemptions = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-submitted"]
        default_permissions = ()
        indexes = [
            models.Index(fields=["project", "state"]),
            models.Index(fields=["tenant", "state"]),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} {self.name}"

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES


class JobEvent(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    time = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=30)
    message = models.CharField(max_length=400)

    class Meta:
        ordering = ["time", "id"]
        default_permissions = ()


class BindingEnd(models.TextChoices):
    COMPLETED = "completed", "job finished"
    CANCELLED = "cancelled", "job cancelled"
    PREEMPTED = "preempted", "preempted"
    CARD_FAILED = "card_failed", "card failed"
    NODE_DOWN = "node_down", "node down"
    FAILED = "failed", "job failed"
    INTERFERENCE = "interference", "took more than its share"


class Binding(models.Model):
    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="bindings")
    accelerator = models.ForeignKey("scheduling.Accelerator", on_delete=models.PROTECT, related_name="bindings")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="+")
    project = models.ForeignKey("tenants.Project", on_delete=models.PROTECT, related_name="+")
    replica = models.PositiveSmallIntegerField(default=0)
    share_milli = models.PositiveSmallIntegerField(default=1000, help_text="thousandths of the card")
    mig_profile = models.CharField(max_length=20, blank=True)
    mig_slot = models.SmallIntegerField(null=True, blank=True)
    start = models.DateTimeField()
    end = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=12, choices=BindingEnd.choices, blank=True)

    class Meta:
        ordering = ["start", "id"]
        default_permissions = ()
        indexes = [
            models.Index(fields=["accelerator", "start"]),
            models.Index(fields=["accelerator", "end"]),
            models.Index(fields=["job"]),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(end__isnull=True) | models.Q(end__gte=models.F("start")),
                name="binding_end_after_start",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job} on {self.accelerator}"


class UtilisationSample(models.Model):
    """What one share of a card actually used at one instant, as the backend measured it.

    Only fractional bindings are sampled (a whole card or a MIG slice cannot take from anyone).
    `used_milli` is in thousandths of the whole card, so it compares directly with the
    binding's `share_milli`. Telemetry, not history: old samples are pruned (see
    scheduling.services.record_utilisation) and they go with their binding.
    """

    binding = models.ForeignKey(Binding, on_delete=models.CASCADE, related_name="utilisation")
    time = models.DateTimeField()
    used_milli = models.PositiveSmallIntegerField(help_text="thousandths of the whole card this share used")

    class Meta:
        ordering = ["time", "id"]
        default_permissions = ()
        indexes = [models.Index(fields=["time"])]
        constraints = [models.UniqueConstraint(fields=["binding", "time"], name="one_sample_per_binding_instant")]

    def __str__(self) -> str:
        return f"{self.binding_id} @ {self.time:%Y-%m-%d %H:%M:%S}: {self.used_milli}/1000"

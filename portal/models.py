"""The audit log: append-only, hash-chained events of every sensitive action.

Each event stores the hash of the event before it and the hash of its own canonical content,
so changing or removing a row behind the application's back breaks the chain and
`manage.py verify_audit` names the first broken event. Rows are never updated or deleted:
the model refuses it, and on PostgreSQL a trigger refuses it too.
"""

from __future__ import annotations

import hashlib
import json

from django.conf import settings
from django.db import models


class AuditOutcome(models.TextChoices):
    SUCCESS = "success", "success"
    DENIED = "denied", "denied"
    FAILED = "failed", "failed"


class AuditEventQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise PermissionError("audit events are append-only")

    def delete(self):
        raise PermissionError("audit events are append-only")


class AuditEvent(models.Model):
    time = models.DateTimeField(db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    actor_label = models.CharField(max_length=200, help_text="user name, service or API key id")
    on_behalf_of = models.CharField(max_length=200, blank=True)
    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    project = models.ForeignKey(
        "tenants.Project", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    action = models.CharField(max_length=80, db_index=True)
    target_type = models.CharField(max_length=80, blank=True)
    target_id = models.CharField(max_length=80, blank=True)
    target_label = models.CharField(max_length=300, blank=True)
    outcome = models.CharField(max_length=10, choices=AuditOutcome.choices)
    reason = models.TextField(blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    source_ip = models.CharField(max_length=64, blank=True)
    user_agent = models.CharField(max_length=400, blank=True)
    request_id = models.CharField(max_length=64, blank=True, db_index=True)
    sudo = models.BooleanField(default=False, help_text="a recent re-authentication was shown")
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64, unique=True)

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["tenant", "-time"]), models.Index(fields=["target_type", "target_id"])]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.time:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.target_label}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise PermissionError("audit events are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise PermissionError("audit events are append-only")

    def canonical(self) -> dict:
        return {
            "time": self.time.isoformat(),
            "actor": self.actor_id,
            "actor_label": self.actor_label,
            "on_behalf_of": self.on_behalf_of,
            "tenant": self.tenant_id,
            "project": self.project_id,
            "action": self.action,
            "target_type": self.target_type,
            "target_id": self.target_id,
            "target_label": self.target_label,
            "outcome": self.outcome,
            "reason": self.reason,
            "before": self.before,
            "after": self.after,
            "source_ip": self.source_ip,
            "user_agent": self.user_agent,
            "request_id": self.request_id,
            "sudo": self.sudo,
        }

    def compute_hash(self) -> str:
        body = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256((self.prev_hash + body).encode()).hexdigest()

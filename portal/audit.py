"""Writing and verifying audit events: the one path every sensitive action goes through.

`record()` must be called inside the transaction of the change it describes, so an event
exists exactly when the change does. Appends are serialised (an advisory lock on
PostgreSQL) so the hash chain never forks. This module never updates or deletes an event.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db import connection, transaction
from django.utils import timezone

from portal import context, locks
from portal.models import AuditEvent, AuditOutcome

GENESIS = "0" * 64
_CHAIN_LOCK = locks.AUDIT_CHAIN


def _json_safe(value):
    if value is None:
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, (int, float, str, bool)):
        return value
    return str(value)


def lock_chain() -> None:
    """Take the audit chain's lock now, for the rest of the current transaction.

    The chain's lock is the outermost lock: a service that locks rows (jobs, cards, nodes) and
    writes an audit event in the same transaction calls this before its first row lock. The
    scheduling cycle, cancel, the backends' state changes and health requeues all do, so no
    two of them wait on each other in a circle (row lock then chain lock deadlocked under load:
    cancels against the cycle, and runners against each other with the cycle lock off).
    Re-taking it in record() within the same transaction is free.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", [_CHAIN_LOCK])


def record(
    action: str,
    *,
    actor=None,
    target=None,
    target_type: str = "",
    target_id: str = "",
    target_label: str = "",
    tenant=None,
    project=None,
    outcome: str = AuditOutcome.SUCCESS,
    reason: str = "",
    before=None,
    after=None,
    on_behalf_of: str = "",
    actor_label: str = "",
) -> AuditEvent:
    ctx = context.current()
    if target is not None:
        target_type = target_type or target._meta.label_lower
        target_id = target_id or str(target.pk)
        target_label = target_label or str(target)[:300]
    if tenant is None and project is not None:
        tenant = project.tenant
    user = actor if getattr(actor, "is_authenticated", False) else None
    label = actor_label or (user.get_username() if user else "") or ctx.actor_label or "anonymous"
    with transaction.atomic():
        lock_chain()
        last = AuditEvent.objects.order_by("-id").values_list("hash", flat=True).first()
        event = AuditEvent(
            time=timezone.now(),
            actor=user,
            actor_label=label[:200],
            on_behalf_of=on_behalf_of[:200],
            tenant=tenant,
            project=project,
            action=action,
            target_type=target_type,
            target_id=str(target_id)[:80],
            target_label=target_label[:300],
            outcome=outcome,
            reason=reason,
            before=_json_safe(before),
            after=_json_safe(after),
            source_ip=ctx.source_ip,
            user_agent=ctx.user_agent,
            request_id=ctx.request_id,
            sudo=ctx.sudo,
            prev_hash=last or GENESIS,
        )
        event.hash = event.compute_hash()
        event.save()
    return event


@dataclass
class ChainReport:
    checked: int
    broken_id: int | None = None
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.broken_id is None


def verify_chain(batch: int = 2000) -> ChainReport:
    """Walk the chain in id order; report the first event whose links or content changed."""
    prev = GENESIS
    checked = 0
    last_id = 0
    while True:
        rows = list(AuditEvent.objects.filter(id__gt=last_id).order_by("id")[:batch])
        if not rows:
            return ChainReport(checked)
        for event in rows:
            if event.prev_hash != prev:
                return ChainReport(checked, event.id, "its link to the previous event is broken")
            if event.compute_hash() != event.hash:
                return ChainReport(checked, event.id, "its content does not match its hash")
            prev = event.hash
            checked += 1
            last_id = event.id

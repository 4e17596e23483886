"""The portal side of a scheduling cycle: snapshot from the database, decide, write back.

One cycle at a time: the whole read-decide-write runs in one transaction holding a lock (a
PostgreSQL advisory lock, or a Redis lock on SQLite), so two runners can never both admit
against the same free capacity or quota. The decisions come from scheduling.engine; this
module only translates rows to the engine's dataclasses and decisions back to rows (job
states, bindings, events, audit), and never decides anything itself.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from metering.services import raise_alarm
from portal import audit, context, locks
from portal.models import AuditEvent
from scheduling.engine import cycle as engine_cycle
from scheduling.engine import quota as engine_quota
from scheduling.engine.fleet import MILLI, Gpu, Placement, Request
from scheduling.engine.fleet import Node as EngineNode
from scheduling.engine.snapshot import (
    Allowance,
    FleetCard,
    FleetNode,
    PendingJob,
    QuotaAccount,
    RunningJob,
    Snapshot,
    gpu_dimension,
)
from scheduling.models import (
    ACTIVE_STATES,
    Accelerator,
    Binding,
    BindingEnd,
    Health,
    Job,
    JobEvent,
    JobState,
    Node,
    NodeState,
    Quota,
    QuotaResource,
    ShareMode,
    WaitReason,
)

log = logging.getLogger(__name__)

CYCLE_LOCK_KEY = locks.SCHEDULING_CYCLE
QUEUED_STATES = (JobState.PENDING, JobState.PREEMPTED)


@dataclass
class CycleOutcome:
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    waiting: int = 0
    duration_s: float = 0.0
    skipped: bool = False

    def as_dict(self) -> dict:
        return {"admitted": self.admitted, "preempted": self.preempted, "waiting": self.waiting,
                "duration_s": round(self.duration_s, 4), "skipped": self.skipped}


# --- translating rows to the engine ------------------------------------------------------


def spec_request(spec) -> Request:
    """The per-replica engine request of a resource spec."""
    models = frozenset(m.name for m in spec.accelerator_models.all())
    pools = frozenset(p.name for p in spec.pools.all()) or None
    if spec.mode == ShareMode.WHOLE:
        return Request(spec.cpu_milli, spec.memory_mib, spec.gpu_count, MILLI, models, pools=pools)
    if spec.mode == ShareMode.FRACTION:
        return Request(spec.cpu_milli, spec.memory_mib, 1, spec.fraction_milli, models, pools=pools)
    return Request(spec.cpu_milli, spec.memory_mib, 1, MILLI, models, mig_profile=spec.mig_profile, pools=pools)


_DIMENSION = {
    QuotaResource.GPU_MEMORY_GIB: ("gpu_memory_gib", 1),
    QuotaResource.CPU_CORES: ("cpu_milli", 1000),
    QuotaResource.MEMORY_GIB: ("memory_mib", 1024),
    QuotaResource.JOBS: ("jobs", 1),
    QuotaResource.CARD_HOURS_MONTH: ("card_hours_month", 1),
}


def quota_key(quota: Quota) -> tuple[str, float]:
    if quota.resource == QuotaResource.GPUS:
        return gpu_dimension(quota.accelerator_model.name), 1
    return _DIMENSION[QuotaResource(quota.resource)]


def month_start(now: dt.datetime) -> dt.datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def card_hours_this_month(now: dt.datetime) -> tuple[dict[int, float], dict[int, float]]:
    """Card-hours per tenant and per project since the start of the month, from bindings."""
    start = month_start(now)
    per_tenant: dict[int, float] = defaultdict(float)
    per_project: dict[int, float] = defaultdict(float)
    rows = Binding.objects.filter(start__lt=now).filter(Q(end__isnull=True) | Q(end__gt=start)).values_list(
        "tenant_id", "project_id", "start", "end", "share_milli"
    )
    for tenant_id, project_id, b_start, b_end, share in rows:
        seconds = ((b_end or now) if (b_end or now) < now else now) - max(b_start, start)
        hours = max(seconds.total_seconds(), 0) / 3600 * share / MILLI
        per_tenant[tenant_id] += hours
        per_project[project_id] += hours
    return per_tenant, per_project


RECOVERY_ENDS = (BindingEnd.CARD_FAILED, BindingEnd.NODE_DOWN)


def recovery_pools(queued: list[Job]) -> dict[int, str]:
    """Recovery policy: a job requeued because its card or node failed is rescheduled only in
    the pool it ran in (setting ATRIUM_RECOVERY_SAME_POOL, on by default), so a recovering
    job never lands on hardware its owners did not plan for."""
    if not getattr(settings, "ATRIUM_RECOVERY_SAME_POOL", True) or not queued:
        return {}
    last: dict[int, tuple] = {}
    rows = (Binding.objects.filter(job__in=[j.pk for j in queued], end__isnull=False)
            .order_by("job_id", "end", "id")
            .values_list("job_id", "end_reason", "accelerator__node__pool__name"))
    for job_id, end_reason, pool in rows:
        last[job_id] = (end_reason, pool)
    return {job_id: pool for job_id, (end_reason, pool) in last.items() if end_reason in RECOVERY_ENDS}


def recently_down_nodes(now: dt.datetime) -> set[int]:
    """Nodes that were down within ATRIUM_RECOVERY_HOLD_MINUTES (default 60) of `now`: back up
    or not, they take no new work until the hold has passed, so a flapping node cannot take
    the jobs it just lost. The node-state audit events are the record of when a node was down."""
    minutes = getattr(settings, "ATRIUM_RECOVERY_HOLD_MINUTES", 60)
    if not minutes:
        return set()
    rows = AuditEvent.objects.filter(
        action="node.state", target_type="scheduling.node", after__state=NodeState.DOWN,
        time__gt=now - dt.timedelta(minutes=minutes), time__lte=now,
    ).values_list("target_id", flat=True)
    return {int(pk) for pk in rows}


def budget_blocked_projects(project_ids: set[int], now: dt.datetime) -> set[int]:
    """Projects whose (project or tenant) `block` budget is spent: their jobs wait with
    reason `budget`. Metering owns budgets; this is the one place the cycle asks."""
    from metering.services import budget_blocked_projects as blocked

    return blocked(project_ids, now)


def build_snapshot(now: dt.datetime) -> tuple[Snapshot, dict]:
    """Read the fleet, quotas and jobs into the engine's snapshot (inside the cycle lock)."""
    nodes = list(Node.objects.filter(retired__isnull=True).select_related("pool"))
    # a retired node's cards leave with it, retired or not themselves
    cards = list(Accelerator.objects.filter(retired__isnull=True, node__retired__isnull=True).select_related("model"))
    cards_by_node: dict[int, list[Accelerator]] = defaultdict(list)
    for card in cards:
        cards_by_node[card.node_id].append(card)
    card_by_id = {c.pk: c for c in cards}
    node_by_id = {n.pk: n for n in nodes}

    active = list(
        Job.objects.filter(state__in=ACTIVE_STATES)
        .select_related("spec", "priority_class")
        .prefetch_related("spec__accelerator_models", "spec__pools")
    )
    bindings = list(Binding.objects.filter(end__isnull=True, job__state__in=ACTIVE_STATES))
    by_job: dict[int, list[Binding]] = defaultdict(list)
    used_milli: dict[int, int] = defaultdict(int)
    mig_taken: dict[tuple[str, int], list[tuple[str, int]]] = defaultdict(list)
    for b in bindings:
        by_job[b.job_id].append(b)
        card = card_by_id.get(b.accelerator_id)
        if card is None:
            continue
        if b.mig_profile:
            mig_taken[(node_by_id[card.node_id].name, card.index)].append((b.mig_profile, b.mig_slot or 0))
        else:
            used_milli[b.accelerator_id] += b.share_milli

    node_cpu: dict[int, int] = defaultdict(int)
    node_mem: dict[int, int] = defaultdict(int)
    running: list[RunningJob] = []
    model_memory = {c.model.name: float(c.model.memory_gib) for c in cards}
    usage_t: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    usage_p: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for job in active:
        req = spec_request(job.spec)
        replicas: dict[int, list[Binding]] = defaultdict(list)
        for b in by_job.get(job.pk, []):
            replicas[b.replica].append(b)
        placements, models = [], []
        for _replica, bs in sorted(replicas.items()):
            first = card_by_id.get(bs[0].accelerator_id)
            if first is None:
                continue
            node_cpu[first.node_id] += req.cpu_milli
            node_mem[first.node_id] += req.memory_mib
            placements.append(Placement(
                node=node_by_id[first.node_id].name,
                gpus=tuple(card_by_id[b.accelerator_id].index for b in bs if b.accelerator_id in card_by_id),
                milli=bs[0].share_milli, mig_slot=bs[0].mig_slot if bs[0].mig_profile else -1,
            ))
            models.append(first.model.name)
        for key, value in engine_quota.demand(req, models or [None], model_memory).items():
            usage_t[job.tenant_id][key] += value
            usage_p[job.project_id][key] += value
        running.append(RunningJob(
            id=str(job.pk), tenant=str(job.tenant_id), project=str(job.project_id), request=req,
            placements=placements, priority=job.priority_class.value, preemptible=job.priority_class.preemptible,
            borrowed=job.borrowed, started=(job.started or job.admitted or now).timestamp(),
        ))

    engine_nodes, fleet = [], []
    held = recently_down_nodes(now)
    for node in nodes:
        node_cards = sorted(cards_by_node.get(node.pk, []), key=lambda c: c.index)
        schedulable = node.state == NodeState.READY and node.pk not in held
        fleet.append(FleetNode(
            name=node.name, cpu_milli=node.cpu_milli, memory_mib=node.memory_mib, pool=node.pool.name,
            schedulable=schedulable,
            cards=[FleetCard(c.index, c.model.name, c.health == Health.HEALTHY, c.nvlink_domain, c.mig_enabled,
                             str(c.pk)) for c in node_cards],
        ))
        if not schedulable:
            continue
        gpus = [
            Gpu(index=c.index, model=c.model.name, free_milli=max(MILLI - used_milli[c.pk], 0),
                domain=c.nvlink_domain, uid=str(c.pk), mig=c.mig_enabled)
            for c in node_cards if c.health == Health.HEALTHY
        ]
        engine_nodes.append(EngineNode(
            name=node.name, cpu_milli=node.cpu_milli, memory_mib=node.memory_mib, gpus=gpus,
            cpu_free=max(node.cpu_milli - node_cpu[node.pk], 0),
            memory_free=max(node.memory_mib - node_mem[node.pk], 0), pool=node.pool.name, labels=node.labels,
        ))

    hours_t, hours_p = card_hours_this_month(now)
    tenants: dict[str, QuotaAccount] = {}
    projects: dict[str, QuotaAccount] = {}
    for q in Quota.objects.select_related("accelerator_model", "project", "tenant"):
        key, scale = quota_key(q)
        allowance = Allowance(guaranteed=float(q.guaranteed) * scale, limit=float(q.limit) * scale)
        if q.project_id is None:
            acct = tenants.setdefault(str(q.tenant_id), QuotaAccount(q.tenant.slug))
        else:
            acct = projects.setdefault(str(q.project_id), QuotaAccount(q.project.slug))
        acct.limits[key] = allowance
    for tid, acct in tenants.items():
        acct.usage = dict(usage_t.get(int(tid), {}))
        acct.usage["card_hours_month"] = hours_t.get(int(tid), 0.0)
    for pid, acct in projects.items():
        acct.usage = dict(usage_p.get(int(pid), {}))
        acct.usage["card_hours_month"] = hours_p.get(int(pid), 0.0)

    queued = list(
        Job.objects.filter(state__in=QUEUED_STATES)
        .select_related("spec", "priority_class", "tenant", "project")
        .prefetch_related("spec__accelerator_models", "spec__pools")
    )
    recovery = recovery_pools(queued)
    spent = budget_blocked_projects({j.project_id for j in queued}, now)
    pending = []
    for job in queued:
        tenants.setdefault(str(job.tenant_id), QuotaAccount(job.tenant.slug))
        projects.setdefault(str(job.project_id), QuotaAccount(job.project.slug))
        req = spec_request(job.spec)
        if job.pk in recovery:
            pool = recovery[job.pk]
            if req.pools is None or pool in req.pools:
                req = replace(req, pools=frozenset({pool}))
        pending.append(PendingJob(
            id=str(job.pk), tenant=str(job.tenant_id), project=str(job.project_id), request=req,
            priority=job.priority_class.value, priority_class=job.priority_class.name,
            preemptible=job.priority_class.preemptible, submitted=job.submitted.timestamp(),
            replicas=job.replicas, spec=job.spec.name,
            card_hours=job.expected_minutes / 60 * job.spec.card_fraction * job.replicas,
            budget_blocked=job.project_id in spent,
        ))
    snapshot = Snapshot(
        nodes=engine_nodes, pending=pending, running=running, tenants=tenants, projects=projects,
        fleet=fleet, mig=dict(mig_taken), model_memory_gib=model_memory,
    )
    index = {
        "cards": {(node_by_id[c.node_id].name, c.index): c for c in cards},
        "queued": {str(j.pk): j for j in queued},
    }
    return snapshot, index


# --- locking ----------------------------------------------------------------------------


@contextlib.contextmanager
def cycle_lock():
    """Hold the one-cycle-at-a-time lock for the current transaction."""
    if not settings.ATRIUM_CYCLE_LOCK:
        yield
        return
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])
        yield
        return
    import django_rq

    with django_rq.get_connection("default").lock("atrium:scheduling-cycle", timeout=600, blocking_timeout=600):
        yield


# --- writing decisions back -------------------------------------------------------------


def run_cycle(now: dt.datetime | None = None, policy: str | None = None) -> CycleOutcome:
    """Run one scheduling cycle and write its decisions in one transaction."""
    outcome = CycleOutcome()
    with context.bound(actor_label="service:scheduler"), transaction.atomic(), cycle_lock():
        live = now is None
        now = now or timezone.now()
        snapshot, index = build_snapshot(now)
        if not snapshot.pending:
            outcome.skipped = True
            return outcome
        result = engine_cycle.run_cycle(snapshot, policy=policy or settings.ATRIUM_PLACEMENT_POLICY)
        outcome.duration_s = result.stats.duration_s
        if live:
            # decisions are stamped when they are written: the queue was read after `now` was
            # taken, so a job submitted in between would otherwise be admitted (its binding
            # started, its card time accrued) before its own submission
            now = max(now, timezone.now())
        # Locks in the one order every audited writer uses: the audit chain's lock first (the
        # decisions write audit events, and _apply_waits updates rows after them), then every
        # job row the decisions touch at once, in id order. A cancel, a backend's state change
        # or a health requeue takes them in the same order, so none can wait on another in a circle.
        audit.lock_chain()
        ids = sorted({int(p.victim_id) for p in result.preempted} | {int(a.job_id) for a in result.admitted})
        locked = {j.pk: j for j in Job.objects.select_for_update(of=("self",), no_key=True).filter(pk__in=ids)
                  .select_related("project__tenant").order_by("pk")}
        index["locked"] = locked
        _apply_preemptions(result.preempted, index, now, outcome)
        _apply_admissions(result.admitted, index, now, outcome)
        _apply_waits(result.waiting, index, now)
        outcome.waiting = len(result.waiting)
    return outcome


def _apply_preemptions(preemptions, index, now, outcome: CycleOutcome) -> None:
    for p in preemptions:
        victim = index["locked"].get(int(p.victim_id))
        by = index["locked"].get(int(p.by_job_id))
        if by is None or by.state not in QUEUED_STATES:
            continue  # the job it made room for was cancelled meanwhile: stop nobody for nothing
        if victim is None or victim.state not in ACTIVE_STATES:
            continue
        Binding.objects.filter(job=victim, end__isnull=True).update(end=now, end_reason=BindingEnd.PREEMPTED)
        victim.state = JobState.PREEMPTED
        victim.preemptions += 1
        victim.started = None
        victim.admitted = None
        victim.wait_reason = WaitReason.PREEMPTED
        victim.wait_message = p.message or f"Preempted by job {p.by_job_id}; back in the queue."
        victim.save()
        JobEvent.objects.create(job=victim, time=now, kind="preempted", message=victim.wait_message)
        audit.record("job.preempt", target=victim, project=victim.project, reason=victim.wait_message,
                     after={"by_job": p.by_job_id})
        raise_alarm(
            kind="job_preempted", severity="warning", project=victim.project,
            message=f"Job {victim.pk} ({victim.name}) was preempted: {victim.wait_message}",
            action="It is back in the queue and restarts when capacity frees; use a non-preemptible class "
                   "for work that must not stop.",
            dedupe_key=f"job:{victim.pk}:preempted:{victim.preemptions}",
        )
        outcome.preempted.append(victim.pk)


def _apply_admissions(admissions, index, now, outcome: CycleOutcome) -> None:
    cards = index["cards"]
    new_bindings = []
    for adm in admissions:
        job = index["locked"].get(int(adm.job_id))
        if job is None or job.state not in QUEUED_STATES:
            continue  # cancelled while the cycle ran
        where = []
        for replica, rp in enumerate(adm.placements):
            for gpu in rp.gpus:
                card = cards[(rp.node, gpu)]
                new_bindings.append(Binding(
                    job=job, accelerator=card, tenant_id=job.tenant_id, project_id=job.project_id,
                    replica=replica, share_milli=rp.milli, mig_profile=rp.mig_profile,
                    mig_slot=rp.mig_slot if rp.mig_profile else None, start=now,
                ))
            where.append(f"{rp.node} gpu {','.join(str(g) for g in rp.gpus)}"
                         + (f" ({rp.mig_profile})" if rp.mig_profile else ""))
        job.state = JobState.ADMITTED
        job.admitted = now
        job.borrowed = adm.borrowed
        job.wait_reason = WaitReason.NONE
        job.wait_message = ""
        job.queue_position = None
        job.save()
        message = "Admitted on " + "; ".join(where) + (" (borrowed capacity)" if adm.borrowed else "") + "."
        JobEvent.objects.create(job=job, time=now, kind="admitted", message=message)
        audit.record("job.admit", target=job, project=job.project, after={"placements": where, "borrowed": adm.borrowed})
        outcome.admitted.append(job.pk)
    Binding.objects.bulk_create(new_bindings)


def _apply_waits(waits, index, now) -> None:
    queued = index["queued"]
    changed = []
    events = []
    for w in waits:
        job = queued.get(w.job_id)
        if job is None:
            continue
        reason = WaitReason(w.reason.value)
        if job.wait_reason != reason or job.wait_message != w.message or job.queue_position != w.position:
            if job.wait_reason != reason:
                events.append(JobEvent(job=job, time=now, kind=f"waiting:{reason.value}", message=w.message))
            job.wait_reason, job.wait_message, job.queue_position = reason, w.message[:400], w.position
            changed.append(job)
    _write_waits(sorted(changed, key=lambda j: j.pk))
    JobEvent.objects.bulk_create(events)


# One statement with five array parameters: its text never changes, whatever the number of rows.
_WAITS_SQL = """
UPDATE scheduling_job AS j
   SET wait_reason = v.reason, wait_message = v.message, queue_position = v.position
  FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::integer[]) AS v(id, reason, message, position)
 WHERE j.id = v.id AND j.state = ANY(%s::text[])
"""


def _write_waits(jobs: list[Job]) -> None:
    """Store the wait reason, message and queue position of `jobs` (in id order), only on rows
    still queued: a job cancelled meanwhile keeps its final state.

    Every cycle re-ranks the whole queue, so hundreds of positions move at once. On PostgreSQL
    one UPDATE ... FROM unnest() writes them; Django's bulk_update builds a CASE per field and
    row, which cost the cycle more than its decisions (about half a second for 500 jobs)."""
    if not jobs:
        return
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute(_WAITS_SQL, [[j.pk for j in jobs], [str(j.wait_reason) for j in jobs],
                                     [j.wait_message for j in jobs], [j.queue_position for j in jobs],
                                     [str(s) for s in QUEUED_STATES]])
        return
    still = set(Job.objects.filter(pk__in=[j.pk for j in jobs], state__in=QUEUED_STATES).values_list("pk", flat=True))
    Job.objects.bulk_update([j for j in jobs if j.pk in still], ["wait_reason", "wait_message", "queue_position"])

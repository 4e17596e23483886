"""What one scheduling cycle reads and what it returns, as plain dataclasses.

The portal (or a benchmark, or a trace replay) fills a ``Snapshot`` from whatever it stores —
healthy capacity, the whole fleet's shape including sick cards, MIG layouts, quotas with their
usage, running and pending jobs — and hands it to ``engine.cycle.run_cycle``, which answers
with a ``CycleResult``: who is admitted where, who is preempted by whom, and why everybody
else waits. These classes carry data only; they must never import Django, read a clock or
decide anything (the decisions live in ``cycle``, ``quota`` and ``mig``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from .fleet import Node, Placement, Request


class WaitReason(StrEnum):
    """Why a job is not running after a cycle; the portal stores the value on the job."""

    QUOTA = "quota"
    CAPACITY = "capacity"
    PRIORITY = "priority"
    HEALTH = "health"
    BUDGET = "budget"
    SPEC_UNSATISFIABLE = "spec-unsatisfiable"
    PREEMPTED = "preempted"


class Dimension(StrEnum):
    """Quota dimensions. GPU cards are per accelerator model: ``gpu_dimension("H100")``."""

    GPU_MEMORY_GIB = "gpu_memory_gib"
    CPU_MILLI = "cpu_milli"
    MEMORY_MIB = "memory_mib"
    JOBS = "jobs"
    CARD_HOURS_MONTH = "card_hours_month"


GPU_PREFIX = "gpu:"


def gpu_dimension(model: str) -> str:
    """The quota key for whole cards of one model (shares and MIG slices count as fractions)."""
    return GPU_PREFIX + model


# ---------------------------------------------------------------- input


@dataclass(frozen=True, slots=True)
class Allowance:
    """One quota dimension: ``guaranteed`` is never reclaimed, up to ``limit`` is borrowed.

    ``limit`` None means no hard limit. A dimension absent from an account is unlimited and
    never borrowed; the portal writes explicit zeros where it means "none of this".
    """

    guaranteed: float = 0.0
    limit: float | None = None


@dataclass(slots=True)
class QuotaAccount:
    """The quota of one tenant or one project and what it uses now.

    ``usage`` is keyed like ``limits`` (``Dimension`` values or ``gpu:<model>``) and already
    counts every running job, including card-hours used this month.
    """

    name: str
    limits: dict[str, Allowance] = field(default_factory=dict)
    usage: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FleetCard:
    """One card of the whole fleet, healthy or not (for telling "sick" from "impossible")."""

    index: int
    model: str
    healthy: bool = True
    domain: int = 0
    mig: bool = False
    uid: str = ""


@dataclass(slots=True)
class FleetNode:
    """One node of the whole fleet; ``schedulable`` is False when cordoned or down."""

    name: str
    cpu_milli: int
    memory_mib: int
    cards: list[FleetCard] = field(default_factory=list)
    schedulable: bool = True
    pool: str = ""


@dataclass(slots=True)
class RunningJob:
    """A job holding capacity now. Its usage is already inside the quota accounts.

    ``placements`` has one entry per replica; for MIG replicas ``mig_slot`` is set and the
    profile is ``request.mig_profile``. ``borrowed`` is True when the job runs above its
    project's guaranteed quota. ``started`` orders victims (most recent first).
    """

    id: str
    tenant: str
    project: str
    request: Request
    placements: list[Placement]
    priority: int = 0
    preemptible: bool = True
    borrowed: bool = False
    started: float = 0.0


@dataclass(slots=True)
class PendingJob:
    """A job waiting for a cycle. ``request`` is per replica; replicas are all-or-nothing.

    ``card_hours`` is the job's estimate for the monthly card-hour limit (None = unknown);
    ``budget_blocked`` is set by metering when the owner's budget is spent.
    """

    id: str
    tenant: str
    project: str
    request: Request
    priority: int = 0
    priority_class: str = ""
    preemptible: bool = True
    submitted: float | datetime = 0.0
    replicas: int = 1
    spec: str = ""
    card_hours: float | None = None
    budget_blocked: bool = False


@dataclass(slots=True)
class Snapshot:
    """Everything a cycle needs. The cycle copies ``nodes``; the snapshot is left untouched.

    ``nodes`` holds schedulable nodes with their healthy cards only and the free capacity on
    them. ``fleet`` describes every node and card, healthy or not; left empty, it is taken
    to be ``nodes`` (everything healthy). ``mig`` lists the MIG slices taken on each MIG-mode
    card of ``nodes``: ``(node name, card index) -> [(profile, first slot), ...]``.
    ``model_memory_gib`` gives each accelerator model's memory, for the GPU-memory quota.
    """

    nodes: list[Node]
    pending: list[PendingJob] = field(default_factory=list)
    running: list[RunningJob] = field(default_factory=list)
    tenants: dict[str, QuotaAccount] = field(default_factory=dict)
    projects: dict[str, QuotaAccount] = field(default_factory=dict)
    fleet: list[FleetNode] = field(default_factory=list)
    mig: dict[tuple[str, int], list[tuple[str, int]]] = field(default_factory=dict)
    model_memory_gib: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- output


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """Where one replica of an admitted job goes, ready to become bindings.

    ``milli`` is per card (1000 = whole card). For a MIG slice, ``mig_profile`` and
    ``mig_slot`` say which slice; ``milli`` is then the slice's compute share of the card.
    """

    node: str
    gpus: tuple[int, ...]
    uids: tuple[str, ...]
    milli: int
    model: str = ""
    mig_profile: str = ""
    mig_slot: int = -1


@dataclass(frozen=True, slots=True)
class Admission:
    """A job that starts now; ``borrowed`` marks usage above its project's guarantee."""

    job_id: str
    placements: tuple[ReplicaPlacement, ...]
    borrowed: bool = False


@dataclass(frozen=True, slots=True)
class Preemption:
    """A running job stopped to make room; it goes back to the queue with this reason."""

    victim_id: str
    by_job_id: str
    reason: WaitReason = WaitReason.PREEMPTED
    message: str = ""


@dataclass(frozen=True, slots=True)
class Wait:
    """A job left pending: a code, a sentence a person can act on, its place in the queue."""

    job_id: str
    reason: WaitReason
    message: str
    position: int


@dataclass(slots=True)
class CycleStats:
    pending: int = 0
    admitted: int = 0
    preempted: int = 0
    waiting: int = 0
    decisions: int = 0
    duration_s: float = 0.0
    placement_calls: int = 0
    memo_hits: int = 0
    preemption_searches: int = 0

    @property
    def decisions_per_s(self) -> float:
        return self.decisions / self.duration_s if self.duration_s > 0 else float("inf")


@dataclass(slots=True)
class CycleResult:
    admitted: list[Admission] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    waiting: list[Wait] = field(default_factory=list)
    stats: CycleStats = field(default_factory=CycleStats)

"""Hard quota admission and borrowing, over the tenant and project accounts of a snapshot.

A job's demand (cards per accelerator model — shares and MIG slices as fractions — GPU memory,
CPU, memory, one concurrent job, its card-hour estimate) is checked against the hard limit of
its project and of its tenant; above ``guaranteed`` and up to ``limit`` it borrows. The ledger
works on its own copy of the usage so a cycle can charge admissions and refund preemptions as
it goes. It must never let a charge take usage past a limit (callers ask ``breaches`` first),
never change the snapshot's accounts, and never import Django.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .fleet import MILLI, Request
from .mig import COMPUTE_SLICES, profile
from .snapshot import GPU_PREFIX, Allowance, Dimension, QuotaAccount

EPS = 1e-9
# Plain strings for the hot paths (an Enum attribute lookup costs a descriptor call).
CPU = Dimension.CPU_MILLI.value
MEMORY = Dimension.MEMORY_MIB.value
GPU_MEMORY = Dimension.GPU_MEMORY_GIB.value
JOBS = Dimension.JOBS.value
CARD_HOURS = Dimension.CARD_HOURS_MONTH.value
# Dimensions that measure capacity held; jobs and card-hours are limits but not "borrowing".
CAPACITY_DIMS = frozenset({GPU_MEMORY, CPU, MEMORY})


def card_fraction(request: Request, model: str) -> float:
    """Cards of ``model`` one replica holds: whole cards, a share, or a MIG slice's compute."""
    if request.num_gpu == 0:
        return 0.0
    if request.mig_profile:
        p = profile(model, request.mig_profile)
        return p.compute / COMPUTE_SLICES if p else 1.0
    if request.num_gpu == 1 and request.gpu_milli < MILLI:
        return request.gpu_milli / MILLI
    return float(request.num_gpu)


def gpu_memory(request: Request, model: str, model_memory_gib: dict[str, float]) -> float:
    if request.num_gpu == 0:
        return 0.0
    if request.mig_profile:
        p = profile(model, request.mig_profile)
        if p:
            return p.memory_gib
    return card_fraction(request, model) * model_memory_gib.get(model, 0.0)


def demand(
    request: Request,
    models: Iterable[str | None],
    model_memory_gib: dict[str, float],
    card_hours: float | None = None,
) -> dict[str, float]:
    """What a job adds to its accounts, given the card model of each replica (None = no GPU)."""
    n = 0
    cards: dict[str, float] = {}
    gmem = 0.0
    for model in models:
        n += 1
        if model is not None and request.num_gpu:
            key = GPU_PREFIX + model
            cards[key] = cards.get(key, 0.0) + card_fraction(request, model)
            gmem += gpu_memory(request, model, model_memory_gib)
    out: dict[str, float] = {
        CPU: float(request.cpu_milli * n),
        MEMORY: float(request.memory_mib * n),
        JOBS: 1.0,
    }
    if cards:
        out.update(cards)
        out[GPU_MEMORY] = gmem
    if card_hours:
        out[CARD_HOURS] = float(card_hours)
    return out


@dataclass(frozen=True, slots=True)
class Breach:
    """One hard limit a job would cross."""

    kind: str  # "project" or "tenant"
    account: str
    dimension: str
    usage: float
    limit: float
    need: float

    def sentence(self) -> str:
        used, lim, need, unit = _human(self.dimension, self.usage, self.limit, self.need)
        text = f"{self.kind} {self.account}: {used} of {lim} {unit} in use"
        if self.dimension == CARD_HOURS and self.need == 0:
            return f"{self.kind} {self.account}: {used} of {lim} {unit} used"
        return f"{text}, the job needs {need}"


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 1e-6 else f"{x:.2f}".rstrip("0").rstrip(".")


def _human(dim: str, usage: float, limit: float, need: float) -> tuple[str, str, str, str]:
    if dim.startswith(GPU_PREFIX):
        unit = dim[len(GPU_PREFIX):]
        return _num(usage), _num(limit), _num(need), unit
    scale, unit = {
        Dimension.GPU_MEMORY_GIB.value: (1.0, "GiB GPU memory"),
        Dimension.CPU_MILLI.value: (1000.0, "CPU cores"),
        Dimension.MEMORY_MIB.value: (1024.0, "GiB memory"),
        Dimension.JOBS.value: (1.0, "concurrent jobs"),
        Dimension.CARD_HOURS_MONTH.value: (1.0, "card-hours this month"),
    }.get(dim, (1.0, dim))
    return _num(usage / scale), _num(limit / scale), _num(need / scale), unit


def describe(breaches: list[Breach]) -> str:
    """One sentence for the wait reason, project first, e.g.
    "project llm-finetune: 8 of 8 H100 in use, the job needs 4; tenant nlp-group: ..."."""
    ordered = sorted(breaches, key=lambda b: (b.kind != "project", b.dimension))
    return "; ".join(b.sentence() for b in ordered)


class QuotaLedger:
    """Working copy of every account's usage for one cycle."""

    def __init__(self, tenants: dict[str, QuotaAccount], projects: dict[str, QuotaAccount]):
        self.limits: dict[tuple[str, str], dict[str, Allowance]] = {}
        self.usage: dict[tuple[str, str], dict[str, float]] = {}
        self.names: dict[tuple[str, str], str] = {}
        for kind, accounts in (("tenant", tenants), ("project", projects)):
            for key, acc in accounts.items():
                self.limits[(kind, key)] = acc.limits
                self.usage[(kind, key)] = dict(acc.usage)
                self.names[(kind, key)] = acc.name or key

    def breaches(self, tenant: str, project: str, need: dict[str, float],
                 spent_check: bool = True) -> list[Breach]:
        """The hard limits this demand would cross, project and tenant; empty = admissible.

        ``spent_check`` also refuses any job once the month's card-hours are used up; turn
        it off when checking only part of a demand.
        """
        out = []
        for kind, key in (("project", project), ("tenant", tenant)):
            limits = self.limits.get((kind, key))
            if not limits:
                continue
            usage = self.usage[(kind, key)]
            for dim, amount in need.items():
                allowance = limits.get(dim)
                if allowance is None or allowance.limit is None or amount <= 0:
                    continue
                used = usage.get(dim, 0.0)
                if used + amount > allowance.limit + EPS:
                    out.append(Breach(kind, self.names[(kind, key)], dim, used, allowance.limit,
                                      amount))
            # A month whose card-hours are spent blocks jobs that gave no estimate too.
            allowance = limits.get(CARD_HOURS)
            if (
                spent_check
                and allowance is not None
                and allowance.limit is not None
                and not need.get(CARD_HOURS)
                and usage.get(CARD_HOURS, 0.0) >= allowance.limit - EPS
            ):
                out.append(Breach(kind, self.names[(kind, key)], CARD_HOURS,
                                  usage.get(CARD_HOURS, 0.0), allowance.limit, 0.0))
        return out

    def would_borrow(self, project: str, need: dict[str, float]) -> bool:
        """Whether the demand takes the project above its guaranteed amount anywhere."""
        limits = self.limits.get(("project", project))
        if not limits:
            return False
        usage = self.usage[("project", project)]
        for dim, amount in need.items():
            if amount <= 0 or not (dim in CAPACITY_DIMS or dim.startswith(GPU_PREFIX)):
                continue
            allowance = limits.get(dim)
            if allowance is not None and usage.get(dim, 0.0) + amount > allowance.guaranteed + EPS:
                return True
        return False

    def charge(self, tenant: str, project: str, need: dict[str, float], sign: int = 1) -> None:
        for kind, key in (("project", project), ("tenant", tenant)):
            usage = self.usage.get((kind, key))
            if usage is None:
                usage = self.usage[(kind, key)] = {}
            for dim, amount in need.items():
                usage[dim] = usage.get(dim, 0.0) + sign * amount

    def refund(self, tenant: str, project: str, need: dict[str, float]) -> None:
        """Give back a preempted job's capacity; card-hours it burned stay spent."""
        held = {k: v for k, v in need.items() if k != CARD_HOURS}
        self.charge(tenant, project, held, sign=-1)

    def tenant_usage(self, tenant: str) -> dict[str, float]:
        return self.usage.get(("tenant", tenant), {})

    def tenant_limits(self, tenant: str) -> dict[str, Allowance]:
        return self.limits.get(("tenant", tenant), {})

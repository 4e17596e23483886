"""One scheduling cycle: quota admission, policy order, placement, preemption, wait reasons.

``run_cycle`` takes a ``Snapshot`` and returns a ``CycleResult`` the portal writes in one
transaction. Jobs are taken in policy order — priority value, then fair share (tenants below
their guarantee first, then the lower dominant share), then submit time — never by arrival
alone. A job over a hard quota limit never competes for capacity; one that fits goes through
``engine.placement`` (whole cards and shares) or ``engine.mig`` (MIG slices), all replicas or
none; one that does not fit may preempt lower-priority preemptible jobs, borrowed ones first,
when that provably makes room. Everybody left waiting gets a code, a sentence and a queue
position. The cycle is a pure function of its snapshot: it must never change the snapshot,
never use a card that is not in ``snapshot.nodes`` (those are the healthy ones), never preempt a
non-preemptible job, never take usage past a hard limit, and never import Django.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime

from . import placement as _placement
from .fleet import MILLI, Gpu, Node, Placement, Request
from .fragmentation import typical_pods
from .mig import MigBoard, profiles_for
from .quota import CARD_HOURS, CPU, JOBS, MEMORY, Breach, QuotaLedger, demand, describe
from .snapshot import (
    GPU_PREFIX,
    Admission,
    CycleResult,
    FleetCard,
    FleetNode,
    PendingJob,
    Preemption,
    ReplicaPlacement,
    RunningJob,
    Snapshot,
    Wait,
    WaitReason,
)

DEFAULT_POLICY = _placement.DEFAULT_POLICY


# ---------------------------------------------------------------- placement adapter


class _Capacity:
    """A set of nodes plus their MIG state, with one verb set for every kind of request.

    This is the only place that calls ``engine.placement``; whole cards and shares go there,
    MIG slices to ``MigBoard``.
    """

    def __init__(
        self,
        nodes: list[Node],
        mig_taken: dict[tuple[str, int], list[tuple[str, int]]],
        policy: str,
        ctx: _placement.PlacementContext,
    ) -> None:
        self.nodes = nodes
        self.by_name = {n.name: n for n in nodes}
        self.board = MigBoard(nodes, mig_taken)
        self.policy = policy
        self.ctx = ctx
        self.calls = 0
        self._hosts: dict[tuple, list[Node]] = {}

    def hosts(self, request: Request) -> list[Node]:
        """The nodes whose cards could ever hold the request (model, pool, card count).

        Placement would reject the others anyway; leaving them out only saves the scan, the
        choice is the same (ties keep their order).
        """
        whole = request.num_gpu if request.gpu_milli == MILLI else min(request.num_gpu, 1)
        key = (request.models, request.pools, whole)
        nodes = self._hosts.get(key)
        if nodes is None:
            nodes = [
                n for n in self.nodes
                if (request.pools is None or n.pool in request.pools)
                and sum(1 for g in n.gpus if not g.mig
                        and (request.models is None or g.model in request.models)) >= whole
            ]
            self._hosts[key] = nodes
        return nodes

    def choose(self, request: Request, only: set[str] | None = None) -> Placement | None:
        self.calls += 1
        if request.mig_profile:
            return self.board.choose(request, only)
        # Sorted, so ties between nodes break the same way whatever the set's hash order.
        nodes = self.hosts(request) if only is None else [self.by_name[n] for n in sorted(only)]
        return _placement.choose(nodes, request, self.policy, self.ctx)

    def first_fit(self, request: Request) -> Placement | None:
        """Any placement at all, cheaply: for yes/no questions, not for real decisions."""
        if request.mig_profile:
            return self.board.choose(request)
        for node in self.hosts(request):
            if _placement.feasible(node, request):
                return _placement.choose([node], request, "best-fit", self.ctx)
        return None

    def apply(self, p: Placement, request: Request) -> None:
        node = self.by_name[p.node]
        if request.mig_profile:
            self.board.apply(node, p, request)
        else:
            _placement.apply(node, p, request)

    def release(self, p: Placement, request: Request) -> None:
        node = self.by_name[p.node]
        if request.mig_profile:
            self.board.release(node, p, request)
        else:
            _placement.release(node, p, request)

    def place_all(self, request: Request, replicas: int, first_fit: bool = False,
                  only: set[str] | None = None) -> list[Placement] | None:
        """All replicas or none: a partial placement is rolled back before returning None."""
        done: list[Placement] = []
        for _ in range(replicas):
            p = self.first_fit(request) if first_fit else self.choose(request, only)
            if p is None:
                self.unplace(done, request)
                return None
            self.apply(p, request)
            done.append(p)
        return done

    def unplace(self, placements: list[Placement], request: Request) -> None:
        for p in reversed(placements):
            self.release(p, request)

    def fits(self, request: Request, replicas: int) -> bool:
        done = self.place_all(request, replicas, first_fit=True)
        if done is None:
            return False
        self.unplace(done, request)
        return True

    # A running job may hold cards that are no longer healthy (absent here): only the parts
    # still present come back, and a node that is gone gives nothing back at all.

    def _present(self, p: Placement) -> Placement | None:
        node = self.by_name.get(p.node)
        if node is None:
            return None
        have = {g.index for g in node.gpus}
        if all(i in have for i in p.gpus):
            return p
        return Placement(p.node, tuple(i for i in p.gpus if i in have), p.milli, p.mig_slot)

    def release_running(self, job: RunningJob) -> None:
        for p in job.placements:
            q = self._present(p)
            if q is not None:
                self.release(q, job.request)

    def reapply_running(self, job: RunningJob) -> None:
        for p in job.placements:
            q = self._present(p)
            if q is not None:
                self.apply(q, job.request)


class _Failures:
    """Request shapes that found no room, so anything at least as big is refused unasked.

    Feasibility is monotone: more replicas, cards, share, CPU or memory (or, for preemption,
    a lower priority with fewer possible victims) never fits where less did not. Shapes are
    grouped by what is not ordered (model set, pools, MIG profile); within a group only the
    smallest failures are kept. ``clear`` when capacity grows.
    """

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: dict[tuple, list[tuple[int, ...]]] = {}

    @staticmethod
    def _size(request: Request, replicas: int, extra: int) -> tuple[int, ...]:
        milli = request.gpu_milli if request.num_gpu else 0
        return (replicas, request.num_gpu, milli, request.cpu_milli, request.memory_mib, extra)

    def known(self, request: Request, replicas: int, extra: int = 0) -> bool:
        size = self._size(request, replicas, extra)
        models = (request.models, None) if request.models is not None else (None,)
        for m in models:  # failing on any model means failing on a subset of them
            for f in self.groups.get((m, request.pools, request.mig_profile), ()):
                if all(a <= b for a, b in zip(f, size, strict=True)):
                    return True
        return False

    def add(self, request: Request, replicas: int, extra: int = 0) -> None:
        size = self._size(request, replicas, extra)
        group = self.groups.setdefault((request.models, request.pools, request.mig_profile), [])
        group[:] = [f for f in group if not all(a <= b for a, b in zip(size, f, strict=True))]
        group.append(size)

    def clear(self) -> None:
        self.groups.clear()


def _copy_nodes(nodes: list[Node]) -> list[Node]:
    return [
        Node(
            name=n.name,
            cpu_milli=n.cpu_milli,
            memory_mib=n.memory_mib,
            gpus=[Gpu(g.index, g.model, g.free_milli, g.domain, g.uid, g.mig) for g in n.gpus],
            cpu_free=n.cpu_free,
            memory_free=n.memory_free,
            pool=n.pool,
            labels=n.labels,
        )
        for n in nodes
    ]


def _empty_nodes(fleet: list[FleetNode], healthy_only: bool) -> list[Node]:
    out = []
    for fn in fleet:
        if healthy_only and not fn.schedulable:
            continue
        cards = [
            Gpu(c.index, c.model, MILLI, c.domain, c.uid, c.mig)
            for c in fn.cards
            if c.healthy or not healthy_only
        ]
        out.append(Node(fn.name, fn.cpu_milli, fn.memory_mib, cards, pool=fn.pool))
    return out


def _fleet_from_nodes(nodes: list[Node]) -> list[FleetNode]:
    return [
        FleetNode(
            n.name,
            n.cpu_milli,
            n.memory_mib,
            [FleetCard(g.index, g.model, True, g.domain, g.mig, g.uid) for g in n.gpus],
            pool=n.pool,
        )
        for n in nodes
    ]


# ---------------------------------------------------------------- wording


def _models_label(request: Request) -> str:
    return "/".join(sorted(request.models)) if request.models else "GPU"


def _host_label(request: Request) -> str:
    cpu = f"{request.cpu_milli / 1000:g} CPU"
    mem = f"{request.memory_mib / 1024:g} GiB memory"
    return f"{cpu} and {mem}"


def _capacity_sentence(request: Request, replicas: int) -> str:
    m = _models_label(request)
    if request.mig_profile:
        text = f"no healthy {m} card with a free {request.mig_profile} MIG slot"
    elif request.num_gpu == 0:
        text = f"no healthy node with {_host_label(request)} free"
    elif request.num_gpu == 1 and request.gpu_milli < MILLI:
        text = f"no healthy {m} card with {request.gpu_milli / 10:g}% free"
    elif request.num_gpu == 1:
        text = f"no healthy node with a free {m}"
    else:
        text = f"no healthy node with {request.num_gpu} free {m} in one NVLink domain"
    if request.num_gpu:
        text += f" and {_host_label(request)}"
    if replicas > 1:
        text = f"not enough room for all {replicas} replicas: {text}"
    return text


def _spec_label(job: PendingJob) -> str:
    if job.spec:
        return job.spec
    r = job.request
    if r.mig_profile:
        what = f"{_models_label(r)} mig-{r.mig_profile}"
    elif r.num_gpu == 0:
        what = _host_label(r)
    elif r.num_gpu == 1 and r.gpu_milli < MILLI:
        what = f"{_models_label(r)} x{r.gpu_milli / MILLI:g}"
    else:
        what = f"{_models_label(r)} x{r.num_gpu}"
    return what if job.replicas == 1 else f"{job.replicas} x ({what})"


# ---------------------------------------------------------------- order


def _submitted(job: PendingJob) -> float:
    s = job.submitted
    return s.timestamp() if isinstance(s, datetime) else float(s)


class _FairShare:
    """Tenant shares for ordering: below-guarantee first, then lower dominant share (DRF)."""

    def __init__(self, ledger: QuotaLedger, fleet: list[FleetNode]) -> None:
        self.ledger = ledger
        healthy = [fn for fn in fleet if fn.schedulable]
        self.total = {
            "gpu": float(sum(1 for fn in healthy for c in fn.cards if c.healthy)) or 1.0,
            CPU: float(sum(fn.cpu_milli for fn in healthy)) or 1.0,
            MEMORY: float(sum(fn.memory_mib for fn in healthy)) or 1.0,
        }

    def key(self, tenant: str) -> tuple[bool, float]:
        usage = self.ledger.tenant_usage(tenant)
        gpus = sum(v for k, v in usage.items() if k.startswith(GPU_PREFIX))
        dominant = max(
            gpus / self.total["gpu"],
            usage.get(CPU, 0.0) / self.total[CPU],
            usage.get(MEMORY, 0.0) / self.total[MEMORY],
        )
        below = False
        worst = 0.0
        for dim, allowance in self.ledger.tenant_limits(tenant).items():
            if allowance.guaranteed <= 0 or dim in (
                JOBS, CARD_HOURS
            ):
                continue
            below = True
            worst = max(worst, usage.get(dim, 0.0) / allowance.guaranteed)
        below = below and worst < 1.0
        return (not below, dominant)


def _policy_order(pending: list[PendingJob], shares: _FairShare) -> Iterator[PendingJob]:
    """Jobs in policy order. Fair share is re-read after each job, so a tenant that just got
    capacity yields to one that has less; the caller charges before asking for the next."""
    by_priority: dict[int, dict[str, list[PendingJob]]] = defaultdict(lambda: defaultdict(list))
    for job in pending:
        by_priority[job.priority][job.tenant].append(job)
    for prio in sorted(by_priority, reverse=True):
        queues = {
            t: deque(sorted(jobs, key=lambda j: (_submitted(j), j.id)))
            for t, jobs in by_priority[prio].items()
        }
        heap = [(*shares.key(t), _submitted(q[0]), t) for t, q in queues.items()]
        heapq.heapify(heap)
        while heap:
            _, _, _, tenant = heapq.heappop(heap)
            q = queues[tenant]
            yield q.popleft()
            if q:
                heapq.heappush(heap, (*shares.key(tenant), _submitted(q[0]), tenant))


# ---------------------------------------------------------------- the cycle


@dataclass(slots=True)
class _Victim:
    job: RunningJob
    models: tuple[str | None, ...]  # card model of each replica, for refunds
    nodes: frozenset[str]
    cards: float
    held: dict[str, tuple[int, int, int]]  # per node: CPU, memory, card milli it holds


class _Cycle:
    def __init__(self, snap: Snapshot, policy: str, ctx: _placement.PlacementContext | None):
        if ctx is None:
            ctx = _placement.PlacementContext(
                typical=typical_pods(
                    j.request for j in snap.pending if not j.request.mig_profile
                )
            )
        self.snap = snap
        self.ctx = ctx
        self.policy = policy
        self.fleet = snap.fleet or _fleet_from_nodes(snap.nodes)
        self.live = _Capacity(_copy_nodes(snap.nodes), snap.mig, policy, ctx)
        # The capacity as the cycle found it, to tell "someone ahead took it" from "never was".
        self.start = _Capacity(_copy_nodes(snap.nodes), snap.mig, policy, ctx)
        self._healthy_empty: _Capacity | None = None
        self._whole_empty: _Capacity | None = None
        self.ledger = QuotaLedger(snap.tenants, snap.projects)
        self.card_model = {(fn.name, c.index): c.model for fn in self.fleet for c in fn.cards}
        for n in snap.nodes:
            for g in n.gpus:
                self.card_model.setdefault((n.name, g.index), g.model)
        self.fleet_models = sorted({c.model for fn in self.fleet for c in fn.cards})
        self.mig_models = sorted({c.model for fn in self.fleet for c in fn.cards if c.mig})
        self.node_models: dict[str, frozenset[str]] = {
            n.name: frozenset(g.model for g in n.gpus) for n in self.live.nodes
        }
        self.running: dict[str, _Victim] = {}
        for job in snap.running:
            models = tuple(
                self.card_model.get((p.node, p.gpus[0])) if p.gpus else None
                for p in job.placements
            )
            cards = sum(len(p.gpus) * (p.milli / MILLI) for p in job.placements)
            held: dict[str, tuple[int, int, int]] = {}
            r = job.request
            for p in job.placements:
                c, m, g = held.get(p.node, (0, 0, 0))
                held[p.node] = (c + r.cpu_milli, m + r.memory_mib, g + len(p.gpus) * p.milli)
            self.running[job.id] = _Victim(
                job, models, frozenset(p.node for p in job.placements), cards, held
            )
        # Capacity only shrinks during a cycle except when a preemption frees some, so a shape
        # that failed fails again (and so does anything bigger) until then.
        self.no_room = _Failures()
        self.no_victims = _Failures()
        self.start_no_room = _Failures()
        self.start_fits: set[tuple[Request, int]] = set()
        self.memo_hits = 0
        self.preemption_searches = 0
        self.unsatisfiable: dict[tuple[Request, int], bool] = {}
        self.health_nodes: dict[tuple[Request, int], int] = {}
        self.result = CycleResult()

    # -- views of the fleet for reasons

    def healthy_empty(self) -> _Capacity:
        if self._healthy_empty is None:
            self._healthy_empty = _Capacity(
                _empty_nodes(self.fleet, True), {}, self.policy, self.ctx
            )
        return self._healthy_empty

    def whole_empty(self) -> _Capacity:
        if self._whole_empty is None:
            self._whole_empty = _Capacity(
                _empty_nodes(self.fleet, False), {}, self.policy, self.ctx
            )
        return self._whole_empty

    def spec_unsatisfiable(self, request: Request, replicas: int) -> bool:
        key = (request, replicas)
        hit = self.unsatisfiable.get(key)
        if hit is None:
            hit = not self.whole_empty().fits(request, replicas)
            self.unsatisfiable[key] = hit
        return hit

    def sick_nodes(self, request: Request, replicas: int) -> int:
        """How many nodes could host a replica if their cards were healthy and schedulable,
        or 0 when the healthy fleet can host the job when empty (then it is not health)."""
        key = (request, replicas)
        n = self.health_nodes.get(key)
        if n is None:
            n = 0
            if not self.healthy_empty().fits(request, replicas):
                healthy = self.healthy_empty()
                for node in self.whole_empty().nodes:
                    if not _hosts(node, request, self.whole_empty()):
                        continue
                    h = healthy.by_name.get(node.name)
                    if h is None or not _hosts(h, request, healthy):
                        n += 1
                n = max(n, 1)
            self.health_nodes[key] = n
        return n

    def fits_at_start(self, request: Request, replicas: int) -> bool:
        if self.start_no_room.known(request, replicas):
            return False
        key = (request, replicas)
        if key in self.start_fits:
            return True
        if self.start.fits(request, replicas):
            self.start_fits.add(key)
            return True
        self.start_no_room.add(request, replicas)
        return False

    # -- quota

    def candidate_models(self, request: Request) -> list[str | None]:
        if request.num_gpu == 0:
            return [None]
        pool = self.mig_models if request.mig_profile else self.fleet_models
        if request.mig_profile:
            pool = [m for m in pool if (profiles_for(m) or {}).get(request.mig_profile)]
        return [m for m in pool if request.models is None or m in request.models]

    def quota_view(
        self, job: PendingJob
    ) -> tuple[dict[str | None, dict[str, float]], list[Breach]]:
        """Demand per model the job may use within quota, and the breaches if there is none."""
        ok: dict[str | None, dict[str, float]] = {}
        models = self.candidate_models(job.request)
        mem = self.snap.model_memory_gib
        # CPU, memory, jobs and card-hours do not depend on the model: check them once.
        base = demand(job.request, [None] * job.replicas, mem, job.card_hours)
        breaches = self.ledger.breaches(job.tenant, job.project, base)
        if breaches or models == [None]:
            return ({} if breaches else {None: base}), breaches
        first: list[Breach] = []
        for model in models:
            need = demand(job.request, [model] * job.replicas, mem, job.card_hours)
            gpu_part = {k: v for k, v in need.items() if k not in base}
            b = self.ledger.breaches(job.tenant, job.project, gpu_part, spent_check=False)
            if b:
                first = first or b
            else:
                ok[model] = need
        return ok, first

    # -- one job

    def run(self) -> CycleResult:
        shares = _FairShare(self.ledger, self.fleet)
        waiting: list[tuple[PendingJob, WaitReason, str]] = []
        competing = 0  # jobs ahead that competed for capacity, admitted or not
        higher = 0  # of those, the ones with a strictly higher priority value
        prio_now: int | None = None
        for job in _policy_order(self.snap.pending, shares):
            if job.priority != prio_now:
                prio_now, higher = job.priority, competing
            reason, message = self.decide(job, competing, higher)
            if reason is None:
                competing += 1
                continue
            if reason in (WaitReason.PRIORITY, WaitReason.CAPACITY, WaitReason.HEALTH):
                competing += 1
            waiting.append((job, reason, message))
        self.result.waiting = [
            Wait(job.id, reason, message, pos)
            for pos, (job, reason, message) in enumerate(waiting, start=1)
        ]
        return self.result

    def decide(self, job: PendingJob, ahead: int, higher: int
               ) -> tuple[WaitReason | None, str]:
        req, reps = job.request, job.replicas
        if reps < 1 or self.spec_unsatisfiable(req, reps):
            return WaitReason.SPEC_UNSATISFIABLE, (
                f"no node in the fleet can ever host {_spec_label(job)}, healthy or not"
            )
        if job.budget_blocked:
            return WaitReason.BUDGET, (
                f"this month's blocking budget of project {job.project} or of its tenant is spent; "
                "a finance admin can raise it"
            )
        allowed, breaches = self.quota_view(job)
        if not allowed:
            return WaitReason.QUOTA, describe(breaches)
        # Restrict placement to the card models the quota still allows.
        if req.num_gpu and len(allowed) < len(self.candidate_models(req)):
            req = replace(req, models=frozenset(m for m in allowed if m is not None))
        placed = self.place(req, reps)
        if placed is None:
            placed = self.preempt(job, req, allowed)
        if placed is not None:
            self.admit(job, req, placed)
            return None, ""
        sick = self.sick_nodes(job.request, reps)
        if sick:
            models = _models_label(job.request)
            return WaitReason.HEALTH, (
                f"the {sick} node{'s' if sick != 1 else ''} with {models} that could fit it "
                f"{'are' if sick != 1 else 'is'} degraded, quarantined or cordoned"
            )
        if self.fits_at_start(req, reps):
            jobs = f"{ahead} job{'s' if ahead != 1 else ''}"
            if ahead == higher:
                text = f"behind {ahead} higher-priority job{'s' if ahead != 1 else ''}"
            elif higher == 0:
                text = f"behind {jobs} of the same priority, ahead by fair share or submit time"
            else:
                text = f"behind {jobs} ahead in the queue, {higher} of them higher-priority"
            return WaitReason.PRIORITY, text
        return WaitReason.CAPACITY, _capacity_sentence(req, reps)

    def place(self, req: Request, reps: int) -> list[Placement] | None:
        if self.no_room.known(req, reps):
            self.memo_hits += 1
            return None
        placed = self.live.place_all(req, reps)
        if placed is None:
            self.no_room.add(req, reps)
        return placed

    def admit(self, job: PendingJob, req: Request, placed: list[Placement]) -> None:
        models = [self.card_model.get((p.node, p.gpus[0])) if p.gpus else None for p in placed]
        need = demand(job.request, models, self.snap.model_memory_gib, job.card_hours)
        borrowed = self.ledger.would_borrow(job.project, need)
        self.ledger.charge(job.tenant, job.project, need)
        out = []
        for p, model in zip(placed, models, strict=True):
            node = self.live.by_name[p.node]
            uid = {g.index: g.uid for g in node.gpus}
            out.append(ReplicaPlacement(
                node=p.node,
                gpus=p.gpus,
                uids=tuple(uid[i] for i in p.gpus),
                milli=p.milli,
                model=model or "",
                mig_profile=req.mig_profile,
                mig_slot=p.mig_slot,
            ))
        self.result.admitted.append(Admission(job.id, tuple(out), borrowed))

    # -- preemption

    def preempt(
        self, job: PendingJob, req: Request, allowed: dict[str | None, dict[str, float]]
    ) -> list[Placement] | None:
        """Free room by stopping lower-priority preemptible jobs, if that provably helps.

        Borrowing is only allowed on idle capacity, so only the models the job can use within
        its project's guarantee may be reclaimed for it.
        """
        own = [m for m, need in allowed.items() if not self.ledger.would_borrow(job.project, need)]
        if not own:
            return None
        if req.num_gpu and len(own) < len(allowed):
            req = replace(req, models=frozenset(m for m in own if m is not None))
        reps = job.replicas
        # A lower priority has fewer possible victims: it fails wherever a higher one did.
        if self.no_victims.known(req, reps, -job.priority):
            self.memo_hits += 1
            return None
        candidates = [
            v for v in self.running.values()
            if v.job.preemptible and v.job.priority < job.priority and self._relevant(v, req)
        ]
        chosen: list[_Victim] | None = None
        if candidates:
            self.preemption_searches += 1
            candidates.sort(key=_victim_order)
            if reps == 1:
                chosen = self._victims_on_one_node(req, candidates)
            else:
                chosen = self._victims_anywhere(req, reps, candidates)
        if chosen is None:
            self.no_victims.add(req, reps, -job.priority)
            return None
        for v in chosen:
            self.live.release_running(v.job)
        touched = set().union(*(v.nodes for v in chosen)) & self.live.by_name.keys()
        placed = self.live.place_all(req, reps, only=touched if reps == 1 else None)
        if placed is None:  # placement disagrees with the check: stop nobody for nothing
            for v in reversed(chosen):
                self.live.reapply_running(v.job)
            self.no_victims.add(req, reps, -job.priority)
            return None
        # Capacity grew: shapes that failed before may fit now.
        self.no_room.clear()
        self.no_victims.clear()
        for v in chosen:
            del self.running[v.job.id]
            need = demand(v.job.request, v.models, self.snap.model_memory_gib)
            self.ledger.refund(v.job.tenant, v.job.project, need)
            self.result.preempted.append(
                Preemption(v.job.id, job.id, WaitReason.PREEMPTED, f"preempted by job {job.id}")
            )
        return placed

    def _victims_on_one_node(self, req: Request, candidates: list[_Victim]
                             ) -> list[_Victim] | None:
        """The best victim set on any single node that then hosts the replica, or None.

        On each node: stop victims in preference order until the replica fits, then give
        back every one it turns out not to need (an irreducible set). Across nodes the set
        with the fewest non-borrowed victims wins, then the fewest victims, then the lowest
        priority, the fewest cards and the most recent start.
        """
        on_node: dict[str, list[_Victim]] = defaultdict(list)
        for v in candidates:
            for name in v.nodes:
                if name in self.live.by_name:
                    on_node[name].append(v)
        # Visit nodes by a lower bound on their cost and stop once it beats no more: with a
        # borrowed victim somewhere, most of the fleet is never simulated.
        bounds = sorted(
            ((0 if any(v.job.borrowed for v in vs) else 1, 1, min(v.job.priority for v in vs)),
             name)
            for name, vs in on_node.items()
        )
        best: tuple[tuple, list[_Victim]] | None = None
        for bound, name in bounds:
            if best is not None and bound > best[0][:3]:
                break
            victims = on_node[name]
            node = self.live.by_name[name]
            if not self._could_ever(node, req, victims):
                continue
            freed: list[_Victim] = []
            for v in victims:
                self.live.release_running(v.job)
                freed.append(v)
                if _hosts(node, req, self.live):
                    break
            else:
                for v in reversed(freed):
                    self.live.reapply_running(v.job)
                continue
            freed = self._prune(freed, lambda node=node: _hosts(node, req, self.live))
            for v in reversed(freed):
                self.live.reapply_running(v.job)
            cost = (
                sum(not v.job.borrowed for v in freed),
                len(freed),
                max(v.job.priority for v in freed),
                sum(v.cards for v in freed),
                -max(v.job.started for v in freed),
            )
            if best is None or cost < best[0]:
                best = (cost, freed)
        return best[1] if best else None

    def _victims_anywhere(self, req: Request, reps: int, candidates: list[_Victim]
                          ) -> list[_Victim] | None:
        """For multi-replica jobs: stop victims in preference order until all replicas fit,
        then prune to an irreducible set. Leaves the fleet as it found it."""
        freed: list[_Victim] = []
        for v in candidates:
            self.live.release_running(v.job)
            freed.append(v)
            if self._all_fit(req, reps):
                break
        else:
            for v in reversed(freed):
                self.live.reapply_running(v.job)
            return None
        freed = self._prune(freed, lambda: self._all_fit(req, reps))
        for v in reversed(freed):
            self.live.reapply_running(v.job)
        return freed

    def _prune(self, freed: list[_Victim], fits) -> list[_Victim]:
        """Give back each victim the job does not need, last added (least preferred) first.

        The last one added is needed by construction: without it the job did not fit.
        """
        keep = list(freed)
        for v in reversed(freed[:-1]):
            self.live.reapply_running(v.job)
            if fits():
                keep.remove(v)
            else:
                self.live.release_running(v.job)
        return keep

    def _all_fit(self, req: Request, reps: int) -> bool:
        done = self.live.place_all(req, reps, first_fit=True)
        if done is None:
            return False
        self.live.unplace(done, req)
        return True

    def _could_ever(self, node: Node, req: Request, victims: list[_Victim]) -> bool:
        """Cheap necessary condition: the node's free plus the victims' holdings there."""
        cpu, mem, milli = node.cpu_free, node.memory_free, 0
        for v in victims:
            c, m, g = v.held[node.name]
            cpu, mem, milli = cpu + c, mem + m, milli + g
        if cpu < req.cpu_milli or mem < req.memory_mib:
            return False
        if req.num_gpu == 0 or req.mig_profile:
            return True
        free = sum(g.free_milli for g in node.gpus
                   if not g.mig and (req.models is None or g.model in req.models))
        return free + milli >= req.gpu_total_milli

    def _relevant(self, v: _Victim, req: Request) -> bool:
        for name in v.nodes:
            node = self.live.by_name.get(name)
            if node is None:
                continue
            if req.pools is not None and node.pool not in req.pools:
                continue
            if req.num_gpu == 0 or req.models is None or self.node_models[name] & req.models:
                return True
        return False


def _victim_order(v: _Victim) -> tuple:
    # Reclaim borrowed capacity first, then the least important, the smallest, the newest.
    return (not v.job.borrowed, v.job.priority, v.cards, -v.job.started, v.job.id)


def _hosts(node: Node, request: Request, cap: _Capacity) -> bool:
    if request.mig_profile:
        return cap.board.choose(request, {node.name}) is not None
    return _placement.feasible(node, request)


def run_cycle(
    snapshot: Snapshot,
    policy: str = DEFAULT_POLICY,
    ctx: _placement.PlacementContext | None = None,
) -> CycleResult:
    """Decide one cycle over the snapshot; the snapshot itself is not changed.

    ``policy`` is passed to ``engine.placement`` ("fgd", "best-fit", "random", ...). ``ctx``
    carries placement's caches and seeded rng across cycles; by default a fresh one whose
    typical workload is this cycle's pending jobs.
    """
    t0 = time.perf_counter()
    cycle = _Cycle(snapshot, policy, ctx)
    result = cycle.run()
    s = result.stats
    s.pending = len(snapshot.pending)
    s.admitted = len(result.admitted)
    s.preempted = len(result.preempted)
    s.waiting = len(result.waiting)
    s.decisions = s.admitted + s.preempted + s.waiting
    s.placement_calls = cycle.live.calls
    s.memo_hits = cycle.memo_hits
    s.preemption_searches = cycle.preemption_searches
    s.duration_s = time.perf_counter() - t0
    return result

"""GPU fragmentation as the FGD paper defines it: idle GPU capacity that typical jobs cannot use.

Given the "typical pods" (the most frequent request shapes, with their probabilities), a node's
fragment is the expected amount of its idle GPU capacity (in thousandths of a card) that an
arriving typical pod could not use: all of it when the pod does not fit on the node at all or
needs no GPU, otherwise the idle share on cards whose free share is below what the pod asks per
card. Placement minimises the growth of this number. This module is pure arithmetic on node
states; it must never import Django, mutate a node or depend on anything but its arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .fleet import MILLI, Request

# A node's GPU state as fragmentation sees it: (free_milli, domain, model) per card, sorted
# descending, MIG cards left out.
GpuKey = tuple[tuple[int, int, str], ...]

CUMULATIVE_CUT = 0.95


@dataclass(frozen=True, slots=True)
class TypicalPod:
    """One frequent request shape and its probability among arriving requests."""

    cpu_milli: int
    gpu_milli: int  # per card; 0 when the pod needs no GPU
    num_gpu: int
    models: frozenset[str] | None
    weight: float


def _shape(req: Request) -> tuple[int, int, int, frozenset[str] | None]:
    if req.num_gpu == 0:
        return (req.cpu_milli, 0, 0, req.models)
    return (req.cpu_milli, req.gpu_milli, req.num_gpu, req.models)


def _models_str(models: frozenset[str] | None) -> str:
    return "" if not models else "|".join(sorted(models))


class TypicalPods:
    """The typical-pod distribution plus a memo of node fragments under it.

    The memo is keyed by node state, so it stays valid for as long as the distribution does;
    build a new object when the distribution changes.
    """

    def __init__(self, pods: Iterable[TypicalPod]) -> None:
        self.pods: tuple[TypicalPod, ...] = tuple(pods)
        self._memo: dict[tuple[int, GpuKey], float] = {}
        self._cpu_per_card: float | None = None
        # Per card model: the typical GPU pods that may use it, as (cpu, milli, num, weight).
        self._by_model: dict[str, tuple[tuple[int, int, int, float], ...]] = {}

    def __len__(self) -> int:
        return len(self.pods)

    def _accessible(self, model: str) -> tuple[tuple[int, int, int, float], ...]:
        acc = self._by_model.get(model)
        if acc is None:
            acc = tuple(
                (t.cpu_milli, t.gpu_milli, t.num_gpu, t.weight)
                for t in self.pods
                if t.gpu_milli > 0 and (t.models is None or model in t.models)
            )
            self._by_model[model] = acc
        return acc

    def cpu_per_card(self) -> float:
        """CPU milli the typical GPU pods ask per whole card of GPU they ask (weighted by
        probability); 0.0 when no typical pod needs a GPU."""
        if self._cpu_per_card is not None:
            return self._cpu_per_card
        cpu = gpu = 0.0
        for t in self.pods:
            if t.gpu_milli > 0:
                cpu += t.weight * t.cpu_milli
                gpu += t.weight * t.gpu_milli * max(t.num_gpu, 1)
        self._cpu_per_card = cpu * MILLI / gpu if gpu else 0.0
        return self._cpu_per_card

    def node_fragment(self, cpu_free: int, gkey: GpuKey) -> float:
        """Expected unusable idle GPU milli of a node with this free CPU and card state."""
        key = (cpu_free, gkey)
        frag = self._memo.get(key)
        if frag is None:
            frag = self._compute(cpu_free, gkey)
            if len(self._memo) > 2_000_000:
                # Bounded so a long-lived portal process cannot grow it without limit.
                self._memo.clear()
            self._memo[key] = frag
        return frag

    def _compute(self, cpu_free: int, gkey: GpuKey) -> float:
        total = 0
        for free, _dom, _model in gkey:
            total += free
        if total == 0:
            return 0.0
        first_model = gkey[0][2]
        first_dom = gkey[0][1]
        uniform = all(m == first_model and d == first_dom for _f, d, m in gkey)
        if not uniform:
            return self._compute_mixed(cpu_free, gkey, total)
        frees = [f for f, _d, _m in gkey]  # descending
        top = frees[0]
        idle = 0
        for f in frees:
            if f == MILLI:
                idle += 1
        usable_by_milli: dict[int, int] = {}
        # Everything is fragment unless a typical pod fits; subtract what fitting pods can use.
        frag = float(total)
        for cpu, milli, num, weight in self._accessible(first_model):
            if cpu > cpu_free:
                continue
            if num <= 1:
                if top < milli:
                    continue
                usable = usable_by_milli.get(milli)
                if usable is None:
                    usable = 0
                    for f in frees:
                        if f < milli:
                            break
                        usable += f
                    usable_by_milli[milli] = usable
            else:
                if idle < num:
                    continue
                usable = idle * MILLI
            frag -= weight * usable
        return frag

    def _compute_mixed(self, cpu_free: int, gkey: GpuKey, total: int) -> float:
        frag = 0.0
        for t in self.pods:
            if t.gpu_milli == 0 or t.cpu_milli > cpu_free:
                frag += t.weight * total
                continue
            cards = [(f, d) for f, d, m in gkey if t.models is None or m in t.models]
            if t.num_gpu <= 1:
                hostable = any(f >= t.gpu_milli for f, _d in cards)
            else:
                per_dom: dict[int, int] = {}
                for f, d in cards:
                    if f == MILLI:
                        per_dom[d] = per_dom.get(d, 0) + 1
                hostable = any(n >= t.num_gpu for n in per_dom.values())
            if not hostable:
                frag += t.weight * total
                continue
            usable = sum(f for f, _d in cards if f >= t.gpu_milli)
            frag += t.weight * (total - usable)
        return frag


def typical_pods(requests: Iterable[Request], cut: float = CUMULATIVE_CUT) -> TypicalPods:
    """The distinct request shapes, most frequent first, cut at ``cut`` cumulative frequency
    and renormalised to sum to 1.

    A shape is (cpu, per-card GPU share, card count, model constraint); memory is left out, as
    in the FGD simulator. Equal counts are ordered by the larger shape first, as the simulator
    does, which only matters for where the cut falls.
    """
    counts: dict[tuple[int, int, int, frozenset[str] | None], int] = {}
    total = 0
    for req in requests:
        shape = _shape(req)
        counts[shape] = counts.get(shape, 0) + 1
        total += 1
    if total == 0:
        return TypicalPods(())
    ordered = sorted(
        counts.items(),
        key=lambda kv: (kv[1], kv[0][0], kv[0][1], kv[0][2], _models_str(kv[0][3])),
        reverse=True,
    )
    chosen = []
    cum = 0
    for shape, n in ordered:
        if cum >= cut * total:
            break
        chosen.append((shape, n))
        cum += n
    return TypicalPods(
        TypicalPod(cpu, milli, num, models, n / cum) for (cpu, milli, num, models), n in chosen
    )

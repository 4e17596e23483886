"""MIG slices: the real A100/H100 layout rules and a best-fit chooser over MIG-mode cards.

A MIG-mode card is cut into GPU instances whose memory slices (8 per card) and start slots
are fixed by NVIDIA: a 3g.40gb starts at slot 0 or 4 and covers four memory slices, a 4g or
7g only at 0, and so on (``nvidia-smi mig -lgipp``). This module keeps, per card, which
memory slices are taken and places a requested profile at a legal, free slot, preferring
the fullest card and the slot that keeps the biggest profiles placeable. It must never place
a slice at an illegal start, overlap two slices, touch a card not in MIG mode, or import
Django; whole-card and fractional placement belong to ``engine.placement``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from .fleet import MILLI, Gpu, Node, Placement, Request

COMPUTE_SLICES = 7
MEMORY_SLICES = 8
FULL = (1 << MEMORY_SLICES) - 1


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile: its compute slices, the memory slices it covers, its starts."""

    name: str
    compute: int
    units: int
    memory_gib: float
    starts: tuple[int, ...]

    def mask(self, slot: int) -> int:
        return ((1 << self.units) - 1) << slot

    @property
    def milli(self) -> int:
        """The compute share of the card, for accounting in thousandths."""
        return MILLI if self.compute == COMPUTE_SLICES else self.compute * MILLI // COMPUTE_SLICES


def _table(*rows: tuple[str, int, int, float, tuple[int, ...]]) -> dict[str, MigProfile]:
    return {name: MigProfile(name, c, u, m, s) for name, c, u, m, s in rows}


# A100-80GB and H100-80GB share names and placements (NVIDIA MIG user guide).
PROFILES_80GB = _table(
    ("1g.10gb", 1, 1, 10, (0, 1, 2, 3, 4, 5, 6)),
    ("1g.20gb", 1, 2, 20, (0, 2, 4, 6)),
    ("2g.20gb", 2, 2, 20, (0, 2, 4)),
    ("3g.40gb", 3, 4, 40, (0, 4)),
    ("4g.40gb", 4, 4, 40, (0,)),
    ("7g.80gb", 7, 8, 80, (0,)),
)
# A100-40GB: same geometry, half the memory (note "1g.10gb" means a different slice here).
PROFILES_40GB = _table(
    ("1g.5gb", 1, 1, 5, (0, 1, 2, 3, 4, 5, 6)),
    ("1g.10gb", 1, 2, 10, (0, 2, 4, 6)),
    ("2g.10gb", 2, 2, 10, (0, 2, 4)),
    ("3g.20gb", 3, 4, 20, (0, 4)),
    ("4g.20gb", 4, 4, 20, (0,)),
    ("7g.40gb", 7, 8, 40, (0,)),
)

# Exact model names the portal uses can be pinned here; otherwise the name is guessed.
MODEL_PROFILES: dict[str, dict[str, MigProfile]] = {}


def profiles_for(model: str) -> dict[str, MigProfile] | None:
    """The MIG profiles a card model supports, or None if it has no MIG."""
    if model in MODEL_PROFILES:
        return MODEL_PROFILES[model]
    m = model.lower()
    if not any(name in m for name in ("a100", "h100", "h800", "a800")):
        return None
    if "40" in m and "80" not in m:
        return PROFILES_40GB
    return PROFILES_80GB


def profile(model: str, name: str) -> MigProfile | None:
    table = profiles_for(model)
    return table.get(name) if table else None


# Tables by identity, so the cached helpers below can take a hashable key.
_TABLES: dict[int, dict[str, MigProfile]] = {
    id(PROFILES_80GB): PROFILES_80GB,
    id(PROFILES_40GB): PROFILES_40GB,
}


@cache
def _free_value(table_key: int, used: int) -> tuple[int, int]:
    """(largest profile still placeable, most compute still packable) for a used mask.

    Used to keep big slots open: between two slots that leave the same compute free, the one
    that still admits a 4g or 3g is worth more than one that leaves scattered 1g holes.
    """
    table = _TABLES[table_key]
    largest = 0
    for p in table.values():
        if p.compute > largest and any(not used & p.mask(s) for s in p.starts):
            largest = p.compute
    return largest, _packable(table_key, used)


@cache
def _packable(table_key: int, used: int) -> int:
    table = _TABLES[table_key]
    best = 0
    for p in table.values():
        for s in p.starts:
            m = p.mask(s)
            if not used & m:
                best = max(best, p.compute + _packable(table_key, used | m))
    return min(best, COMPUTE_SLICES)


def layout_mask(model: str, slices: Iterable[tuple[str, int]]) -> int | None:
    """The memory slices a layout covers, or None if it is illegal on that model.

    Illegal means: unknown profile, a start slot the profile cannot use, or two slices
    overlapping.
    """
    table = profiles_for(model)
    if table is None:
        return None
    used = 0
    for name, slot in slices:
        p = table.get(name)
        if p is None or slot not in p.starts:
            return None
        m = p.mask(slot)
        if used & m:
            return None
        used |= m
    return used


def legal_layout(model: str, slices: Iterable[tuple[str, int]]) -> bool:
    return layout_mask(model, slices) is not None


class MigCard:
    """The slices taken on one MIG-mode card."""

    __slots__ = ("compute_used", "gpu", "slices", "table", "used")

    def __init__(self, gpu: Gpu, slices: Iterable[tuple[str, int]] = ()) -> None:
        self.gpu = gpu
        self.table = profiles_for(gpu.model) or {}
        if self.table:
            _TABLES.setdefault(id(self.table), self.table)
        self.slices: list[tuple[str, int]] = list(slices)
        mask = layout_mask(gpu.model, self.slices) if self.table else None
        if mask is None:
            # An unknown model or a layout we cannot vouch for: treat the card as full rather
            # than risk placing a slice on top of something we do not understand.
            self.used = FULL
            self.compute_used = COMPUTE_SLICES
        else:
            self.used = mask
            self.compute_used = sum(self.table[n].compute for n, _ in self.slices)

    def candidates(self, p: MigProfile) -> list[int]:
        return [s for s in p.starts if not self.used & p.mask(s)]

    def take(self, p: MigProfile, slot: int) -> None:
        m = p.mask(slot)
        if slot not in p.starts or self.used & m:
            raise ValueError(f"{p.name} cannot start at slot {slot} on card {self.gpu.index}")
        self.used |= m
        self.compute_used += p.compute
        self.slices.append((p.name, slot))

    def give_back(self, p: MigProfile, slot: int) -> None:
        try:
            self.slices.remove((p.name, slot))
        except ValueError:
            return  # not ours to free (already released, or the card was marked full)
        self.used &= ~p.mask(slot)
        self.compute_used -= p.compute


class MigBoard:
    """MIG state of every MIG-mode card on the given nodes, with choose/apply/release.

    The same verbs as ``engine.placement`` so the cycle can treat both alike; the node's CPU
    and memory are taken and given back here too.
    """

    def __init__(
        self, nodes: list[Node], taken: dict[tuple[str, int], list[tuple[str, int]]] | None = None
    ) -> None:
        taken = taken or {}
        self.cards: dict[tuple[str, int], MigCard] = {}
        self.by_node: list[tuple[Node, list[MigCard]]] = []
        for node in nodes:
            mine = []
            for gpu in node.gpus:
                if gpu.mig:
                    card = MigCard(gpu, taken.get((node.name, gpu.index), ()))
                    self.cards[(node.name, gpu.index)] = card
                    mine.append(card)
            if mine:
                self.by_node.append((node, mine))

    def choose(self, request: Request, nodes: set[str] | None = None) -> Placement | None:
        """Best fit: the fullest card that still fits, at the slot keeping most room open."""
        name = request.mig_profile
        best: tuple | None = None
        best_place: Placement | None = None
        for node, cards in self.by_node:
            if nodes is not None and node.name not in nodes:
                continue
            if request.pools is not None and node.pool not in request.pools:
                continue
            if node.cpu_free < request.cpu_milli or node.memory_free < request.memory_mib:
                continue
            for card in cards:
                if request.models is not None and card.gpu.model not in request.models:
                    continue
                p = card.table.get(name)
                if p is None:
                    continue
                for slot in card.candidates(p):
                    after = card.used | p.mask(slot)
                    largest, packable = _free_value(id(card.table), after)
                    free_after = COMPUTE_SLICES - card.compute_used - p.compute
                    score = (free_after, -largest, -packable, -slot, node.name, card.gpu.index)
                    if best is None or score < best:
                        best = score
                        best_place = Placement(node.name, (card.gpu.index,), p.milli, slot)
        return best_place

    def apply(self, node: Node, placement: Placement, request: Request) -> None:
        if node.cpu_free < request.cpu_milli or node.memory_free < request.memory_mib:
            raise ValueError(f"{node.name}: not enough CPU or memory left")
        card = self.cards[(node.name, placement.gpus[0])]
        card.take(card.table[request.mig_profile], placement.mig_slot)
        node.cpu_free -= request.cpu_milli
        node.memory_free -= request.memory_mib
        node.touch()  # placement caches node scores by free CPU and memory

    def release(self, node: Node, placement: Placement, request: Request) -> None:
        card = self.cards.get((node.name, placement.gpus[0]))
        if card is not None and request.mig_profile in card.table:
            card.give_back(card.table[request.mig_profile], placement.mig_slot)
        node.cpu_free += request.cpu_milli
        node.memory_free += request.memory_mib
        node.touch()

    def layouts(self) -> dict[tuple[str, int], list[tuple[str, int]]]:
        return {key: list(card.slices) for key, card in self.cards.items()}

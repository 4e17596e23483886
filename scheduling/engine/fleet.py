"""The fleet as the engine sees it: nodes, their cards and what is free on them.

A snapshot of capacity, built by the portal from the database (or by the benchmark from a
trace). Only healthy cards on schedulable nodes belong in it: the caller leaves out
degraded, quarantined and failed cards and cordoned or down nodes, so placement can never
pick them. This module must never import Django.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MILLI = 1000  # one whole card, in thousandths


@dataclass(slots=True)
class Gpu:
    """One physical card on a node. ``free_milli`` is what is left of it (1000 = idle)."""

    index: int
    model: str
    free_milli: int = MILLI
    domain: int = 0  # NVLink / topology domain on its node
    uid: str = ""  # the portal's card id or UUID; the engine only carries it through
    mig: bool = False  # card is in MIG mode: only MIG slices, see engine.mig


@dataclass(slots=True)
class Node:
    """A schedulable node with its capacity and what is free now."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: list[Gpu]
    cpu_free: int = -1
    memory_free: int = -1
    pool: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    # Placement's cache of this node's free-capacity state (-1 = not known). Whoever changes
    # cpu_free, memory_free or a card's free_milli other than through placement.apply/release
    # must call touch(), or placement keeps scoring the node by its old state.
    engine_key: int = field(default=-1, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cpu_free < 0:
            self.cpu_free = self.cpu_milli
        if self.memory_free < 0:
            self.memory_free = self.memory_mib

    def touch(self) -> None:
        """Forget the cached state after free capacity was changed by hand."""
        self.engine_key = -1


@dataclass(frozen=True, slots=True)
class Request:
    """What one replica of a job asks for on one node.

    ``num_gpu`` whole cards (gpu_milli == 1000), or one share of one card
    (num_gpu == 1 and gpu_milli < 1000), or no GPU at all (num_gpu == 0).
    ``models`` restricts the card model (None = any). ``mig_profile`` asks for one MIG
    slice (e.g. "3g.40gb") instead of a share; then num_gpu == 1.
    """

    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int = MILLI
    models: frozenset[str] | None = None
    mig_profile: str = ""
    pools: frozenset[str] | None = None

    @property
    def gpu_total_milli(self) -> int:
        return self.num_gpu * self.gpu_milli if self.num_gpu > 1 else self.gpu_milli * self.num_gpu


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one replica goes: a node, the card indices on it and the share of each card."""

    node: str
    gpus: tuple[int, ...]
    milli: int  # per card: 1000 for whole cards, less for a share
    mig_slot: int = -1  # first compute slice of a MIG placement, -1 otherwise

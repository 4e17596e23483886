"""Benchmark: one scheduling cycle with 10,000 pending jobs over the 1,213-node Alibaba fleet.

Builds the fleet from the trace's node list (1 % of cards unhealthy, 1 % of nodes cordoned,
seeded), fills part of it with running jobs, draws 10,000 pending jobs from 100 projects of
20 tenants with request shapes from the trace's pod list (a third of GPU jobs pinned to one card
model, a few multi-replica), puts hard quotas on every tenant and project, runs one cycle of
the same ``scheduling.engine.cycle.run_cycle`` the portal uses, prints cycle time and decisions
per second next to the published comparison points, and writes JSON to bench/results/.
It is a measurement, not a timed test; it must never import Django.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduling.engine import placement  # noqa: E402
from scheduling.engine.cycle import run_cycle  # noqa: E402
from scheduling.engine.fleet import MILLI, Gpu, Node, Request  # noqa: E402
from scheduling.engine.quota import demand  # noqa: E402
from scheduling.engine.snapshot import (  # noqa: E402
    Allowance,
    Dimension,
    FleetCard,
    FleetNode,
    PendingJob,
    QuotaAccount,
    RunningJob,
    Snapshot,
    gpu_dimension,
)

TRACES = ROOT.parent / "shared" / "traces" / "alibaba-gpu-v2023"
NODES = TRACES / "openb_node_list_gpu_node.csv"
PODS = TRACES / "openb_pod_list_default.csv"
RESULTS = ROOT / "bench" / "results" / "cycle.json"

# Memory per card model (GiB) for the GPU-memory quota; G2/G3 are anonymised in the trace.
MODEL_MEMORY = {"P100": 16, "T4": 16, "V100M16": 16, "V100M32": 32, "A10": 24, "G2": 32,
                "G3": 40}
# The portal's default priority classes, by the trace's QoS column.
CLASSES = {
    "Guaranteed": ("production", 1000, False),
    "LS": ("training", 500, True),
    "Burstable": ("development", 100, True),
    "BE": ("batch", 10, True),
}
KUEUE_WORKLOADS_PER_S = 42  # Kueue's own regression test (../shared/BENCHMARKS.md)
SLURM_JOBS_PER_S = 500


def load_fleet(rng: random.Random) -> tuple[list[Node], list[FleetNode]]:
    nodes, fleet = [], []
    with NODES.open() as f:
        for row in csv.DictReader(f):
            name, model = row["sn"], row["model"]
            cpu, mem, n = int(row["cpu_milli"]), int(row["memory_mib"]), int(row["gpu"])
            schedulable = rng.random() >= 0.01
            cards = [FleetCard(i, model, rng.random() >= 0.01, 0, False, f"{name}/{i}")
                     for i in range(n)]
            fleet.append(FleetNode(name, cpu, mem, cards, schedulable, pool=model))
            if schedulable:
                nodes.append(Node(name, cpu, mem, [
                    Gpu(c.index, model, MILLI, 0, c.uid) for c in cards if c.healthy
                ], pool=model))
    return nodes, fleet


def load_shapes() -> list[tuple[Request, str, float]]:
    shapes = []
    with PODS.open() as f:
        for row in csv.DictReader(f):
            num = int(row["num_gpu"])
            milli = int(row["gpu_milli"]) if num else MILLI
            req = Request(int(row["cpu_milli"]), int(row["memory_mib"]), num, milli or MILLI)
            shapes.append((req, row["qos"], float(row["creation_time"])))
    return shapes


def spec_label(r: Request) -> str:
    model = "/".join(sorted(r.models)).lower() if r.models else "any-gpu"
    if r.num_gpu == 0:
        return f"cpu {r.cpu_milli // 1000}c"
    if r.gpu_milli < MILLI:
        return f"{model} x{r.gpu_milli / MILLI:g}"
    return f"{model} x{r.num_gpu}"


def build(seed: int, jobs: int, tenants: int, projects: int, running_share: float
          ) -> Snapshot:
    rng = random.Random(seed)
    nodes, fleet = load_fleet(rng)
    shapes = load_shapes()
    models = Counter(c.model for fn in fleet for c in fn.cards)
    model_list = sorted(models)
    tenant_ids = [f"tenant-{t:02d}" for t in range(tenants)]
    project_ids = [f"project-{p:03d}" for p in range(projects)]
    owner = {p: tenant_ids[i % tenants] for i, p in enumerate(project_ids)}

    def draw_request() -> tuple[Request, str, float]:
        req, qos, t = rng.choice(shapes)
        if req.num_gpu and rng.random() < 1 / 3:
            # Like the trace's gpuspec variant: a third of GPU jobs name a card model.
            req = Request(req.cpu_milli, req.memory_mib, req.num_gpu, req.gpu_milli,
                          frozenset({rng.choices(model_list, weights=[models[m] for m in
                                                                        model_list])[0]}))
        return req, qos, t

    # Quotas: each project is guaranteed a slice of every model and may borrow up to 3x;
    # each tenant up to 2.5x its guarantee. Concurrency, CPU, memory and card-hours as well.
    cpu_total = sum(fn.cpu_milli for fn in fleet)
    mem_total = sum(fn.memory_mib for fn in fleet)

    def limits(share: float, borrow: float) -> dict[str, Allowance]:
        out = {gpu_dimension(m): Allowance(n * share, n * share * borrow)
               for m, n in models.items()}
        out[Dimension.CPU_MILLI.value] = Allowance(cpu_total * share, cpu_total * share * borrow)
        out[Dimension.MEMORY_MIB.value] = Allowance(mem_total * share, mem_total * share * borrow)
        gmem = sum(MODEL_MEMORY[m] * n for m, n in models.items())
        out[Dimension.GPU_MEMORY_GIB.value] = Allowance(gmem * share, gmem * share * borrow)
        out[Dimension.JOBS.value] = Allowance(0, 400 * share * projects / 4)
        out[Dimension.CARD_HOURS_MONTH.value] = Allowance(0, 24 * 30 * sum(models.values())
                                                          * share)
        return out

    tenant_acc = {t: QuotaAccount(t, limits(0.8 / tenants, 2.5)) for t in tenant_ids}
    project_acc = {p: QuotaAccount(p, limits(0.8 / projects, 3.0)) for p in project_ids}
    for acc in [*tenant_acc.values(), *project_acc.values()]:
        lim = acc.limits[Dimension.CARD_HOURS_MONTH.value].limit or 0
        acc.usage[Dimension.CARD_HOURS_MONTH.value] = lim * rng.uniform(0.1, 1.0)

    # Running jobs: the fleet as a previous cycle left it, booked through placement itself.
    by_name = {n.name: n for n in nodes}
    card_model = {(fn.name, c.index): c.model for fn in fleet for c in fn.cards}
    ctx = placement.PlacementContext(rng=random.Random(seed))
    running: list[RunningJob] = []
    target = running_share * sum(len(n.gpus) for n in nodes) * MILLI
    held = 0
    while held < target:
        req, qos, t = draw_request()
        p = placement.choose(nodes, req, "best-fit", ctx)
        if p is None:
            continue
        project = rng.choice(project_ids)
        need = demand(req, [card_model[(p.node, p.gpus[0])] if p.gpus else None],
                      MODEL_MEMORY)
        if any(acc.usage.get(k, 0) + v > (acc.limits[k].limit or float("inf"))
               for acc in (project_acc[project], tenant_acc[owner[project]])
               for k, v in need.items() if k in acc.limits):
            continue
        placement.apply(by_name[p.node], p, req)
        held += req.gpu_total_milli
        for acc in (project_acc[project], tenant_acc[owner[project]]):
            for k, v in need.items():
                acc.usage[k] = acc.usage.get(k, 0) + v
        _name, prio, preemptible = CLASSES[qos]
        pg = project_acc[project]
        borrowed = any(pg.usage.get(k, 0) > pg.limits[k].guaranteed for k in need
                       if k in pg.limits and not k.startswith(("jobs", "card_hours")))
        running.append(RunningJob(f"run-{len(running)}", owner[project], project, req, [p],
                                  prio, preemptible, borrowed, started=t))

    pending = []
    for i in range(jobs):
        req, qos, t = draw_request()
        name, prio, preemptible = CLASSES[qos]
        project = rng.choice(project_ids)
        replicas = rng.choice((2, 4)) if req.num_gpu >= 1 and rng.random() < 0.02 else 1
        pending.append(PendingJob(
            f"job-{i:05d}", owner[project], project, req, priority=prio, priority_class=name,
            preemptible=preemptible, submitted=t + rng.random(), replicas=replicas,
            spec=spec_label(req), card_hours=rng.choice((None, 1.0, 8.0, 64.0)),
            budget_blocked=rng.random() < 0.01,
        ))
    return Snapshot(nodes=nodes, pending=pending, running=running, tenants=tenant_acc,
                    projects=project_acc, fleet=fleet, model_memory_gib=MODEL_MEMORY)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--tenants", type=int, default=20)
    ap.add_argument("--projects", type=int, default=100)
    ap.add_argument("--running", type=float, default=0.5,
                    help="share of healthy GPU capacity held by running jobs before the cycle")
    ap.add_argument("--policy", default="fgd")
    ap.add_argument("--repeat", type=int, default=3,
                    help="run the same cycle this many times and report the median")
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    snap = build(args.seed, args.jobs, args.tenants, args.projects, args.running)
    build_s = time.perf_counter() - t0
    runs = [run_cycle(snap, policy=args.policy) for _ in range(max(1, args.repeat))]
    times = sorted(r.stats.duration_s for r in runs)
    result = runs[0]
    s = result.stats
    # The cycle is a pure function of the snapshot: every run decides the same.
    assert all(r.stats.decisions == s.decisions for r in runs)
    s.duration_s = times[len(times) // 2]
    reasons = Counter(w.reason.value for w in result.waiting)
    rate = s.decisions / s.duration_s
    print(f"fleet: {len(snap.fleet)} nodes ({len(snap.nodes)} schedulable), "
          f"{sum(len(n.gpus) for n in snap.nodes)} healthy cards; "
          f"{len(snap.running)} running, {len(snap.pending)} pending jobs "
          f"from {args.projects} projects of {args.tenants} tenants (built in {build_s:.2f} s)")
    print(f"cycle ({args.policy}): {s.duration_s:.3f} s (median of {len(times)}; "
          f"min {times[0]:.3f} s), {s.decisions} decisions, {rate:,.0f} decisions/s")
    print(f"  admitted {s.admitted}, preempted {s.preempted}, waiting {s.waiting}: "
          + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    print(f"  placement calls {s.placement_calls}, memo hits {s.memo_hits}, "
          f"preemption searches {s.preemption_searches}")
    print(f"  vs Kueue ~{KUEUE_WORKLOADS_PER_S}/s: x{rate / KUEUE_WORKLOADS_PER_S:,.0f}; "
          f"vs Slurm ~{SLURM_JOBS_PER_S}/s: x{rate / SLURM_JOBS_PER_S:,.1f}")
    out = {
        "benchmark": "cycle",
        "seed": args.seed,
        "policy": args.policy,
        "nodes": len(snap.fleet),
        "schedulable_nodes": len(snap.nodes),
        "healthy_cards": sum(len(n.gpus) for n in snap.nodes),
        "tenants": args.tenants,
        "projects": args.projects,
        "running": len(snap.running),
        "pending": len(snap.pending),
        "cycle_s": round(s.duration_s, 4),
        "cycle_s_runs": [round(t, 4) for t in times],
        "decisions": s.decisions,
        "decisions_per_s": round(rate, 1),
        "admitted": s.admitted,
        "preempted": s.preempted,
        "waiting": s.waiting,
        "wait_reasons": dict(sorted(reasons.items())),
        "placement_calls": s.placement_calls,
        "memo_hits": s.memo_hits,
        "preemption_searches": s.preemption_searches,
        "ratio_vs_kueue": round(rate / KUEUE_WORKLOADS_PER_S, 1),
        "ratio_vs_slurm": round(rate / SLURM_JOBS_PER_S, 2),
        "python": platform.python_version(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

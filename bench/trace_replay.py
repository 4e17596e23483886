"""Trace replay of the FGD paper (Alibaba GPU trace 2023): placement quality of our policies.

Replays a pod list on the trace's node list exactly as /work/shared/BENCHMARKS.md section 1
prescribes (inflate to ``--tune`` x GPU capacity with a seeded draw, shuffle, place one pod at
a time once, measure after every pod) and prints mean unallocated GPU % at 100 % and 130 %
arrived next to the paper's published numbers, plus placements per second. It drives only the
pure-Python engine (scheduling.engine); it must never import Django or touch a database, and
writes nothing outside its JSON output file.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scheduling.engine.fleet import MILLI, Gpu, Node, Request  # noqa: E402
from scheduling.engine.fragmentation import typical_pods  # noqa: E402
from scheduling.engine.placement import (  # noqa: E402
    DEFAULT_POLICY,
    POLICIES,
    PlacementContext,
    apply,
    choose,
    node_fragment,
)

TRACES = REPO.parent / "shared" / "traces" / "alibaba-gpu-v2023"
PUBLISHED_POLICY = {"random": "01-Random", "best-fit": "05-BestFit", "fgd-paper": "06-FGD",
                    "fgd": "06-FGD", "fgd-cpu": "06-FGD"}
LEVELS = (100, 130)


def load_nodes(path: Path) -> list[Node]:
    nodes = []
    with path.open() as fh:
        for row in csv.DictReader(fh):
            model = row["model"]
            gpus = [Gpu(index=i, model=model) for i in range(int(row["gpu"]))]
            nodes.append(Node(name=row["sn"], cpu_milli=int(row["cpu_milli"]),
                              memory_mib=int(row["memory_mib"]), gpus=gpus))
    return nodes


def load_pods(path: Path) -> list[Request]:
    pods = []
    with path.open() as fh:
        for row in csv.DictReader(fh):
            num = int(row["num_gpu"])
            milli = int(row["gpu_milli"]) if num else 0
            spec = (row.get("gpu_spec") or "").strip()
            models = frozenset(m for m in spec.split("|") if m) or None
            pods.append(Request(cpu_milli=int(row["cpu_milli"]), memory_mib=int(row["memory_mib"]),
                                num_gpu=num, gpu_milli=milli, models=models))
    return pods


def workload(pods: list[Request], capacity_milli: int, tune: float, seed: int) -> list[Request]:
    """Inflate (or, like the simulator, randomly prune) to ``tune`` x capacity, then shuffle."""
    rng = random.Random(seed)
    out = list(pods)
    target = tune * capacity_milli
    total = sum(p.gpu_total_milli for p in out)
    if total < target:
        while True:
            p = pods[rng.randrange(len(pods))]
            if total + p.gpu_total_milli > target:
                break
            out.append(p)
            total += p.gpu_total_milli
    while total > target and out:
        p = out.pop(rng.randrange(len(out)))
        total -= p.gpu_total_milli
    rng.shuffle(out)
    return out


def replay(nodes_path: Path, pods_path: Path, policy: str, seed: int, tune: float,
           with_frag: bool = True, limit: int | None = None) -> dict:
    nodes = load_nodes(nodes_path)
    originals = load_pods(pods_path)
    typical = typical_pods(originals)
    capacity = sum(len(n.gpus) for n in nodes) * MILLI
    pods = workload(originals, capacity, tune, seed)
    if limit is not None:
        pods = pods[:limit]
    rng = random.Random(seed * 7919 + 1)
    # The simulator names nodes with a seeded random prefix and its scheduler breaks ties by
    # name, i.e. by a random but fixed node order per seed.
    order = list(range(len(nodes)))
    rng.shuffle(order)
    ctx = PlacementContext(typical=typical, rng=rng,
                           node_rank={n.name: r for n, r in zip(nodes, order, strict=True)})
    by_name = {n.name: n for n in nodes}
    frag = {n.name: node_fragment(n, typical) for n in nodes} if with_frag else {}
    frag_total = sum(frag.values())
    arrived = allocated = failed = 0
    steps_arrived, steps_alloc, steps_frag = [], [], []
    t0 = time.perf_counter()
    for req in pods:
        arrived += req.gpu_total_milli
        pl = choose(nodes, req, policy, ctx)
        if pl is None:
            failed += 1
        else:
            node = by_name[pl.node]
            apply(node, pl, req)
            allocated += req.gpu_total_milli
            if with_frag:
                new = node_fragment(node, typical)
                frag_total += new - frag[node.name]
                frag[node.name] = new
        steps_arrived.append(round(100.0 * arrived / capacity, 4))
        steps_alloc.append(round(100.0 * allocated / capacity, 4))
        if with_frag:
            steps_frag.append(round(100.0 * frag_total / capacity, 4))
    elapsed = time.perf_counter() - t0
    return {
        "seed": seed,
        "policy": policy,
        "pods": len(pods),
        "failed": failed,
        "seconds": round(elapsed, 3),
        "placements_per_s": round(len(pods) / elapsed, 1) if elapsed else None,
        "unallocated_at": {
            str(lv): unallocated_at(steps_arrived, steps_alloc, lv) for lv in LEVELS
        },
        "steps": {"arrived_pct": steps_arrived, "allocated_pct": steps_alloc,
                  "frag_pct": steps_frag},
    }


def unallocated_at(arrived: list[float], alloc: list[float], level: float) -> float | None:
    """Unallocated GPU % at the last step whose arrived % does not exceed ``level``."""
    value = None
    for a, al in zip(arrived, alloc, strict=True):
        if a > level + 1e-9:
            break
        value = 100.0 - al
    return None if value is None else round(value, 3)


def published(results_csv: Path, workload_name: str) -> dict[tuple[str, int], float]:
    out = {}
    if not results_csv.exists():
        return out
    with results_csv.open() as fh:
        for row in csv.DictReader(fh):
            if row["workload"] == workload_name:
                out[(row["policy"], int(row["arrived_pct_of_gpu_capacity"]))] = float(
                    row["mean_unalloc_pct"])
    return out


def parse_seeds(text: str) -> list[int]:
    seeds = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            seeds.extend(range(int(lo), int(hi) + 1))
        elif part:
            seeds.append(int(part))
    return seeds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=Path, default=TRACES / "openb_node_list_gpu_node.csv")
    ap.add_argument("--pods", type=Path, default=TRACES / "openb_pod_list_default.csv")
    ap.add_argument("--policy", default=DEFAULT_POLICY,
                    help=f"comma-separated, from {', '.join(POLICIES)}; 'all' for every one")
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--tune", type=float, default=1.3)
    ap.add_argument("--json", type=Path, default=None,
                    help="output file (default bench/results/trace_replay-<pods>.json)")
    ap.add_argument("--no-frag", action="store_true", help="skip fragmentation logging")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N pods")
    args = ap.parse_args(argv)

    policies = list(POLICIES) if args.policy == "all" else args.policy.split(",")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}")
    seeds = parse_seeds(args.seeds)
    workload_name = args.pods.stem
    pub = published(args.nodes.parent / "fgd-paper-results.csv", workload_name)
    out_path = args.json or REPO / "bench" / "results" / f"trace_replay-{workload_name}.json"

    runs = []
    summary = {}
    print(f"trace {workload_name}, nodes {args.nodes.name}, tune {args.tune}, seeds {args.seeds}")
    for policy in policies:
        per_seed = []
        for seed in seeds:
            r = replay(args.nodes, args.pods, policy, seed, args.tune,
                       with_frag=not args.no_frag, limit=args.limit)
            per_seed.append(r)
            runs.append(r)
            u = r["unallocated_at"]
            print(f"  {policy:10s} seed {seed}: unalloc@100 {u['100']}  @130 {u['130']}  "
                  f"failed {r['failed']}/{r['pods']}  {r['placements_per_s']} placements/s",
                  flush=True)
        row = {"seeds": seeds}
        for lv in LEVELS:
            vals = [r["unallocated_at"][str(lv)] for r in per_seed
                    if r["unallocated_at"][str(lv)] is not None]
            row[f"mean_unalloc_{lv}"] = round(statistics.mean(vals), 3) if vals else None
            row[f"sd_unalloc_{lv}"] = round(statistics.stdev(vals), 3) if len(vals) > 1 else None
            row[f"published_{lv}"] = pub.get((PUBLISHED_POLICY.get(policy, ""), lv))
        row["placements_per_s"] = round(statistics.mean(r["placements_per_s"] for r in per_seed), 1)
        summary[policy] = row

    print()
    print(f"{'policy':10s} | {'@100 ours':>9s} {'paper':>6s} | {'@130 ours':>9s} {'paper':>6s} | "
          f"{'sd@130':>6s} | placements/s")
    for policy, row in summary.items():
        def fmt(v):
            return "-" if v is None else f"{v:.2f}"
        print(f"{policy:10s} | {fmt(row['mean_unalloc_100']):>9s} {fmt(row['published_100']):>6s}"
              f" | {fmt(row['mean_unalloc_130']):>9s} {fmt(row['published_130']):>6s} | "
              f"{fmt(row['sd_unalloc_130']):>6s} | {row['placements_per_s']}")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "trace": workload_name, "nodes": str(args.nodes), "pods": str(args.pods),
        "tune": args.tune, "summary": summary, "runs": runs,
    }))
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

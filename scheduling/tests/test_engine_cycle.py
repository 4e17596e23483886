"""The scheduling cycle on plain dataclasses: quota, order, placement, preemption, reasons.

Pure Python, no database: run with ``pytest scheduling/tests/test_engine_cycle.py -p no:django``.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from datetime import datetime, timedelta

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduling.engine import placement as placement_mod
from scheduling.engine.cycle import run_cycle
from scheduling.engine.fleet import MILLI, Gpu, Node, Placement, Request
from scheduling.engine.mig import (
    PROFILES_80GB,
    MigBoard,
    MigCard,
    layout_mask,
    legal_layout,
    profiles_for,
)
from scheduling.engine.quota import demand
from scheduling.engine.snapshot import (
    Allowance,
    FleetCard,
    FleetNode,
    PendingJob,
    QuotaAccount,
    RunningJob,
    Snapshot,
    WaitReason,
    gpu_dimension,
)

H100 = frozenset({"H100"})
A100 = frozenset({"A100-80G"})
MEM = {"H100": 80.0, "A100-80G": 80.0, "L4": 24.0}


def make_node(name, cards=8, model="H100", domains=1, mig=False, cpu=128_000, mem=1_048_576,
              pool=""):
    per = max(1, cards // domains)
    gpus = [Gpu(i, model, MILLI, i // per, f"{name}-gpu{i}", mig) for i in range(cards)]
    return Node(name, cpu, mem, gpus, pool=pool)


def req(gpus=1, milli=MILLI, models=H100, cpu=4000, mem=16384, mig=""):
    return Request(cpu, mem, gpus, milli, models, mig)


def pending(jid, request=None, tenant="t1", project="p1", priority=100, submitted=0.0,
            replicas=1, preemptible=True, **kw):
    return PendingJob(jid, tenant, project, request or req(), priority=priority,
                      preemptible=preemptible, submitted=submitted, replicas=replicas, **kw)


def run_on(nodes, jid, request, tenant="t1", project="p1", priority=10, preemptible=True,
           borrowed=False, started=0.0, replicas=1, mig=None):
    """A running job, booked on the given nodes the way the portal's snapshot would show it."""
    by_name = {n.name: n for n in nodes}
    ctx = placement_mod.PlacementContext()
    placements = []
    for _ in range(replicas):
        if request.mig_profile:
            board = MigBoard(nodes, mig)
            p = board.choose(request)
            board.apply(by_name[p.node], p, request)
            mig.setdefault((p.node, p.gpus[0]), []).append((request.mig_profile, p.mig_slot))
        else:
            p = placement_mod.choose(nodes, request, "best-fit", ctx)
            placement_mod.apply(by_name[p.node], p, request)
        placements.append(p)
    return RunningJob(jid, tenant, project, request, placements, priority=priority,
                      preemptible=preemptible, borrowed=borrowed, started=started)


def waits(result):
    return {w.job_id: w for w in result.waiting}


def admitted(result):
    return {a.job_id: a for a in result.admitted}


# ---------------------------------------------------------------- wait reasons


def test_quota_reason_gives_project_and_tenant_numbers():
    snap = Snapshot(
        nodes=[make_node("n1"), make_node("n2")],
        pending=[pending("j1", req(gpus=4), tenant="nlp", project="llm")],
        projects={"llm": QuotaAccount("llm-finetune", {gpu_dimension("H100"): Allowance(8, 8)},
                                      {gpu_dimension("H100"): 8})},
        tenants={"nlp": QuotaAccount("nlp-group", {gpu_dimension("H100"): Allowance(8, 16)},
                                     {gpu_dimension("H100"): 14})},
        model_memory_gib=MEM,
    )
    w = waits(run_cycle(snap))["j1"]
    assert w.reason is WaitReason.QUOTA
    assert "project llm-finetune: 8 of 8 H100 in use" in w.message
    assert "tenant nlp-group: 14 of 16 H100 in use" in w.message
    assert w.position == 1


def test_quota_counts_jobs_admitted_earlier_in_the_same_cycle():
    snap = Snapshot(
        nodes=[make_node("n1")],
        pending=[pending(f"j{i}", req(gpus=1), submitted=i) for i in range(5)],
        projects={"p1": QuotaAccount("p1", {gpu_dimension("H100"): Allowance(3, 3)})},
    )
    r = run_cycle(snap)
    assert set(admitted(r)) == {"j0", "j1", "j2"}
    assert {w.reason for w in r.waiting} == {WaitReason.QUOTA}


def test_monthly_card_hours_spent_blocks_even_without_estimate():
    snap = Snapshot(
        nodes=[make_node("n1")],
        pending=[pending("j1"), pending("j2", card_hours=5.0, project="p2")],
        projects={
            "p1": QuotaAccount("p1", {"card_hours_month": Allowance(0, 100)},
                               {"card_hours_month": 100}),
            "p2": QuotaAccount("p2", {"card_hours_month": Allowance(0, 100)},
                               {"card_hours_month": 97}),
        },
    )
    w = waits(run_cycle(snap))
    assert w["j1"].reason is WaitReason.QUOTA and "100 of 100 card-hours" in w["j1"].message
    assert w["j2"].reason is WaitReason.QUOTA and "needs 5" in w["j2"].message


def test_capacity_reason_names_the_shape():
    nodes = [make_node("n1", cards=8, domains=2)]  # two NVLink domains of 4
    snap = Snapshot(nodes=nodes, pending=[pending("big", req(gpus=8))],
                    fleet=[FleetNode("n1", 128_000, 1_048_576,
                                     [FleetCard(i, "H100", True, 0) for i in range(8)])])
    # The fleet summary says one domain of 8 exists, but the live node is split: the
    # healthy-empty fleet can host it, so this is capacity, not spec or health.
    nodes2 = [make_node("n1", cards=8)]
    snap2 = Snapshot(nodes=nodes2, pending=[pending("j1", req(gpus=4)), pending("j2", req(gpus=4)),
                                            pending("j3", req(gpus=4))])
    run_on(nodes2, "r1", req(gpus=8), priority=1000, preemptible=False)
    w = waits(run_cycle(snap2))
    assert w["j1"].reason is WaitReason.CAPACITY
    assert w["j1"].message.startswith("no healthy node with 4 free H100 in one NVLink domain")
    assert [w[j].position for j in ("j1", "j2", "j3")] == [1, 2, 3]
    assert waits(run_cycle(snap))["big"].reason is WaitReason.CAPACITY


def test_priority_reason_counts_higher_priority_jobs_ahead():
    snap = Snapshot(
        nodes=[make_node("n1", cards=4)],
        pending=[pending(f"hi{i}", req(gpus=1), priority=500, submitted=10 + i)
                 for i in range(4)] + [pending("low", req(gpus=1), priority=100, submitted=0)],
    )
    r = run_cycle(snap)
    assert set(admitted(r)) == {"hi0", "hi1", "hi2", "hi3"}
    w = waits(r)["low"]
    assert w.reason is WaitReason.PRIORITY
    assert w.message == "behind 4 higher-priority jobs"


def test_health_reason_when_only_unhealthy_cards_could_fit():
    # n1 has 8 H100 but two are quarantined; n2 is cordoned. An 8-card job fits neither.
    fleet = [
        FleetNode("n1", 128_000, 1_048_576,
                  [FleetCard(i, "H100", healthy=i >= 2) for i in range(8)]),
        FleetNode("n2", 128_000, 1_048_576, [FleetCard(i, "H100") for i in range(8)],
                  schedulable=False),
    ]
    n1 = make_node("n1")
    n1.gpus = [g for g in n1.gpus if g.index >= 2]
    snap = Snapshot(nodes=[n1], fleet=fleet, pending=[pending("j8", req(gpus=8)),
                                                       pending("j6", req(gpus=6))])
    r = run_cycle(snap)
    w = waits(r)["j8"]
    assert w.reason is WaitReason.HEALTH
    assert w.message.startswith("the 2 nodes with H100 that could fit it are")
    assert admitted(r)["j6"].placements[0].gpus == (2, 3, 4, 5, 6, 7)


def test_budget_reason():
    snap = Snapshot(nodes=[make_node("n1")], pending=[pending("j1", budget_blocked=True)])
    w = waits(run_cycle(snap))["j1"]
    assert w.reason is WaitReason.BUDGET and "budget" in w.message


def test_spec_unsatisfiable_reason():
    snap = Snapshot(
        nodes=[make_node("n1")],
        pending=[pending("j16", req(gpus=16)), pending("l4", req(models=frozenset({"L4"}))),
                 pending("mig", req(mig="3g.40gb"))],
    )
    w = waits(run_cycle(snap))
    assert all(w[j].reason is WaitReason.SPEC_UNSATISFIABLE for j in ("j16", "l4", "mig"))
    assert "can ever host" in w["j16"].message


# ---------------------------------------------------------------- order


def test_priority_beats_arrival():
    snap = Snapshot(
        nodes=[make_node("n1", cards=1)],
        pending=[pending("early", priority=100, submitted=datetime(2025, 1, 1)),
                 pending("late", priority=900, submitted=datetime(2025, 1, 2))],
    )
    r = run_cycle(snap)
    assert set(admitted(r)) == {"late"}
    assert waits(r)["early"].reason is WaitReason.PRIORITY


def test_submit_time_breaks_ties_within_a_tenant():
    t0 = datetime(2025, 1, 1)
    snap = Snapshot(
        nodes=[make_node("n1", cards=1)],
        pending=[pending("second", submitted=t0 + timedelta(minutes=5)),
                 pending("first", submitted=t0)],
    )
    assert set(admitted(run_cycle(snap))) == {"first"}


def test_tenant_below_its_guarantee_goes_first():
    tenants = {
        "rich": QuotaAccount("rich", {gpu_dimension("H100"): Allowance(4, None)},
                             {gpu_dimension("H100"): 6}),
        "poor": QuotaAccount("poor", {gpu_dimension("H100"): Allowance(4, None)},
                             {gpu_dimension("H100"): 1}),
    }
    snap = Snapshot(
        nodes=[make_node("n1", cards=1)],
        tenants=tenants,
        pending=[pending("r", tenant="rich", project="pr", submitted=0),
                 pending("p", tenant="poor", project="pp", submitted=100)],
    )
    assert set(admitted(run_cycle(snap))) == {"p"}


def test_lower_dominant_share_goes_first_and_shares_update_within_the_cycle():
    tenants = {
        "a": QuotaAccount("a", {}, {gpu_dimension("H100"): 3}),
        "b": QuotaAccount("b", {}, {gpu_dimension("H100"): 1}),
    }
    snap = Snapshot(
        nodes=[make_node("n1", cards=4)],
        tenants=tenants,
        pending=[pending(f"a{i}", tenant="a", project="pa", submitted=i) for i in range(4)]
        + [pending(f"b{i}", tenant="b", project="pb", submitted=10 + i) for i in range(4)],
    )
    r = run_cycle(snap)
    # b starts at 1 card vs a's 3: b gets two cards, then they alternate a, b.
    assert [a.job_id for a in r.admitted] == ["b0", "b1", "a0", "b2"]


# ---------------------------------------------------------------- borrowing


def test_borrowing_between_guaranteed_and_limit_is_marked():
    dim = gpu_dimension("H100")
    snap = Snapshot(
        nodes=[make_node("n1")],
        projects={"p1": QuotaAccount("p1", {dim: Allowance(2, 4)}, {dim: 1})},
        pending=[pending(f"j{i}", submitted=i) for i in range(5)],
    )
    r = run_cycle(snap)
    a = admitted(r)
    assert not a["j0"].borrowed  # 2 of 2 guaranteed
    assert a["j1"].borrowed and a["j2"].borrowed  # 3, 4 of limit 4
    assert waits(r)["j3"].reason is WaitReason.QUOTA


def test_borrowing_job_does_not_preempt():
    dim = gpu_dimension("H100")
    nodes = [make_node("n1", cards=1)]
    victim = run_on(nodes, "v", req(), tenant="t2", project="p2", priority=10)
    snap = Snapshot(
        nodes=nodes, running=[victim],
        projects={"p1": QuotaAccount("p1", {dim: Allowance(0, 4)})},
        pending=[pending("j", priority=500)],
    )
    r = run_cycle(snap)
    assert not r.preempted and not r.admitted


# ---------------------------------------------------------------- preemption


def test_production_job_is_never_preempted():
    nodes = [make_node("n1", cards=2)]
    prod = run_on(nodes, "prod", req(gpus=2), priority=10, preemptible=False)
    snap = Snapshot(nodes=nodes, running=[prod], pending=[pending("urgent", priority=1000)])
    r = run_cycle(snap)
    assert r.preempted == []
    assert waits(r)["urgent"].reason is WaitReason.CAPACITY


def test_equal_priority_is_never_preempted():
    nodes = [make_node("n1", cards=1)]
    same = run_on(nodes, "same", req(), priority=100)
    snap = Snapshot(nodes=nodes, running=[same], pending=[pending("j", priority=100)])
    assert run_cycle(snap).preempted == []


def test_preemption_reclaims_borrowed_capacity_first():
    nodes = [make_node("n1", cards=2)]
    owned = run_on(nodes, "owned", req(), priority=10, started=100, project="pa")
    lent = run_on(nodes, "lent", req(), priority=50, borrowed=True, started=1, project="pb")
    snap = Snapshot(nodes=nodes, running=[owned, lent],
                    pending=[pending("j", priority=500, project="pc")])
    r = run_cycle(snap)
    assert [(p.victim_id, p.by_job_id) for p in r.preempted] == [("lent", "j")]
    assert r.preempted[0].reason is WaitReason.PREEMPTED
    assert r.preempted[0].message == "preempted by job j"
    assert "j" in admitted(r)


def test_preemption_picks_a_minimal_victim_set():
    # Two nodes: n1 holds four 1-card jobs, n2 one 4-card job. A 4-card job needs one node.
    nodes = [make_node("n1", cards=4), make_node("n2", cards=4)]
    small = [run_on(nodes[:1], f"s{i}", req(), priority=5, started=i) for i in range(4)]
    big = run_on(nodes[1:], "big", req(gpus=4), priority=20, started=0)
    snap = Snapshot(nodes=nodes, running=[*small, big], pending=[pending("j", req(gpus=4),
                                                                          priority=500)])
    r = run_cycle(snap)
    # The smallest set wins: one 4-card victim rather than four 1-card ones, though each of
    # the small ones would come first on its own.
    assert {p.victim_id for p in r.preempted} == {"big"}
    assert admitted(r)["j"].placements[0].node == "n2"


def test_preemption_spares_victims_it_does_not_need():
    nodes = [make_node("n1", cards=2)]
    lent = run_on(nodes, "lent", req(), priority=50, borrowed=True, started=5)
    low = run_on(nodes, "low", req(), priority=5, started=9)
    snap = Snapshot(nodes=nodes, running=[lent, low], pending=[pending("j", priority=500)])
    r = run_cycle(snap)
    assert [p.victim_id for p in r.preempted] == ["lent"]


def test_preemption_only_stops_jobs_whose_room_the_job_can_use():
    nodes = [make_node("n1", cards=2), make_node("n2", cards=2)]
    a = run_on(nodes[:1], "a", req(), priority=5)
    b = run_on(nodes[1:], "b", req(), priority=5)
    prod = run_on(nodes[:1], "prod", req(), priority=10, preemptible=False)
    snap = Snapshot(nodes=nodes, running=[a, b, prod],
                    pending=[pending("j", req(gpus=2), priority=500)])
    r = run_cycle(snap)
    # Only freeing a or b on n2 could ever make a 2-card domain: n2 holds b alone.
    assert [p.victim_id for p in r.preempted] == ["b"]
    assert admitted(r)["j"].placements[0].node == "n2"


def test_preemption_refunds_the_victims_quota():
    dim = gpu_dimension("H100")
    nodes = [make_node("n1", cards=1)]
    v = run_on(nodes, "v", req(), priority=5, project="pv")
    snap = Snapshot(
        nodes=nodes, running=[v],
        projects={"pv": QuotaAccount("pv", {dim: Allowance(1, 1)}, {dim: 1})},
        pending=[pending("hi", priority=500), pending("again", project="pv", priority=1)],
    )
    r = run_cycle(snap)
    assert [p.victim_id for p in r.preempted] == ["v"]
    # pv is back to 0 of 1, so its other job waits for capacity, not quota.
    assert waits(r)["again"].reason is not WaitReason.QUOTA


def test_preemption_frees_a_mig_slice():
    mig = {}
    nodes = [make_node("m1", cards=1, mig=True)]
    small = run_on(nodes, "small", req(mig="1g.10gb"), priority=5, mig=mig)
    snap = Snapshot(nodes=nodes, running=[small], mig=mig,
                    pending=[pending("whole", req(mig="7g.80gb"), priority=500)])
    r = run_cycle(snap)
    assert [p.victim_id for p in r.preempted] == ["small"]
    p = admitted(r)["whole"].placements[0]
    assert (p.mig_profile, p.mig_slot) == ("7g.80gb", 0)


def test_multi_replica_job_preempts_only_what_all_replicas_need():
    nodes = [make_node("n1", cards=4), make_node("n2", cards=4), make_node("n3", cards=4)]
    a = run_on(nodes[:1], "a", req(gpus=4), priority=5, borrowed=True)
    b = run_on(nodes[1:2], "b", req(gpus=4), priority=5)
    c = run_on(nodes[2:], "c", req(gpus=2), priority=5)
    snap = Snapshot(nodes=nodes, running=[a, b, c],
                    pending=[pending("pair", req(gpus=4), replicas=2, priority=500)])
    r = run_cycle(snap)
    victims = {p.victim_id for p in r.preempted}
    assert "a" in victims and len(victims) == 2  # borrowed first, then one more node
    assert len(admitted(r)["pair"].placements) == 2


def test_victim_on_a_card_that_became_unhealthy_gives_back_only_healthy_capacity():
    nodes = [make_node("n1", cards=2)]
    v = run_on(nodes, "v", req(gpus=2), priority=5)
    nodes[0].gpus = [g for g in nodes[0].gpus if g.index == 0]  # card 1 quarantined since
    fleet = [FleetNode("n1", 128_000, 1_048_576,
                       [FleetCard(0, "H100"), FleetCard(1, "H100", healthy=False)])]
    snap = Snapshot(nodes=nodes, running=[v], fleet=fleet,
                    pending=[pending("j", req(gpus=1), priority=500)])
    r = run_cycle(snap)
    assert [p.victim_id for p in r.preempted] == ["v"]
    assert admitted(r)["j"].placements[0].gpus == (0,)


# ---------------------------------------------------------------- replicas, MIG


def test_multi_replica_job_is_all_or_nothing():
    nodes = [make_node("n1"), make_node("n2"), make_node("n3")]
    run_on(nodes[2:], "busy", req(gpus=8), priority=1000, preemptible=False)
    snap = Snapshot(nodes=nodes, pending=[pending("three", req(gpus=8), replicas=3,
                                                  priority=500),
                                          pending("two", req(gpus=8), replicas=2)])
    r = run_cycle(snap)
    assert "three" not in admitted(r)
    two = admitted(r)["two"]
    assert sorted(p.node for p in two.placements) == ["n1", "n2"]
    assert waits(r)["three"].reason is WaitReason.CAPACITY
    assert "all 3 replicas" in waits(r)["three"].message


def test_mig_profiles_have_the_real_start_slots():
    t = PROFILES_80GB
    assert t["3g.40gb"].starts == (0, 4) and t["4g.40gb"].starts == (0,)
    assert t["7g.80gb"].starts == (0,) and t["2g.20gb"].starts == (0, 2, 4)
    assert t["1g.10gb"].starts == tuple(range(7))
    assert legal_layout("H100", [("4g.40gb", 0), ("3g.40gb", 4)])
    assert legal_layout("A100-80G", [("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)])
    assert not legal_layout("H100", [("3g.40gb", 2)])  # illegal start
    assert not legal_layout("H100", [("4g.40gb", 0), ("3g.40gb", 0)])  # overlap
    assert not legal_layout("H100", [("2g.20gb", 4), ("3g.40gb", 4)])
    assert profiles_for("L4") is None and profiles_for("A100-40GB")["3g.20gb"].compute == 3


def test_mig_best_fit_keeps_big_slots_free():
    n = make_node("m1", cards=2, model="H100", mig=True)
    board = MigBoard([n], {("m1", 0): [("3g.40gb", 0)]})
    p = board.choose(req(mig="1g.10gb"))
    # The partly used card, at the slot that still leaves a 2g at 4: card 1 keeps a 7g.
    assert p.gpus == (0,) and p.mig_slot == 6
    p = board.choose(req(mig="4g.40gb"))
    assert p.gpus == (1,) and p.mig_slot == 0


def test_unknown_mig_layout_is_treated_as_full():
    card = MigCard(Gpu(0, "H100", mig=True), [("3g.40gb", 1)])
    assert card.used == layout_mask("H100", [("7g.80gb", 0)])


def test_cycle_places_mig_slices_in_legal_non_overlapping_slots():
    nodes = [make_node("m1", cards=2, mig=True)]
    jobs = [pending(f"s{i}", req(mig=prof), submitted=i)
            for i, prof in enumerate(["3g.40gb", "1g.10gb", "2g.20gb", "4g.40gb", "3g.40gb",
                                      "1g.10gb", "1g.10gb", "7g.80gb"])]
    r = run_cycle(Snapshot(nodes=nodes, pending=jobs, model_memory_gib=MEM))
    layout = defaultdict(list)
    for a in r.admitted:
        p = a.placements[0]
        layout[p.gpus[0]].append((p.mig_profile, p.mig_slot))
    assert all(legal_layout("H100", sl) for sl in layout.values())
    # 3+1+2+4+3+1 compute slices fill both cards exactly; best fit leaves no hole behind.
    assert len(r.admitted) == 6
    # Both would have fit the empty cards: the jobs ahead took the room.
    assert waits(r)["s6"].reason is WaitReason.PRIORITY
    assert waits(r)["s7"].reason is WaitReason.PRIORITY
    nodes[0].gpus[1].mig = False  # one MIG card left, already holding a slice
    snap = Snapshot(nodes=nodes, pending=[pending("big", req(mig="7g.80gb"))],
                    mig={("m1", 0): [("1g.10gb", 6)]})
    w = waits(run_cycle(snap))["big"]
    assert w.reason is WaitReason.CAPACITY and "free 7g.80gb MIG slot" in w.message


def test_mig_slice_counts_as_a_fraction_of_a_card_in_quota():
    need = demand(req(mig="3g.40gb"), ["H100"], MEM)
    assert need[gpu_dimension("H100")] == pytest.approx(3 / 7)
    assert need["gpu_memory_gib"] == 40


def test_snapshot_is_not_changed():
    nodes = [make_node("n1", cards=2)]
    v = run_on(nodes, "v", req(), priority=5)
    snap = Snapshot(nodes=nodes, running=[v], pending=[pending("a"), pending("b", priority=500),
                                                       pending("c", req(gpus=2))])
    before = copy.deepcopy(snap)
    run_cycle(snap)
    assert snap == before


# ---------------------------------------------------------------- properties

MODELS = ("H100", "L4")


@st.composite
def scenarios(draw):
    fleet, nodes, mig = [], [], {}
    for n in range(draw(st.integers(1, 5))):
        name = f"n{n}"
        model = draw(st.sampled_from(MODELS))
        ncards = draw(st.sampled_from((1, 2, 4, 8)))
        domains = draw(st.sampled_from((1, 2))) if ncards >= 2 else 1
        is_mig = n == 1 and draw(st.booleans())
        model = "H100" if is_mig else model
        schedulable = draw(st.booleans()) or n == 0
        cards = [FleetCard(i, model, draw(st.booleans()) or i == 0, i * domains // ncards,
                           is_mig, f"{name}-{i}") for i in range(ncards)]
        fleet.append(FleetNode(name, 64_000, 262_144, cards, schedulable))
        if schedulable:
            nodes.append(Node(name, 64_000, 262_144, [
                Gpu(c.index, c.model, MILLI, c.domain, c.uid, c.mig) for c in cards if c.healthy
            ]))

    def a_request():
        models = frozenset({draw(st.sampled_from(MODELS))}) if draw(st.booleans()) else None
        kind = draw(st.sampled_from(("whole", "whole", "whole", "share", "share", "mig", "cpu")))
        cpu = draw(st.sampled_from((1000, 4000, 8000, 32000)))
        if kind == "mig":
            return Request(cpu, 8192, 1, MILLI, H100, draw(st.sampled_from(sorted(PROFILES_80GB))))
        if kind == "share":
            return Request(cpu, 8192, 1, draw(st.sampled_from((250, 500, 700))), models)
        if kind == "cpu":
            return Request(cpu, 8192, 0, MILLI, None)
        return Request(cpu, 8192, draw(st.sampled_from((1, 2, 4, 8))), MILLI, models)

    tenants = ("ta", "tb")
    projects = {"pa": "ta", "pb": "ta", "pc": "tb"}
    running = []
    for i in range(draw(st.integers(0, 10))):
        r = a_request()
        project = draw(st.sampled_from(sorted(projects)))
        try:
            job = run_on(nodes, f"r{i}", r, tenant=projects[project], project=project,
                         priority=draw(st.sampled_from((10, 100, 1000))),
                         preemptible=draw(st.booleans()), borrowed=draw(st.booleans()),
                         started=i, mig=mig)
        except (AttributeError, TypeError):
            continue  # did not fit: the scenario simply has fewer running jobs
        running.append(job)
    pend = []
    for i in range(draw(st.integers(0, 14))):
        project = draw(st.sampled_from(sorted(projects)))
        pend.append(PendingJob(
            f"j{i}", projects[project], project, a_request(),
            priority=draw(st.sampled_from((10, 100, 1000))),
            submitted=draw(st.integers(0, 5)), replicas=draw(st.sampled_from((1, 1, 2))),
            card_hours=draw(st.sampled_from((None, 1.0, 10.0))),
            budget_blocked=draw(st.integers(0, 9)) == 0,
        ))

    def account(name):
        limits = {}
        if draw(st.booleans()):
            return QuotaAccount(name, limits, {})
        for dim in (gpu_dimension("H100"), gpu_dimension("L4"), "cpu_milli", "jobs",
                    "card_hours_month", "gpu_memory_gib"):
            if draw(st.booleans()):
                g = draw(st.sampled_from((0.0, 1.0, 2.0, 4.0)))
                lim = draw(st.sampled_from((None, 1.0, 3.0, 8.0, 64_000.0)))
                limits[dim] = Allowance(g, lim if lim is None else max(lim, g))
        return QuotaAccount(name, limits, {})

    snap = Snapshot(nodes=nodes, pending=pend, running=running, fleet=fleet, mig=mig,
                    tenants={t: account(t) for t in tenants},
                    projects={p: account(p) for p in projects}, model_memory_gib=MEM)
    # Usage the way the portal reports it: what the running jobs hold.
    for job in running:
        models = [next(c.model for fn in fleet if fn.name == p.node for c in fn.cards
                       if p.gpus and c.index == p.gpus[0]) if p.gpus else None
                  for p in job.placements]
        need = demand(job.request, models, MEM)
        for acc in (snap.projects[job.project], snap.tenants[job.tenant]):
            for k, v in need.items():
                acc.usage[k] = acc.usage.get(k, 0.0) + v
    return snap


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from(("fgd", "best-fit", "random")))
def test_cycle_invariants(snap, policy):
    before = copy.deepcopy(snap)
    r = run_cycle(snap, policy=policy)
    assert snap == before
    again = run_cycle(snap, policy=policy)  # a pure function: same snapshot, same decisions
    assert (again.admitted, again.preempted, again.waiting) == (r.admitted, r.preempted,
                                                                r.waiting)
    running = {j.id: j for j in snap.running}
    pend = {j.id: j for j in snap.pending}
    event(f"preempted: {bool(r.preempted)}")
    event(f"admitted mig: {any(p.mig_profile for a in r.admitted for p in a.placements)}")
    for w in r.waiting:
        event(f"reason: {w.reason.value}")

    # Every pending job is decided exactly once; positions are 1..k in order.
    decided = [a.job_id for a in r.admitted] + [w.job_id for w in r.waiting]
    assert sorted(decided) == sorted(pend)
    assert [w.position for w in r.waiting] == list(range(1, len(r.waiting) + 1))

    # Preemption: only preemptible, strictly lower priority than the job that took the room.
    victims = {p.victim_id for p in r.preempted}
    for p in r.preempted:
        v = running[p.victim_id]
        assert v.preemptible
        assert v.priority < pend[p.by_job_id].priority
        assert p.by_job_id in {a.job_id for a in r.admitted}

    # No card, CPU or memory over-committed; no unhealthy card used; MIG layouts legal.
    healthy = {(n.name, g.index) for n in snap.nodes for g in n.gpus}
    mig_cards = {(n.name, g.index) for n in snap.nodes for g in n.gpus if g.mig}
    used = defaultdict(int)
    cpu = defaultdict(int)
    layouts = defaultdict(list)
    node_cap = {n.name: n.cpu_milli for n in snap.nodes}
    holders = [(j.request, j.placements, False) for j in snap.running if j.id not in victims]
    for a in r.admitted:
        request = pend[a.job_id].request
        assert len(a.placements) == pend[a.job_id].replicas
        holders.append((request, [Placement(p.node, p.gpus, p.milli, p.mig_slot)
                                  for p in a.placements], True))
        for p in a.placements:
            for i in p.gpus:
                assert (p.node, i) in healthy
    for request, placements, _new in holders:
        for p in placements:
            cpu[p.node] += request.cpu_milli
            for i in p.gpus:
                if (p.node, i) in mig_cards:
                    layouts[(p.node, i)].append((request.mig_profile, p.mig_slot))
                else:
                    used[(p.node, i)] += p.milli
    assert all(v <= MILLI for v in used.values())
    assert all(cpu[n] <= node_cap[n] for n in cpu if n in node_cap)
    assert all(legal_layout("H100", sl) for sl in layouts.values())

    # No hard limit exceeded after the cycle (beyond what was already in use before it).
    card_model = {(fn.name, c.index): c.model for fn in snap.fleet for c in fn.cards}
    accounts = {("project", k): v for k, v in snap.projects.items()}
    accounts.update({("tenant", k): v for k, v in snap.tenants.items()})
    final = {k: dict(acc.usage) for k, acc in accounts.items()}

    def add(job, placements, sign, card_hours=None):
        models = [card_model[(p.node, p.gpus[0])] if p.gpus else None for p in placements]
        need = demand(job.request, models, MEM, card_hours)
        if sign < 0:
            need.pop("card_hours_month", None)
        for key in (("project", job.project), ("tenant", job.tenant)):
            for k, v in need.items():
                final[key][k] = final[key].get(k, 0.0) + sign * v

    for a in r.admitted:
        add(pend[a.job_id], a.placements, 1, pend[a.job_id].card_hours)
    for v in victims:
        add(running[v], running[v].placements, -1)
    for key, acc in accounts.items():
        for dim, allowance in acc.limits.items():
            if allowance.limit is None:
                continue
            start = acc.usage.get(dim, 0.0)
            assert final[key].get(dim, 0.0) <= max(allowance.limit, start) + 1e-6, (key, dim)

    # A job is never admitted when it is budget-blocked.
    assert not any(pend[a.job_id].budget_blocked for a in r.admitted)

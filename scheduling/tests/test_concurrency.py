"""Acceptance: the scheduler's invariants hold under real concurrency on PostgreSQL.

32 threads submit 500 jobs (whole cards, fractional shares and MIG slices, three priority
classes) against a small quota while two cycle runners race. Afterwards no quota limit is
exceeded, no card is over-committed, and every job's state agrees with its bindings. The
same scenario with the cycle lock switched off (settings.ATRIUM_CYCLE_LOCK=False, a setting
only this module uses) must detect over-admission: that is what shows the check can fail.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from decimal import Decimal

import pytest
from django.db import connection, connections

from scheduling import services
from scheduling.cycle import run_cycle
from scheduling.engine.mig import COMPUTE_SLICES, profile
from scheduling.models import ACTIVE_STATES, Binding, Job, JobEvent, JobState, Quota, ShareMode

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]



@pytest.fixture(autouse=True)
def fast_passwords(settings):
    """The org fixture makes a dozen users: the default password hasher would dominate."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

@pytest.fixture
def race_org(org):
    """The org fleet plus one MIG-mode H100 card, and specs of every share mode."""
    if connection.vendor != "postgresql":
        pytest.skip("the concurrency acceptance test runs on PostgreSQL")
    mig_pool = services.create_pool(org.admin, name="mig", mig_enabled=True)
    services.register_node(org.ops, pool=mig_pool, name="m-0", cpu_milli=64_000, memory_mib=512 * 1024,
                           model=org.models["h100"], cards=1)
    for name, prof in (("h100 mig-3g.40gb", "3g.40gb"), ("h100 mig-1g.10gb", "1g.10gb")):
        org.specs[prof] = services.create_spec(org.admin, name=name, models=[org.models["h100"]], mode="mig",
                                               mig_profile=prof, cpu_milli=2_000, memory_mib=8 * 1024)
    return org


def job_plan(org, n: int, seed: int) -> list[dict]:
    """n submissions: who, which spec, which class; mixed so that policy order differs from
    arrival order (a later, higher-priority job jumps the queue)."""
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        slug = rng.choice(("alpha", "beta"))
        spec = rng.choices(["h1", "l4half", "3g.40gb", "1g.10gb", "h4"], [5, 3, 2, 2, 1])[0]
        prio = rng.choice(("batch", "training", "production" if slug == "beta" else "batch"))
        plan.append({"user": org.people[slug]["user"], "project": org.projects[slug], "spec": org.specs[spec],
                     "priority_class": org.prio[prio], "name": f"race-{seed}-{i}"})
    return plan


def race(plan: list[dict], *, submitters: int = 32, runners: int = 2) -> dict:
    """Submit the plan from `submitters` threads while `runners` threads run cycles in loops."""
    todo = list(reversed(plan))
    take = threading.Lock()
    submitting = threading.Event()
    submitting.set()
    errors: list[str] = []
    admitted_on_submit: list[int] = []
    cycles = [0] * runners
    cycle_errors = [0] * runners
    kinds: set[str] = set()

    def submit():
        try:
            while True:
                with take:
                    if not todo:
                        return
                    item = todo.pop()
                fields = dict(item)
                job = services.submit_job(fields.pop("user"), image="img:1", command=["python", "x.py"], **fields)
                if job.state != JobState.PENDING or job.admitted is not None:
                    admitted_on_submit.append(job.pk)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(f"submit: {exc!r}")
        finally:
            connections.close_all()

    def cycle_loop(k: int):
        try:
            extra = 3  # a few cycles after the last submission, so everything is decided
            while submitting.is_set() or extra > 0:
                if not submitting.is_set():
                    extra -= 1
                try:
                    run_cycle()
                    cycles[k] += 1
                except Exception as exc:  # noqa: BLE001 - without the lock a deadlock abort is possible
                    cycle_errors[k] += 1
                    kinds.add(type(exc).__name__)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"cycle: {exc!r}")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=submit) for _ in range(submitters)]
    loops = [threading.Thread(target=cycle_loop, args=(k,)) for k in range(runners)]
    t0 = time.monotonic()
    for t in loops + threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    submitting.clear()
    for t in loops:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads + loops), "a thread hung"
    return {"errors": errors, "admitted_on_submit": admitted_on_submit, "cycles": cycles,
            "cycle_errors": cycle_errors, "cycle_error_kinds": kinds, "seconds": time.monotonic() - t0}


def card_amount(b: Binding) -> Decimal:
    """Cards of its model one binding counts against a GPU quota (as scheduling does)."""
    if b.mig_profile:
        p = profile(b.accelerator.model.name, b.mig_profile)
        return Decimal(p.compute) / COMPUTE_SLICES
    return Decimal(b.share_milli) / 1000


def invariant_violations() -> list[str]:
    """Everything wrong with the database right now (an empty list when the invariants hold)."""
    out: list[str] = []
    open_bindings = list(Binding.objects.filter(end__isnull=True).select_related("accelerator__model", "job"))
    by_job: dict[int, list[Binding]] = defaultdict(list)
    by_card: dict[int, list[Binding]] = defaultdict(list)
    for b in open_bindings:
        by_job[b.job_id].append(b)
        by_card[b.accelerator_id].append(b)

    # every job is in exactly one known state and its binding set agrees with it
    for job in Job.objects.select_related("spec"):
        held = by_job.get(job.pk, [])
        if job.state not in JobState.values:
            out.append(f"job {job.pk} in unknown state {job.state!r}")
        if job.state in ACTIVE_STATES:
            per_replica = job.spec.gpu_count if job.spec.mode == ShareMode.WHOLE else 1
            if len(held) != per_replica * job.replicas:
                out.append(f"job {job.pk} {job.state} holds {len(held)} bindings, expected {per_replica * job.replicas}")
            if job.admitted is None:
                out.append(f"job {job.pk} {job.state} without an admission time")
        else:
            if held:
                out.append(f"job {job.pk} {job.state} still holds {len(held)} open bindings")
            if job.state == JobState.PENDING and job.admitted is not None:
                out.append(f"job {job.pk} pending with an admission time")

    # no card is over-committed: shares sum to one card at most, MIG slices legal and disjoint
    for card_id, bs in by_card.items():
        card = bs[0].accelerator
        mig = [b for b in bs if b.mig_profile]
        plain = [b for b in bs if not b.mig_profile]
        if mig and plain:
            out.append(f"card {card_id} holds MIG slices and plain shares at once")
        if sum(b.share_milli for b in plain) > 1000:
            out.append(f"card {card_id} over-committed: {sum(b.share_milli for b in plain)}/1000 "
                       f"by jobs {sorted(b.job_id for b in plain)}")
        used = 0
        for b in mig:
            p = profile(card.model.name, b.mig_profile)
            if not card.mig_enabled or p is None or b.mig_slot not in p.starts:
                out.append(f"card {card_id}: illegal MIG slice {b.mig_profile}@{b.mig_slot}")
                continue
            if used & p.mask(b.mig_slot):
                out.append(f"card {card_id}: MIG slice {b.mig_profile}@{b.mig_slot} overlaps another")
            used |= p.mask(b.mig_slot)

    # no quota limit is exceeded, per project and per tenant, per accelerator model
    per_project: dict[tuple[int, int], Decimal] = defaultdict(Decimal)
    per_tenant: dict[tuple[int, int], Decimal] = defaultdict(Decimal)
    for b in open_bindings:
        if b.job.state in ACTIVE_STATES:
            per_project[(b.project_id, b.accelerator.model_id)] += card_amount(b)
            per_tenant[(b.tenant_id, b.accelerator.model_id)] += card_amount(b)
    for q in Quota.objects.filter(resource="gpus"):
        used = (per_tenant[(q.tenant_id, q.accelerator_model_id)] if q.project_id is None
                else per_project[(q.project_id, q.accelerator_model_id)])
        if used > q.limit + Decimal("0.0001"):
            out.append(f"quota exceeded: {q} has {used:.3f} in use")
    return out


def test_invariants_hold_with_32_submitters_and_two_racing_cycle_runners(race_org, settings):
    assert settings.ATRIUM_CYCLE_LOCK is True
    plan = job_plan(race_org, 500, seed=4)
    result = race(plan, submitters=32, runners=2)

    assert result["errors"] == []
    assert result["cycle_errors"] == [0, 0]
    assert min(result["cycles"]) >= 3, result["cycles"]  # both runners really raced
    # submission never admits: every job came back from submit_job pending
    assert result["admitted_on_submit"] == []
    assert Job.objects.count() == 500
    assert invariant_violations() == []
    # the quota was the binding constraint (the race mattered) and decisions were made
    active = Job.objects.filter(state__in=ACTIVE_STATES)
    assert active.exists()
    assert Job.objects.filter(state=JobState.PENDING, wait_reason="quota").exists()
    # no job was admitted before its submission was recorded
    for job in active:
        kinds = list(JobEvent.objects.filter(job=job).values_list("kind", flat=True))
        assert kinds[0] == "submitted" and "admitted" in kinds


def test_without_the_cycle_lock_the_same_check_detects_over_admission(race_org, settings, capsys):
    """Shows the acceptance test can fail: with the lock off, two runners decide on the same
    snapshot and together admit past a limit or onto the same card. Each round is the same
    race on a fresh queue; the bound keeps the test finite, and the rounds it took are printed."""
    settings.ATRIUM_CYCLE_LOCK = False
    found: list[str] = []
    rounds = 0
    aborted: list = []
    for rounds in range(1, 13):  # noqa: B007 - reported below
        result = race(job_plan(race_org, 60, seed=100 + rounds), submitters=32, runners=4)
        assert result["errors"] == []
        aborted.append((sum(result["cycle_errors"]), sorted(result["cycle_error_kinds"])))
        found = invariant_violations()
        if found:
            break
        for job in Job.objects.exclude(state__in=[JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED]):
            services.cancel_job(race_org.admin, job, reason="next round")
    with capsys.disabled():
        print(f"\n[no-lock] violation detected in round {rounds}: {found[:3]}; aborted cycles per round: {aborted}")
    assert found, "with the cycle lock off, 12 rounds of racing runners never over-admitted"
    assert any("quota exceeded" in v or "over-committed" in v or "overlaps" in v for v in found)

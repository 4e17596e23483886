"""The simulated cluster failing the way a real cluster API fails, as scheduling/tests/
test_kubernetes.py does for the Kubernetes backend (API 500 half-way, timeouts): errors on
starting or stopping one job, and a timeout half-way through a tick.

What must hold: every job is in the state it really is in (a job the cluster refused to start
is still admitted, not running; one it could not stop is still running, not finished), the
scheduler does not bind an admitted job a second time meanwhile, the next tick converges, and
no job is ever started twice (one "running" event, one start time, the same bindings), so
metering counts its card time once, to the exact end.
"""

from __future__ import annotations

import datetime as dt

import pytest

from scheduling import cycle, services
from scheduling.backends import get_backend
from scheduling.backends.simulated import ClusterTimeout, SimulatedCluster
from scheduling.models import Binding, BindingEnd, Job, JobEvent, JobState

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 3, 2, 9, 0, tzinfo=dt.UTC)


@pytest.fixture
def cluster():
    backend = SimulatedCluster()
    yield backend
    backend.clear_backend_faults()


def admitted(org, n: int = 3, minutes: int = 60) -> list[Job]:
    jobs = [
        services.submit_job(org.people[slug]["user"], project=org.projects[slug], spec=org.specs["h1"],
                            priority_class=org.prio["batch"], name=f"{slug}-{i}", image="img:1", command=["run"],
                            expected_minutes=minutes, submitted=T0)
        for i, slug in enumerate(["alpha", "beta", "alpha", "beta"][:n])
    ]
    cycle.run_cycle(now=T0)
    for job in jobs:
        job.refresh_from_db()
        assert job.state == JobState.ADMITTED
    return jobs


def bindings_of(jobs) -> dict[int, list[tuple]]:
    return {j.pk: list(Binding.objects.filter(job=j).order_by("pk").values_list("pk", "accelerator_id", "start", "end"))
            for j in jobs}


def starts(job: Job) -> int:
    return JobEvent.objects.filter(job=job, kind="running").count()


def test_the_configured_backend_is_the_simulated_one_with_fault_injection():
    assert isinstance(get_backend(), SimulatedCluster)
    with pytest.raises(ValueError):
        SimulatedCluster().inject_backend_fault(kind="meltdown")


def test_an_error_starting_one_job_leaves_it_admitted_and_the_next_tick_starts_it_once(org, cluster):
    first, second, third = admitted(org)
    placed = bindings_of([first, second, third])
    cluster.inject_backend_fault(kind="error", operation="start", job=second, times=2)

    for minute in (1, 2):
        result = cluster.tick(T0 + dt.timedelta(minutes=minute))
        assert result["errors"] == [f"the simulated cluster refused to start job {second.pk}"]
        second.refresh_from_db()
        assert second.state == JobState.ADMITTED and second.started is None and starts(second) == 0
        # the scheduler meanwhile leaves it alone: no second binding for an admitted job
        cycle.run_cycle(now=T0 + dt.timedelta(minutes=minute))
        assert bindings_of([first, second, third]) == placed

    result = cluster.tick(T0 + dt.timedelta(minutes=3))
    assert result == {**result, "started": [second.pk], "errors": []}
    for job in (first, second, third):
        job.refresh_from_db()
        assert job.state == JobState.RUNNING and starts(job) == 1
    assert cluster.tick(T0 + dt.timedelta(minutes=4))["started"] == []
    assert bindings_of([first, second, third]) == placed


def test_a_timeout_half_way_through_a_tick_keeps_nothing_of_it_then_each_job_starts_once(org, cluster):
    jobs = admitted(org)
    placed = bindings_of(jobs)
    # the cluster stops answering at the third start: the two started before are not kept either
    cluster.inject_backend_fault(kind="timeout", operation="start", job=jobs[2])
    with pytest.raises(ClusterTimeout):
        cluster.tick(T0 + dt.timedelta(minutes=1))
    for job in jobs:
        job.refresh_from_db()
        assert job.state == JobState.ADMITTED and job.started is None and starts(job) == 0
    cycle.run_cycle(now=T0 + dt.timedelta(minutes=1))
    assert bindings_of(jobs) == placed

    result = cluster.tick(T0 + dt.timedelta(minutes=2))
    assert sorted(result["started"]) == sorted(j.pk for j in jobs) and result["errors"] == []
    assert cluster.tick(T0 + dt.timedelta(minutes=3))["started"] == []
    for job in jobs:
        job.refresh_from_db()
        assert job.state == JobState.RUNNING and starts(job) == 1
    assert bindings_of(jobs) == placed


def test_an_error_stopping_a_job_keeps_it_running_then_ends_it_at_its_exact_end(org, cluster):
    jobs = admitted(org, n=2, minutes=30)
    cluster.tick(T0)
    done_at = T0 + dt.timedelta(minutes=30)
    cluster.inject_backend_fault(kind="error", operation="stop", job=jobs[0])
    result = cluster.tick(done_at + dt.timedelta(minutes=5))
    assert result["finished"] == [jobs[1].pk] and result["errors"] == [
        f"the simulated cluster refused to stop job {jobs[0].pk}"]
    jobs[0].refresh_from_db()
    assert jobs[0].state == JobState.RUNNING and Binding.objects.get(job=jobs[0]).end is None

    assert cluster.tick(done_at + dt.timedelta(minutes=9))["finished"] == [jobs[0].pk]
    for job in jobs:
        job.refresh_from_db()
        binding = Binding.objects.get(job=job)
        # ended when it really ended, not when the cluster finally answered: card time counted once, exactly
        assert job.state == JobState.SUCCEEDED and job.finished == done_at
        assert (binding.start, binding.end, binding.end_reason) == (T0, done_at, BindingEnd.COMPLETED)
        assert JobEvent.objects.filter(job=job, kind=JobState.SUCCEEDED).count() == 1


def test_a_timeout_while_stopping_keeps_every_job_as_it_was(org, cluster):
    jobs = admitted(org, n=2, minutes=30)
    cluster.tick(T0)
    cluster.inject_backend_fault(kind="timeout", operation="stop")
    with pytest.raises(ClusterTimeout):
        cluster.tick(T0 + dt.timedelta(hours=1))
    for job in jobs:
        job.refresh_from_db()
        assert job.state == JobState.RUNNING and Binding.objects.get(job=job).end is None
    assert sorted(cluster.tick(T0 + dt.timedelta(hours=1))["finished"]) == sorted(j.pk for j in jobs)
    assert {Binding.objects.get(job=j).end for j in jobs} == {T0 + dt.timedelta(minutes=30)}


def test_the_rq_tick_fails_loudly_on_a_timeout_and_the_next_one_converges(org, cluster):
    from scheduling import jobs as scheduling_jobs

    jobs = admitted(org, n=2)
    cluster.inject_backend_fault(kind="timeout", operation="start")
    with pytest.raises(ClusterTimeout):
        scheduling_jobs.tick_cluster()  # the RQ job fails (and is logged); the loop enqueues the next
    assert not Job.objects.filter(state=JobState.RUNNING).exists()
    assert sorted(scheduling_jobs.tick_cluster()["started"]) == sorted(j.pk for j in jobs)
    assert all(starts(j) == 1 for j in jobs)

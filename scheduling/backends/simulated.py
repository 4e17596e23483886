"""The simulated cluster: runs admitted jobs for their declared time on a simulated clock.

It is the embedded default and what the demo runs on. `tick(now)` starts admitted jobs and
finishes those whose declared run time (or time limit) has passed, ending their bindings at
the exact simulated instant; `inject_fault` feeds a health event through the same health
policy a real backend uses. On every tick it also reports what each share of a shared card
used (by default exactly its share; `set_utilisation` or `inject_fault(kind="interference")`
makes a job greedy) and runs the interference check on those samples. It never admits or
places anything: that is the cycle's job.

`inject_backend_fault` makes it fail the way a real cluster API fails, for the tests and the
demo: an *error* refuses one job's start or stop (reported in the tick's `errors`, tried again
on the next tick), a *timeout* gives up half-way through a tick (the whole tick is one
transaction, so nothing it did is kept). Either way every job stays in the state it really is
in, and a job is started once however often a tick fails.
"""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.db.models import OuterRef, Subquery
from django.utils import timezone

from portal import audit, context
from scheduling import services
from scheduling.models import Binding, BindingEnd, Job, JobEvent, JobState, UtilisationSample

INTERFERENCE = "interference"
BACKEND_FAULTS = ("error", "timeout")


class ClusterError(Exception):
    """The simulated cluster refused an operation on one job (an injected error)."""


class ClusterTimeout(Exception):
    """The simulated cluster stopped answering in the middle of a tick (an injected timeout)."""


# Failures injected with inject_backend_fault, in this process, used up in order:
# [kind, operation ("start" or "stop"), job id or None for any job, times left]
_faults: list[list] = []


class SimulatedCluster:
    name = "simulated"

    def inject_backend_fault(self, *, kind: str, operation: str = "start", job: Job | None = None,
                             times: int = 1) -> None:
        """The next `times` starts (or stops) of `job` (or of any job) fail with `kind`."""
        if kind not in BACKEND_FAULTS or operation not in ("start", "stop") or times < 1:
            raise ValueError(f"no such backend fault: {kind} on {operation} x{times}")
        _faults.append([kind, operation, job.pk if job else None, times])

    def clear_backend_faults(self) -> None:
        _faults.clear()

    def _call(self, operation: str, job: Job) -> None:
        """The cluster API call that carries `operation` out for `job` (here: only its failures)."""
        for fault in _faults:
            kind, op, job_id, _ = fault
            if op == operation and job_id in (None, job.pk):
                fault[3] -= 1
                if not fault[3]:
                    _faults.remove(fault)
                if kind == "error":
                    raise ClusterError(f"the simulated cluster refused to {operation} job {job.pk}")
                raise ClusterTimeout(f"the simulated cluster did not answer while {operation}ing job {job.pk}")

    def tick(self, now: dt.datetime | None = None) -> dict:
        now = now or timezone.now()
        started, finished, errors = [], [], []
        # what is there to do, read without locks: the admitted jobs and the running jobs whose
        # time is up. Most ticks find nothing and take no lock at all.
        admitted = list(Job.objects.filter(state=JobState.ADMITTED).values_list("pk", flat=True))
        due = [pk for pk, began, expected, limit in Job.objects.filter(state=JobState.RUNNING)
               .values_list("pk", "started", "expected_minutes", "time_limit_minutes")
               if began is not None and began + dt.timedelta(minutes=min(expected, limit)) <= now]
        if admitted or due:
            self._apply_tick(admitted, due, now, started, finished, errors)
        if finished:
            services.enqueue_cycle_after_commit()
        # after the state changes are committed: a failing check must not undo finished jobs
        with context.bound(actor_label="service:simulated-cluster"):
            self.sample_utilisation(now)
            interference = services.check_interference(now)
        return {"started": started, "finished": finished, "interference": [h["job"] for h in interference],
                "errors": errors}

    def _apply_tick(self, admitted: list[int], due: list[int], now, started: list, finished: list,
                    errors: list) -> None:
        locked = Job.objects.select_for_update(of=("self",), no_key=True).order_by("pk")
        with context.bound(actor_label="service:simulated-cluster"), transaction.atomic():
            # the audit chain's lock first (a timeout is audited), then only these job rows in id
            # order, as the cycle does, so a tick and a cycle (or a cancel) never wait in a circle;
            # the state filters re-check what changed since the unlocked read
            audit.lock_chain()
            for job in locked.filter(pk__in=admitted, state=JobState.ADMITTED):
                try:
                    self._call("start", job)
                except ClusterError as exc:
                    errors.append(str(exc))  # still admitted: started on a later tick
                    continue
                job.state = JobState.RUNNING
                job.started = job.admitted or now
                job.save(update_fields=["state", "started"])
                JobEvent.objects.create(job=job, time=job.started, kind="running",
                                        message="Containers started on the simulated cluster.")
                started.append(job.pk)
            for job in locked.filter(pk__in=due, state=JobState.RUNNING).select_related("project__tenant"):
                run_for = min(job.expected_minutes, job.time_limit_minutes)
                end = job.started + dt.timedelta(minutes=run_for)
                if end > now:
                    continue
                try:
                    self._call("stop", job)
                except ClusterError as exc:
                    errors.append(str(exc))  # still running as far as anyone knows: ended on a later tick
                    continue
                timed_out = job.expected_minutes > job.time_limit_minutes
                job.state = JobState.FAILED if timed_out else JobState.SUCCEEDED
                job.finished = end
                job.save(update_fields=["state", "finished"])
                Binding.objects.filter(job=job, end__isnull=True).update(
                    end=end, end_reason=BindingEnd.FAILED if timed_out else BindingEnd.COMPLETED
                )
                JobEvent.objects.create(
                    job=job, time=end, kind=job.state,
                    message="Stopped at its time limit." if timed_out else "Finished successfully.",
                )
                if timed_out:
                    audit.record("job.timeout", target=job, project=job.project,
                                 reason=f"time limit of {job.time_limit_minutes} minutes reached")
                finished.append(job.pk)

    def sample_utilisation(self, now: dt.datetime) -> int:
        """Report one sample per running share of a shared card, as a DCGM scrape would.

        A simulated job keeps using what it last reported (its share until someone makes it
        greedy), so the setting survives across processes: it lives in the samples themselves.
        """
        last = UtilisationSample.objects.filter(binding=OuterRef("pk")).order_by("-time", "-id").values("used_milli")[:1]
        rows = (services.open_shared_bindings().filter(job__state=JobState.RUNNING, start__lte=now)
                .annotate(last_used=Subquery(last)).values_list("pk", "share_milli", "last_used"))
        readings = [(pk, share if used is None else used) for pk, share, used in rows]
        return services.record_utilisation(readings, now=now) if readings else 0

    def set_utilisation(self, job: Job, fraction: float, *, now: dt.datetime | None = None) -> int:
        """From `now` on, `job` uses `fraction` of the whole card (0..1) on each of its shares.

        Returns the number of shares changed (0 for a job holding no share of a shared card).
        """
        now = now or timezone.now()
        ids = list(services.open_shared_bindings().filter(job=job).values_list("pk", flat=True))
        return services.record_utilisation([(pk, round(fraction * 1000)) for pk in ids], now=now, replace=True) if ids else 0

    def inject_fault(self, card, *, kind: str, code: int | None = None, message: str = "",
                     now: dt.datetime | None = None, job: Job | None = None):
        """Feed a simulated health signal (XID, ECC, thermal, missing device) to the policy.

        kind="interference" is not a health signal: it makes `job` (by default the longest-running
        share of `card`) greedy, using `code` percent of the card (default 100) from `now` on;
        the interference check on the following ticks does the rest. Returns the job, or None
        when the card holds no share.
        """
        if kind == INTERFERENCE:
            if job is None:
                first = services.open_shared_bindings().filter(accelerator=card).order_by("start", "id").first()
                job = first.job if first else None
            if job is None:
                return None
            self.set_utilisation(job, (code if code is not None else 100) / 100, now=now)
            return job
        with context.bound(actor_label="service:simulated-cluster"):
            return services.record_health_event(
                None, card, kind=kind, code=code, message=message or f"simulated {kind} {code or ''}".strip(),
                time=now,
            )

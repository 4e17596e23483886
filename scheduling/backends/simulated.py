"""The simulated cluster: runs admitted jobs for their declared time on a simulated clock.

It is the embedded default and what the demo runs on. `tick(now)` starts admitted jobs and
finishes those whose declared run time (or time limit) has passed, ending their bindings at
the exact simulated instant; `inject_fault` feeds a health event through the same health
policy a real backend uses. It never admits or places anything: that is the cycle's job.
"""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.utils import timezone

from portal import audit, context
from scheduling import services
from scheduling.models import Binding, BindingEnd, Job, JobEvent, JobState


class SimulatedCluster:
    name = "simulated"

    def tick(self, now: dt.datetime | None = None) -> dict:
        now = now or timezone.now()
        started, finished = [], []
        with context.bound(actor_label="service:simulated-cluster"), transaction.atomic():
            # rows locked in id order and only the job rows, as the cycle does, so a tick and a
            # cycle (or a cancel) never wait on each other in a circle
            for job in Job.objects.select_for_update(of=("self",)).filter(state=JobState.ADMITTED).order_by("pk"):
                job.state = JobState.RUNNING
                job.started = job.admitted or now
                job.save(update_fields=["state", "started"])
                JobEvent.objects.create(job=job, time=job.started, kind="running",
                                        message="Containers started on the simulated cluster.")
                started.append(job.pk)
            running = (Job.objects.select_for_update(of=("self",)).filter(state=JobState.RUNNING)
                       .select_related("project__tenant").order_by("pk"))
            for job in running:
                run_for = min(job.expected_minutes, job.time_limit_minutes)
                end = job.started + dt.timedelta(minutes=run_for)
                if end > now:
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
        if finished:
            services.enqueue_cycle_after_commit()
        return {"started": started, "finished": finished}

    def inject_fault(self, card, *, kind: str, code: int | None = None, message: str = "",
                     now: dt.datetime | None = None):
        """Feed a simulated health signal (XID, ECC, thermal, missing device) to the policy."""
        with context.bound(actor_label="service:simulated-cluster"):
            return services.record_health_event(
                None, card, kind=kind, code=code, message=message or f"simulated {kind} {code or ''}".strip(),
                time=now,
            )

"""Fixtures for metering tests: bindings made the way the scheduler writes them, and RQ."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import django_rq
import pytest
from rq import SimpleWorker

UTC = dt.UTC


def t(*args) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


@pytest.fixture
def bind(org):
    """bind(slug, start, end, card=None, share_milli=1000, mig_profile="") -> Binding (and its job)."""
    from scheduling.models import Accelerator, Binding, Job, JobState

    cards = list(Accelerator.objects.filter(model=org.models["h100"]).order_by("pk"))

    def make(slug, start, end=None, *, card=None, share_milli=1000, mig_profile="", job=None):
        project = org.projects[slug]
        if job is None:
            job = Job.objects.create(
                tenant=project.tenant, project=project, submitter=org.people[slug]["user"], name="j",
                spec=org.specs["h1"], priority_class=org.prio["training"], image="img", state=JobState.RUNNING,
                submitted=start, started=start,
            )
        return Binding.objects.create(
            job=job, accelerator=card or cards[0], tenant=project.tenant, project=project,
            share_milli=share_milli, mig_profile=mig_profile, mig_slot=0 if mig_profile else None,
            start=start, end=end,
        )

    return make


@pytest.fixture
def prices(org):
    """H100 at 2.00 and L4 at 0.50 per card-hour from long ago (before any usage)."""
    from metering.models import Price

    return {
        "h100": Price.objects.create(accelerator_model=org.models["h100"], per_card_hour=Decimal("2.0000"),
                                     effective_from=t(2020, 1, 1)),
        "l4": Price.objects.create(accelerator_model=org.models["l4"], per_card_hour=Decimal("0.5000"),
                                   effective_from=t(2020, 1, 1)),
    }


@pytest.fixture
def rq_queues():
    """The metering and reports queues, emptied before and after (own Redis DB from REDIS_URL)."""
    queues = [django_rq.get_queue("metering"), django_rq.get_queue("reports")]
    queues[0].connection.flushdb()
    yield queues
    queues[0].connection.flushdb()


def run_burst(queues) -> None:
    """Run every queued job now with a non-forking worker, as the brief's tests do."""
    SimpleWorker(queues, connection=queues[0].connection).work(burst=True)

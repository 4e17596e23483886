"""Scheduling cycles are paced (ATRIUM_CYCLE_MIN_INTERVAL): a cycle job waits until the interval
has passed since the previous cycle ended, so a burst of submissions is decided in one cycle
rather than one cycle each. The wait is bounded by the interval whatever Redis holds."""

from __future__ import annotations

import time

import django_rq
import pytest

from scheduling import jobs


@pytest.fixture
def clean_pacing():
    conn = django_rq.get_connection("scheduling")
    conn.delete(jobs.LAST_CYCLE_KEY)
    yield conn
    conn.delete(jobs.LAST_CYCLE_KEY)


@pytest.mark.django_db
def test_a_cycle_right_after_another_waits_out_the_interval_once(clean_pacing, settings):
    settings.ATRIUM_CYCLE_MIN_INTERVAL = 0.4
    assert jobs.pace_cycle() == 0.0  # no cycle ran yet: nothing to wait for
    jobs.run_scheduling_cycle()
    assert clean_pacing.get(jobs.LAST_CYCLE_KEY) is not None
    waited = jobs.pace_cycle()
    assert 0.2 < waited <= 0.4
    assert jobs.pace_cycle() == 0.0  # the interval has passed now


@pytest.mark.django_db
def test_no_pacing_when_the_interval_is_zero(clean_pacing, settings):
    settings.ATRIUM_CYCLE_MIN_INTERVAL = 0
    jobs.run_scheduling_cycle()
    assert jobs.pace_cycle() == 0.0


def test_a_last_end_in_the_future_never_stalls_the_scheduler_longer_than_the_interval(clean_pacing, settings):
    settings.ATRIUM_CYCLE_MIN_INTERVAL = 0.2
    clean_pacing.set(jobs.LAST_CYCLE_KEY, repr(time.time() + 3600))  # a clock stepped back
    assert jobs.pace_cycle() == pytest.approx(0.2)
    clean_pacing.set(jobs.LAST_CYCLE_KEY, "not a number")
    assert jobs.pace_cycle() == 0.0

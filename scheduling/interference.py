"""Interference on shared cards: which share persistently takes far more than it asked for.

The pure policy, over plain dataclasses: given, per binding of a shared card, its share, its
interval and the utilisation samples a backend measured, decide the offenders. It never reads
or writes the database and never raises alarms; scheduling.services.check_interference feeds it
and handle_interference acts on what it returns.

The rule: a share is an offender when every sample of an unbroken run covering at least the
window (and at least `min_samples` of them) exceeds `share x factor` while at least one other
binding held the same card, and another binding still holds it now. A job alone on a card may
use all its idle capacity (that is what sharing is for): samples taken while it was alone
break the run, so it only becomes an offender after a full window of contention.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    time: dt.datetime
    used_milli: int  # thousandths of the whole card


@dataclass(frozen=True)
class Share:
    """One binding of a shared card with what the backend saw it use."""

    binding_id: int
    job_id: int
    card_id: int
    share_milli: int
    start: dt.datetime
    end: dt.datetime | None = None
    samples: tuple[Sample, ...] = ()

    def holds_at(self, t: dt.datetime) -> bool:
        # bindings hold their card over [start, end), as scheduling.queries says
        return self.start <= t and (self.end is None or self.end > t)


@dataclass(frozen=True)
class Policy:
    factor: float = 1.5
    window: dt.timedelta = dt.timedelta(minutes=10)
    min_samples: int = 3

    def threshold_milli(self, share_milli: int) -> float:
        return share_milli * self.factor


@dataclass(frozen=True)
class Offender:
    binding_id: int
    job_id: int
    card_id: int
    share_milli: int
    threshold_milli: int
    used_milli: int       # mean over the offending run
    peak_milli: int
    since: dt.datetime    # first sample of the run (as far back as the samples given go)
    samples: int
    victims: tuple[int, ...] = field(default=())  # job ids of the other shares holding the card now


def find_offenders(shares: Iterable[Share], *, now: dt.datetime, policy: Policy | None = None) -> list[Offender]:
    """The shares that took more than `share x factor` for the whole window while sharing."""
    policy = policy or Policy()
    by_card: dict[int, list[Share]] = defaultdict(list)
    for share in shares:
        by_card[share.card_id].append(share)
    out: list[Offender] = []
    for card_id in sorted(by_card):
        card_shares = by_card[card_id]
        for share in sorted(card_shares, key=lambda s: s.binding_id):
            if not share.holds_at(now):
                continue
            others = [o for o in card_shares if o.binding_id != share.binding_id]
            victims = tuple(sorted({o.job_id for o in others if o.holds_at(now) and o.job_id != share.job_id}))
            if not victims:
                continue  # alone on the card now: using idle capacity hurts nobody
            limit = policy.threshold_milli(share.share_milli)
            run: list[Sample] = []
            for sample in sorted(share.samples, key=lambda s: s.time):
                if sample.time > now:
                    break
                contended = any(o.holds_at(sample.time) and o.job_id != share.job_id for o in others)
                if sample.used_milli > limit and contended:
                    run.append(sample)
                else:
                    run = []
            if len(run) < policy.min_samples or now - run[0].time < policy.window:
                continue
            if now - run[-1].time > policy.window:
                continue  # stale: the backend stopped reporting, accuse nobody on old data
            used = round(sum(s.used_milli for s in run) / len(run))
            out.append(Offender(
                binding_id=share.binding_id, job_id=share.job_id, card_id=card_id, share_milli=share.share_milli,
                threshold_milli=int(limit), used_milli=used, peak_milli=max(s.used_milli for s in run),
                since=run[0].time, samples=len(run), victims=victims,
            ))
    return out

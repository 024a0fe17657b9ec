"""Jobs arrived per planning round: pure, no clock, no I/O.

Nothing counts enqueues, so arrivals are derived: the jobs arrived up to a moment are the
jobs in the broker then (ready + locked: a job leaves it only when it is settled) plus
every job settled before it. The broker is read at each round; the jobs settled are known
from the masters' reports, each complete up to the moment it was sent, not up to the round
(a master reports every interval on its own phase, so up to one interval late).

The planner used to count a round's arrivals as "done in each host's latest report, as a
rate + ready jobs now - ready jobs at the previous round", mixing two spans, and clamped
the result at 0. Slots taking jobs made the ready count fall before the reports said so (a
negative count, dropped), and when a drain ended, the reports' lagged done count came out
as jobs arrived after it: chaos row L2 saw "120 arrived in 1s" after the feed had stopped
and the plan moved 3 slots back within a second.

:class:`ArrivalLedger` counts on one ledger instead: ``jobs in the broker now + jobs
settled in every report received so far``, cumulative. It never counts a job that did not
come (jobs settled since a host's latest report are missing from it, never extra), and no
job twice: a round's arrivals are what the ledger rose by, and a fall (reports catching up
less than the broker moved) is carried to the next rounds instead of being dropped, so
over time the arrivals add up exactly to the jobs settled plus the change in the broker.
What stays inexact is *when* a job is counted: the jobs settled since the hosts' latest
reports are counted one round late. The ledger says how many that may be (the settled-but-
unreported jobs at the previous round and at this one, estimated from the reports' own
rates and times); the planner does not take a count within that margin of its estimate as
a change of rate (it smooths it in), so one lagged report cannot move a plan by far.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qcluster.manager.planning.types import quick_init


def unreported(latest: Iterable[tuple[float, float]], now: float) -> float:
    """Jobs settled since the hosts' latest reports, estimated: for each host's latest
    report ``(received at, jobs settled per second in it)``, its rate times its age."""
    return sum(rate * max(0.0, now - at) for at, rate in latest)


@quick_init
@dataclass(frozen=True, slots=True)
class ArrivalCount:
    """One round's count."""

    jobs: int
    """Jobs arrived since the previous round (a late count of jobs before it included)."""
    margin: float
    """How far the count may be from the round's own arrivals: jobs settled before the
    previous round and reported since (counted late, here), or settled in this round and
    not reported yet (to be counted next round). The larger of the two estimates."""


@dataclass
class ArrivalLedger:
    """One queue's arrivals, round after round (the caller keeps it between rounds)."""

    ledger: int | None = None
    """Jobs in the broker + jobs settled in the reports, at the previous round (None: no
    round yet)."""
    carry: int = 0
    """What the ledger fell by and no round has made up yet (<= 0)."""
    missing: float = 0.0
    """The settled-but-unreported estimate at the previous round."""

    def count(self, in_broker: int, settled: int, missing: float) -> ArrivalCount | None:
        """This round's arrivals (None at the first round: no span yet).

        ``in_broker``: ready + locked jobs read now; ``settled``: jobs settled (done,
        retried or failed) in every report received so far, cumulative; ``missing``: the
        jobs settled since the hosts' latest reports, estimated (:func:`unreported`): not
        counted, only the margin of the count."""
        ledger = in_broker + settled
        previous, self.ledger = self.ledger, ledger
        before, self.missing = self.missing, missing
        if previous is None:
            return None
        raw = ledger - previous + self.carry
        arrived = max(0, raw)
        self.carry = raw - arrived
        return ArrivalCount(arrived, max(before, missing))

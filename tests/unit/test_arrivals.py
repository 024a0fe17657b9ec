"""The jobs arrived per planning round (manager/planning/arrivals.py, through ClusterState): counted
on one ledger (the broker's ready + locked jobs and the jobs settled in the reports), so
the masters' report lag makes a count late, never a phantom (chaos row L2)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from qcluster.broker.base import QueueStats
from qcluster.config import load_settings
from qcluster.manager.state import ClusterState
from qcluster.messages import (
    BatchCounters,
    HostFacts,
    HostReport,
    QueueCounters,
    SlotInfo,
)
from qcluster.policy import QueuePolicy

FACTS = HostFacts(cpus=2, loadavg=(0.1, 0.1, 0.1), mem_total_bytes=8 << 30,
                  mem_available_bytes=4 << 30, pss_total_bytes=1 << 28,
                  avg_slot_pss_bytes=1 << 24)
JOB_S = 0.02
POLICIES = {"a": QueuePolicy.model_validate({"batch_size": 10, "est_job_seconds": JOB_S}),
            "b": QueuePolicy.model_validate({"batch_size": 10, "est_job_seconds": JOB_S})}


def state(interval_s: float = 1.0) -> ClusterState:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "qcluster.toml"
        path.write_text(f"[manager]\ninterval_s = {interval_s}\nwindow_s = 60\n")
        return ClusterState(load_settings(path))


def host_report(host: str, slots: dict[str, int], done: dict[str, int], interval_s: float,
                capacity: int = 4) -> HostReport:
    infos = [SlotInfo(slot_no=i, pid=1000 + i, queue=q, state="busy", started_at=0.0)
             for i, q in enumerate(q for q, n in slots.items() for _ in range(n))]
    counters = {q: QueueCounters(counters=BatchCounters(done=done.get(q, 0),
                                                        busy_s=done.get(q, 0) * JOB_S),
                                 alive_s=interval_s * slots.get(q, 0))
                for q in set(slots) | set(done)}
    return HostReport(host=host, sent_at=0.0, interval_s=interval_s, facts=FACTS,
                      capacity_slots=capacity, queues=POLICIES, slots=infos, counters=counters)


class Drain:
    """Queue ``a`` on one master with 4 slots (50 jobs/s each): fed 300 jobs/s until
    ``feed_s``, then drained; slots take batches of 10 (locked until settled). The master
    reports every second at ``phase`` past the manager's round, so the jobs settled reach
    the manager up to a second after the broker's counts show them gone."""

    STEP = 0.01

    def __init__(self, phase: float, feed_s: float = 10.0, rate: float = 300.0) -> None:
        self.phase, self.feed_s, self.rate = phase, feed_s, rate
        self.t, self.arrived, self.settled, self.reported_upto = 0.0, 0.0, 0.0, 0.0
        self.s = state()

    def in_broker(self) -> int:
        return int(self.arrived) - int(self.settled)

    def advance(self, until: float) -> None:
        while self.t < until - 1e-9:
            if self.t < self.feed_s:
                self.arrived += self.rate * self.STEP
            self.settled = min(self.settled + 4 / JOB_S * self.STEP, float(int(self.arrived)))
            self.t = round(self.t + self.STEP, 6)

    def run(self, rounds: int) -> list[tuple[float, int, int]]:
        """(round time, a's planned slots, jobs truly arrived) per round."""
        out, last_true = [], 0
        s = self.s
        for k in range(1, rounds + 1):
            self.advance(k - 1 + self.phase)
            done = int(self.settled) - int(self.reported_upto)
            self.reported_upto = float(int(self.settled))
            s.receive(host_report("m", {"a": 4}, {"a": done}, 1.0), now=self.t)
            self.advance(float(k))
            locked = min(self.in_broker(), 40)
            s.set_stats({"a": QueueStats(ready=self.in_broker() - locked, locked=locked)})
            s.plan_round(float(k))
            out.append((float(k), s.plans["a"].planned, int(self.arrived) - last_true))
            last_true = int(self.arrived)
        return out


@pytest.mark.parametrize("phase", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_l2_a_drain_ending_counts_no_phantom_arrivals_and_the_plan_does_not_rise(
        phase: float) -> None:
    """Chaos row L2: queue a fed 300 jobs/s for 10 s on 4 slots (200 jobs/s),
    then drained. The round counted 'done in the latest report + ready now - ready at the
    previous round': when the drain ended, the report's lagged done count came out as
    jobs arrived ('120 arrived in 1s' with the feed stopped for 6 s), taken at once as a
    change, and the plan went back up by far (a flap: 1 -> 4, and b lost its slots).
    Now, from the round after the feed stopped on, the plan never rises and no
    decision speaks of arrivals."""
    drain = Drain(phase)
    drain.run(30)
    s = drain.s
    after_feed = [d for d in s.decisions if d.queue == "a" and d.at > drain.feed_s + 1]
    assert all(d.to_slots <= d.from_slots for d in after_feed), [d.reason for d in after_feed]
    points = [p for p in s.history("a") if p.at > drain.feed_s + 1]
    planned = [p.slots_planned for p in points]
    assert planned == sorted(planned, reverse=True), planned

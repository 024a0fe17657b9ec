"""The simulator's model of a real slot: batches (taken together, one batch cost each,
settled together), the jobs a dead host held coming back when their locks expire, and the
slots a trace (a replayed recording) begins with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qcluster.manager.simulator import load_trace
from qcluster.manager.simulator.engine import Simulation
from qcluster.manager.simulator.model import QueueSim
from qcluster.manager.simulator.policies import make_policy
from qcluster.manager.simulator.trace import parse_trace


def one_queue(duration: float, rate: float, mean: float, *, batch: int = 1,
              cost: float = 0.0, slots: int = 1, hosts: int = 1, **policy: Any) -> dict[str, Any]:
    """A queue held at ``slots`` slots (min = max), jobs of a fixed time, even arrivals."""
    return {"duration_s": duration,
            "hosts": {f"h{i}": {"slots": slots} for i in range(hosts)},
            "queues": {"q": {"policy": {"batch_size": batch, "min_slots": slots * hosts,
                                        "max_slots": slots * hosts, **policy},
                             "rate": [[0, rate]], "arrivals": "even", "batch_cost_s": cost,
                             "job_time": {"dist": "fixed", "mean_s": mean}}}}


class Sampled(Simulation):
    """Each step's end, per queue: (time, ready, held in batches, batches held, slots)."""

    def __init__(self, data: dict[str, Any]) -> None:
        trace = parse_trace(data)
        super().__init__(trace, make_policy("qcluster", trace), 0)
        self.steps_seen: list[tuple[float, int, int, int, int]] = []

    def serve(self, q: QueueSim, now: float, arriving: int) -> None:
        super().serve(q, now, arriving)
        self.steps_seen.append((now + self.dt, q.backlog, q.started - q.finished,
                                q.held_batches, q.active))


def test_every_free_slot_holds_a_full_batch_while_jobs_wait() -> None:
    """4 slots, batches of 10, twice the work they can do: at each step's end every slot
    holds its next batch (40 jobs taken, not ready), the rest waits."""
    sim = Sampled(one_queue(30, 1600, 0.005, batch=10, slots=4))
    sim.run()
    busy = [s for s in sim.steps_seen if s[0] > 10]
    assert busy and all(ready > 0 for _, ready, _, _, _ in busy)
    assert all((held, batches) == (40, 4) for _, _, held, batches, _ in busy)


def test_a_slot_that_keeps_up_takes_batches_of_one_and_pays_the_cost_per_job() -> None:
    """20 jobs/s of 1 ms with a 9 ms batch cost on one slot: it is free when each job comes,
    so each is its own batch: 10 ms of slot time per job."""
    sim = Sampled(one_queue(60, 20, 0.001, batch=10, cost=0.009))
    run = sim.run()
    q = run.queues["q"]
    assert q.finished > 1000
    assert q.busy_seconds / q.finished == pytest.approx(0.010, rel=0.02)


def test_a_saturated_slot_takes_full_batches_and_spreads_the_cost() -> None:
    """The same slot fed 2,000 jobs/s: full batches of 10, 1.9 ms per job, 526 jobs/s."""
    sim = Sampled(one_queue(60, 2000, 0.001, batch=10, cost=0.009))
    q = sim.run().queues["q"]
    done_per_s = q.finished / 58  # its slot starts within the first 2 s
    assert done_per_s == pytest.approx(1 / 0.0019, rel=0.03)


def test_the_jobs_a_dead_host_held_come_back_when_their_locks_expire() -> None:
    """Two hosts of 2 slots, batches of 10, saturated; h1 dies at 6 s holding its slots'
    batches (20 jobs): they stay locked for lock_timeout (30 s), then are ready again and
    are done; nothing is lost or done twice."""
    data = one_queue(120, 2000, 0.005, batch=10, slots=2, hosts=2, lock_timeout=30)
    data["queues"]["q"]["rate"] = [[0, 2000], [20, 0]]
    data["events"] = [{"at_s": 6, "host": "h1", "event": "die"}]
    sim = Sampled(data)
    locked: list[tuple[float, int]] = []
    real_serve = sim.serve

    def serve(q: QueueSim, now: float, arriving: int) -> None:
        real_serve(q, now, arriving)
        locked.append((now + sim.dt, q.locked_lost))

    sim.serve = serve  # type: ignore[method-assign]
    q = sim.run().queues["q"]
    assert q.redelivered == 20
    assert all(n == 20 for t, n in locked if 6.5 <= t <= 35.5)
    assert all(n == 0 for t, n in locked if t < 6 or t > 36.5)
    assert q.finished == q.arrived == q.started
    assert sum(q.waits.values()) == q.started  # each job's wait counted once


def test_slots_running_when_a_trace_begins_are_there_from_its_first_step() -> None:
    data = one_queue(20, 0, 0.01, slots=3)
    data["queues"]["q"]["start_slots"] = 3
    q = Sampled(data).run().queues["q"]
    assert (q.starts, q.stops) == (0, 0)
    assert q.slot_seconds == pytest.approx(60)


def test_a_replayed_recording_begins_with_the_slots_its_first_round_found(
        tmp_path: Path) -> None:
    policy = {"batch_size": 20, "min_slots": 1, "max_slots": 16}
    lines = [{"type": "header", "version": 1, "started_at": 1.7e9, "interval_s": 2.0,
              "queues": {"resize": policy, "mail": {}}, "hosts": {"a": {"slots": 8}}}]
    for k, slots in enumerate([2, 3, 3]):
        lines.append({"type": "round", "t_s": 2.0 * (k + 1),
                      "hosts": {"a": {"slots": 8, "alive": True}},
                      "queues": {"resize": {"arrived": 100, "done": 100, "backlog": 0,
                                            "mean_job_s": 0.002, "slots": slots},
                                 "mail": {"arrived": 0, "done": 0, "backlog": 0,
                                          "mean_job_s": None, "slots": 0}}})
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = load_trace(path)
    assert trace.queues["resize"].start_slots == 2
    assert trace.queues["mail"].start_slots == 0
    # its rounds' arrivals are replayed in the interval after each: the manager's first
    # round is the second of the replay
    assert trace.first_round_s == 2.0


def test_no_round_plans_before_the_managers_first_and_that_one_counts_no_arrivals() -> None:
    """Jobs waiting before a manager starts: its first round sees them waiting (no count of
    arrivals: no round before it), as a real manager just started does."""
    data = one_queue(20, 100, 0.01, slots=4)
    data["queues"]["q"]["policy"] = {"max_slots": 4}
    data["first_round_s"] = 6.0
    sim = Sampled(data)
    seen: list[tuple[float, Any]] = []
    decide = sim.policy.decide

    def watch(now: float, inputs: Any, capacity: int) -> dict[str, int]:
        seen.append((now, inputs[0].window.recent_s))
        return decide(now, inputs, capacity)

    sim.policy.decide = watch  # type: ignore[method-assign, assignment]
    q = sim.run().queues["q"]
    assert seen[0] == (6.0, 0)  # the first round at 6 s, no arrivals counted
    assert all(recent == 2.0 for _, recent in seen[1:])
    assert q.starts and min(t for t in q.move_times) >= 6.0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 50), st.integers(1, 4), st.sampled_from([0.0, 0.002, 0.02]),
       st.integers(0, 3000), st.sampled_from([0.001, 0.01]))
def test_batches_never_hold_more_than_the_slots_and_the_batch_size(
        batch: int, slots: int, cost: float, rate: int, mean: float) -> None:
    """At any step's end the jobs taken and not settled fit the slots' batches, no job is
    both ready and taken, and at least one batch is held per slot while jobs wait."""
    sim = Sampled(one_queue(16, rate, mean, batch=batch, cost=cost, slots=slots))
    sim.run()
    for _, ready, held, batches, active in sim.steps_seen:
        assert ready >= 0 and held >= 0
        assert batches <= max(active, 0) or not ready
        assert held <= batches * batch
        if ready and active:
            assert batches >= active


def test_a_steady_streams_arrivals_count_no_noisier_than_the_stream() -> None:
    """100 jobs/s (Poisson) of 50 ms (exponential) on 6 slots taking batches of one: the
    slots keep up, and the manager's count of each round's arrivals (the rise of ready +
    locked, plus the jobs settled in the masters' latest report) is as steady as the
    arrivals themselves. A take whose jobs outlast the step's work used to keep all of
    them locked until its last one ended (up to 59 jobs locked on 6 slots, a count of 249
    in a round of 196 and 154 in the next): a slot settles each batch as it ends it."""
    data = one_queue(600, 100, 0.05, slots=6)
    data["queues"]["q"].update(arrivals="poisson", job_time={"mean_s": 0.05})
    sim = Sampled(data)
    counts: list[int] = []
    decide = sim.policy.decide

    def watch(now: float, inputs: Any, capacity: int) -> dict[str, int]:
        if now > 20:
            counts.append(inputs[0].window.recent_arrived)
        return decide(now, inputs, capacity)

    sim.policy.decide = watch  # type: ignore[method-assign, assignment]
    sim.run()
    mean = sum(counts) / len(counts)
    spread = (sum((c - mean) ** 2 for c in counts) / len(counts)) ** 0.5
    assert mean == pytest.approx(200, rel=0.02)
    assert spread <= 200 ** 0.5  # a Poisson count of 200 a round: 14 jobs

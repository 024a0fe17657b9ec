"""The planner judged on the example traces (examples/traces/), against the baselines.

Each test prints its table (``pytest -s`` shows it) and asserts issue 14's thresholds.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from qcluster.manager.simulator import load_trace, simulate
from qcluster.manager.simulator.arrivals import peak_rate
from qcluster.manager.simulator.engine import SimulationResult
from qcluster.manager.simulator.figures import RECOVERY_HORIZON_S, figures

TRACES = Path(__file__).resolve().parents[2] / "examples" / "traces"
#: Slots started at the beginning (nothing measured yet) are not steady-state churn.
WARM_UP_S = 120.0


def run(name: str, policies: tuple[str, ...] = ("qcluster", "hpa", "static"),
        **changes: Any) -> tuple[SimulationResult, dict[str, Any]]:
    trace = load_trace(TRACES / f"{name}.json")
    if changes:
        trace = trace.model_copy(update=changes)
    result = simulate(trace, policies, seed=0)
    return result, figures(result)


def show(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [header, *[[f"{c:g}" if isinstance(c, float) else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def test_steady_load_moves_a_slot_at_most_once_per_queue_per_5_minutes() -> None:
    result, _ = run("steady")
    duration = result.trace.duration_s - WARM_UP_S
    allowed = math.floor(duration / 300.0)
    rows, ok = [], True
    for policy, body in result.runs.items():
        for name, q in body.queues.items():
            moves = sum(1 for t in q.move_times if t > WARM_UP_S)
            rows.append([policy, name, moves, allowed])
            ok &= policy != "qcluster" or moves <= allowed
    show(f"steady: slot moves after {WARM_UP_S:g}s warm-up (qcluster at most {allowed})",
         ["policy", "queue", "slot moves", "allowed"], rows)
    assert ok


def test_demo_square_wave_moves_at_most_twice_per_edge_and_never_between() -> None:
    """resize: 1,500 <-> 50 jobs/s every 40 s. Each plan move belongs to the last edge
    before it; at most 2 per edge, each in the edge's direction (no flapping between)."""
    result, _ = run("square_wave", ("qcluster",))
    edge_s = 40.0
    per_edge: Counter[float] = Counter()
    wrong_way = []
    for at, before, after in result.runs["qcluster"].queues["resize"].plan_moves:
        edge = math.floor(at / edge_s - 1e-9) * edge_s  # a round at the edge saw before it
        if edge < 2 * edge_s:
            continue  # the first period: the est_job_seconds guess is being replaced
        per_edge[edge] += 1
        rising = (edge / edge_s) % 2 == 0
        if (after > before) != rising:
            wrong_way.append((at, before, after))
    edges = [e * edge_s for e in range(2, int(result.trace.duration_s // edge_s))]
    show("square wave (resize): plan moves per edge",
         ["edge at s", "direction", "moves"],
         [[e, "up" if (e / edge_s) % 2 == 0 else "down", per_edge[e]] for e in edges])
    assert max(per_edge.values()) <= 2
    assert not wrong_way, wrong_way
    assert sum(per_edge.values()) >= len(edges) // 2  # it does follow the load


def test_overload_keeps_the_top_priority_within_target_and_hpa_does_not() -> None:
    _, data = run("overload", ("qcluster", "hpa"))
    rows = []
    for policy, body in data["policies"].items():
        for name, fig in body["queues"].items():
            rows.append([policy, name, fig["priority"], fig["target_wait_s"], fig["wait_p99_s"],
                         fig["over_target_s"]])
    show("overload 2x: p99 wait per queue", ["policy", "queue", "priority", "target_wait",
                                              "p99 wait s", "over target s"], rows)
    top = data["policies"]["qcluster"]["queues"]["payments"]
    assert top["wait_p99_s"] <= top["target_wait_s"]
    hpa = data["policies"]["hpa"]["queues"]["payments"]
    assert hpa["wait_p99_s"] > hpa["target_wait_s"]


def test_diurnal_uses_30_percent_fewer_slot_seconds_than_static_at_no_worse_p99() -> None:
    _, data = run("diurnal", ("qcluster", "static"))
    rows = [[p, b["overall"]["slot_seconds"], b["overall"]["wait_p99_s"]]
            for p, b in data["policies"].items()]
    q, s = (data["policies"][p]["overall"] for p in ("qcluster", "static"))
    show(f"diurnal: qcluster uses {1 - q['slot_seconds'] / s['slot_seconds']:.0%} fewer "
         "slot-seconds than static", ["policy", "slot-seconds", "p99 wait s"], rows)
    assert q["slot_seconds"] <= 0.7 * s["slot_seconds"]
    assert q["wait_p99_s"] <= s["wait_p99_s"]


def test_host_loss_brings_high_priority_queues_back_within_3_rounds() -> None:
    """A cluster planned for 90% busy, high- and low-priority queues on every host; one
    host, 20% of the slots, dies for 10 minutes. Right after the death each high-priority
    queue runs fewer slots than its work needs (it lost more than its spare) and the live
    hosts have no free slot: unless slots move from the lower priority to it, its wait
    grows without bound. Under qcluster they are back within target at most 3 rounds after
    the manager noticed; under hpa (no priorities, first come first served) they are not."""
    result, data = run("host_loss", ("qcluster", "hpa", "static"))
    rows, worst = [], Counter[str]()
    for policy, body in data["policies"].items():
        for name, fig in body["queues"].items():
            if fig["priority"] < HIGH_PRIORITY or fig["target_wait_s"] is None:
                continue
            for rec in fig["recovery"]:
                died = rec["host_died_at_s"]
                before, after = slots_around(result, policy, name, died)
                back = slots_back_rounds(result, policy, name, died)
                rows.append([policy, name, fig["target_wait_s"], work(result, name), before,
                             after, peak_wait(result, policy, name, died),
                             rec["back_within_target_s"], rec["rounds_after_noticed"],
                             "never" if back == NEVER else back])
                worst[policy] = max(worst[policy], rec["rounds_after_noticed"], back)
    show("host loss (20% of capacity): high-priority queues after the death",
         ["policy", "queue", "target_wait", "work slot-s/s", "slots before", "slots after",
          "peak wait s", "over target until s", "rounds after noticed",
          "rounds until slots are back"], rows)
    assert rows
    assert worst["qcluster"] <= 3
    # It had to move slots: each queue lost at least its spare (it ran no more slots than
    # its work needs: 100% busy, so any noise makes it wait), at least one lost more (it ran
    # fewer), and the live hosts had no free slot to give them.
    died = result.runs["qcluster"].deaths[0]
    short = {r[1]: r[3] - r[5] for r in rows if r[0] == "qcluster"}
    assert all(gap >= 0 for gap in short.values()), short
    assert any(gap > 0 for gap in short.values()), short
    assert live_free_slots(result, "qcluster", died) < sum(short.values())
    assert worst["hpa"] > 3  # the trace tells a planner without priorities apart


#: Queues of at least this priority (with a target_wait) count as high priority.
HIGH_PRIORITY = 5
#: Rounds reported when the slots never came back.
NEVER = 10**6


def work(result: SimulationResult, queue: str) -> float:
    """Slot-seconds of work arriving per second at the queue's (flat) rate."""
    spec = result.trace.queues[queue]
    return round(peak_rate(spec, result.trace.interval_s) * spec.job_time.mean_s, 2)


def slots_around(result: SimulationResult, policy: str, queue: str,
                 died: float) -> tuple[float, float]:
    """The queue's slots (on average) in the round before the death and in the round
    that follows it."""
    series = result.runs[policy].queues[queue].series
    before = [s for t, s in zip(series.t, series.slots, strict=True) if t <= died][-1]
    after = next(s for t, s in zip(series.t, series.slots, strict=True) if t > died)
    return before, after


def live_free_slots(result: SimulationResult, policy: str, died: float) -> float:
    """Free slots on the live hosts in the round after the death."""
    dead = [e.host for e in result.trace.events if e.at_s == died and e.event == "die"]
    live = sum(h.slots for name, h in result.trace.hosts.items() if name not in dead)
    used = sum(slots_around(result, policy, q, died)[1] for q in result.runs[policy].queues)
    return live - used


def peak_wait(result: SimulationResult, policy: str, queue: str, died: float) -> float:
    """The oldest waiting job's longest wait at a round's end after the death."""
    series = result.runs[policy].queues[queue].series
    return max((w for t, w in zip(series.t, series.wait, strict=True)
                if died < t <= died + RECOVERY_HORIZON_S), default=0.0)


def slots_back_rounds(result: SimulationResult, policy: str, queue: str, died: float) -> int:
    """Rounds after the manager noticed the death until the queue runs as many slots as
    just before it (the dead host's share re-placed and started)."""
    run_ = result.runs[policy]
    series = run_.queues[queue].series
    before, _ = slots_around(result, policy, queue, died)
    noticed = died + run_.detect_s
    for t, slots in zip(series.t, series.slots, strict=True):
        if t > noticed and slots >= before - 0.5:
            return math.ceil((t - noticed) / run_.interval_s - 1e-9)
    return NEVER


@pytest.mark.parametrize("name", ["bursty", "steady", "square_wave"])
def test_example_traces_conserve_jobs(name: str) -> None:
    result, _ = run(name)
    for body in result.runs.values():
        for q in body.queues.values():
            assert q.arrived == q.started + q.backlog


#: Chaos row L2 in the simulator: one master of 4 slots (20 ms jobs, 200
#: jobs/s in all), queue a fed 300 jobs/s for 10 s, then queue b for 10 s; the manager
#: plans every second, as in the row.
BACKLOG_SHIFT = {
    "duration_s": 150, "interval_s": 1.0, "report_lag_s": 0.5,
    "hosts": {"m": {"slots": 4}},
    "queues": {
        name: {"policy": {"batch_size": 10, "est_job_seconds": 0.02}, "arrivals": "even",
               "rate": [[0, 0], [start, 300], [start + 10, 0]], "job_time": {"mean_s": 0.02}}
        for name, start in (("a", 0), ("b", 10))},
}


def test_idle_slots_drain_a_shifted_backlog_sooner_without_more_churn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """L2: once a's backlog is gone, b's (59 slot-s) drained over the 60 s horizon on one
    slot while 3 of 4 slots sat idle. With the idle-slot rule b keeps the free slots while
    its backlog is worth them: a shorter wait, more jobs per second over the transition,
    and no more slot moves than without it."""
    from qcluster.manager.planning import plan as planning
    from qcluster.manager.simulator.engine import Simulation
    from qcluster.manager.simulator.policies import make_policy
    from qcluster.manager.simulator.trace import Trace

    trace = Trace.model_validate(BACKLOG_SHIFT)
    rows, figures_by = [], {}
    for rule in ("idle slots used", "60 s horizon only"):
        if rule == "60 s horizon only":  # no idle slot given (the rest of the plan as is)
            monkeypatch.setattr(planning, "use_idle", lambda *args: {})
        sim = Simulation(trace, make_policy("qcluster", trace), 0)
        finished: dict[float, int] = {}
        end_round = sim.end_round

        def count(q: Any, index: int, now: float, end_round: Any = end_round,
                  finished: dict[float, int] = finished, sim: Any = sim) -> None:
            end_round(q, index, now)
            finished[now] = sum(x.finished for x in sim.queues.values())

        sim.end_round = count  # type: ignore[method-assign]
        run_ = sim.run()
        b = figures(SimulationResult(trace, 0, {"qcluster": run_}))["policies"]["qcluster"]
        b = b["queues"]["b"]
        moves = sum(q.starts + q.stops for q in run_.queues.values())
        rate = (finished[40.0] - finished[10.0]) / 30.0
        figures_by[rule] = (b["wait_p99_s"], b["burst_drain_max_s"], moves, rate)
        rows.append([rule, b["wait_p99_s"], b["burst_drain_max_s"], moves, round(rate)])
    show("backlog shift (chaos row L2): queue b after a", ["planner", "b p99 wait s",
         "b drained in s", "slot moves", "jobs/s, 10-40 s"], rows)
    used, horizon = figures_by["idle slots used"], figures_by["60 s horizon only"]
    assert used[0] <= 0.6 * horizon[0]
    assert used[1] <= 0.75 * horizon[1]
    assert used[2] <= horizon[2]
    assert used[3] >= 1.1 * horizon[3]


#: Chaos row L2 "scarce" in the simulator: the same host of 4 slots and 20 ms jobs; queue
#: a's 100 jobs/s (2 slot-s/s: 3 slots at the 80% target) move to b and back every 12 s,
#: as in the row's quick profile (a, b, a, b, a).
SCARCE_PHASE_S = 12.0
SCARCE_ORDER = ("a", "b", "a", "b", "a")
SCARCE_SHIFT = {
    "duration_s": len(SCARCE_ORDER) * SCARCE_PHASE_S + 60, "interval_s": 1.0,
    "report_lag_s": 0.5, "hosts": {"m": {"slots": 4}},
    "queues": {
        name: {"policy": {"batch_size": 10, "est_job_seconds": 0.02}, "arrivals": "even",
               "rate": [[0, 0]] + [r for n, q in enumerate(SCARCE_ORDER) if q == name
                                    for r in ([n * SCARCE_PHASE_S, 100],
                                              [(n + 1) * SCARCE_PHASE_S, 0])],
               "job_time": {"mean_s": 0.02}}
        for name in ("a", "b")},
}


def test_a_held_queue_lends_its_spare_slots_when_capacity_is_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """L2 scarce: once a's arrivals stop, a holds its 3 slots for its hold rounds while b,
    which needs 3, runs on the 1 left. The slots a's hold keeps beyond what its work needs
    now go to the queue that waits: over the 10 s after each shift (the row's window) at
    least 70% of the jobs that arrived are done, with no worse wait than with the hold
    kept. The plan now follows the load (a's slots go to b and come back), so it moves more
    than a plan that held a's slots through b's phases: 17 plan moves instead of 11 over 4
    shifts, 38 slot moves instead of 28 (bounded here at 1.5 times)."""
    from qcluster.manager.planning import plan as planning
    from qcluster.manager.simulator.engine import Simulation
    from qcluster.manager.simulator.policies import make_policy
    from qcluster.manager.simulator.trace import Trace

    trace = Trace.model_validate(SCARCE_SHIFT)
    rate = 100 * 10.0  # jobs arriving in the row's 10 s window
    rows, figures_by = [], {}
    share = planning.share_capacity
    for rule in ("spare lent", "hold kept"):
        if rule == "hold kept":
            monkeypatch.setattr(planning, "share_capacity",
                                lambda *args, spare=None: share(*args))
        sim = Simulation(trace, make_policy("qcluster", trace), 0)
        finished: dict[float, int] = {}
        end_round = sim.end_round

        def count(q: Any, index: int, now: float, end_round: Any = end_round,
                  finished: dict[float, int] = finished, sim: Any = sim) -> None:
            end_round(q, index, now)
            finished[now] = sum(x.finished for x in sim.queues.values())

        sim.end_round = count  # type: ignore[method-assign]
        run_ = sim.run()
        shifts = [n * SCARCE_PHASE_S for n in range(1, len(SCARCE_ORDER))]
        ratios = [round((finished[s + 10] - finished[s]) / rate, 2) for s in shifts]
        body = figures(SimulationResult(trace, 0, {"qcluster": run_}))["policies"]["qcluster"]
        overall = body["overall"]
        figures_by[rule] = (min(ratios), overall["wait_p99_s"], overall["plan_moves"],
                            overall["slot_moves"])
        rows.append([rule, " ".join(f"{r:g}" for r in ratios), overall["wait_p99_s"],
                     overall["plan_moves"], overall["slot_moves"]])
    show("scarce shift (chaos row L2 scarce): done / arrived in the 10 s after each shift",
         ["planner", "ratios", "p99 wait s", "plan moves", "slot moves"], rows)
    lent, kept = figures_by["spare lent"], figures_by["hold kept"]
    assert kept[0] < 0.7  # the premise: the row's failure
    assert lent[0] >= 0.7
    assert lent[1] <= kept[1]
    assert lent[3] <= 1.5 * kept[3]

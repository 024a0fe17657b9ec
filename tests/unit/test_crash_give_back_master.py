"""Issue 16 F14 in the master's loop (the component harness of test_master_component.py):
a slot that dies running a job has its take handed to a live slot as a give-back, and its
restart waits the base delay however often that happens (the job is charged for it; a
poison-only queue never completes a batch that would reset the backoff)."""

from __future__ import annotations

import pytest

from qcluster.job import Delivery
from qcluster.messages import Progress
from tests.unit.test_master_component import Harness, Q, harness, make_app, started


def die_running_a_job(h: Harness, pid: int) -> None:
    """The slot ``pid`` took two jobs, runs the first, and dies of it (os._exit(70))."""
    progress = h.ends[pid].progress
    assert progress is not None
    deliveries = [Delivery(job_id, b"", 1, 1e9, 1e9, "application/json", 42)
                  for job_id in ("poison", "innocent")]
    assert progress.begin(1, Q, 42, deliveries)
    progress.states[0] = Progress.RUNNING
    h.exit(pid, 70)


def test_a_slot_dead_of_a_job_gives_its_take_back_and_restarts_after_the_base_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for h in harness(monkeypatch, make_app(Q), {Q: 2}, heartbeat_timeout_s=10_000.0):
        victim, survivor = started(h)
        delays = []
        for _ in range(3):
            die_running_a_job(h, victim)
            h.step()
            assert "give_back" in h.received(survivor)
            forks, waited = len(h.os.forks), 0.0
            while len(h.os.forks) == forks:
                h.step(0.25)
                waited += 0.25
                assert waited < 120
            delays.append(waited)
            victim = h.os.forks[-1]
            h.hello(victim)
            h.step()
        assert delays == [0.5, 0.5, 0.5]  # a crash of its own doubles it: 0.5, 1, 2
        assert h.restarts() == {(Q, "crash"): 3}


@pytest.mark.parametrize(("code", "said"), [
    (70, "it exited with 70"), (-11, "it was killed by signal 11")])
def test_a_give_back_names_the_slot_that_died_and_how(
    monkeypatch: pytest.MonkeyPatch, code: int, said: str,
) -> None:
    """The jobs' last error said 'SlotDied: its slot died while running it (on HOST slot ,
    ...)': neither which slot nor how."""
    for h in harness(monkeypatch, make_app(Q), {Q: 2}, heartbeat_timeout_s=10_000.0):
        victim, survivor = started(h)
        victim_no = h.slot_of(victim)["slot_no"]
        progress = h.ends[victim].progress
        assert progress is not None
        assert progress.begin(1, Q, 42, [Delivery("poison", b"", 1, 1e9, 1e9,
                                                  "application/json", 42)])
        progress.states[0] = Progress.RUNNING
        h.os.end(victim, code << 8 if code >= 0 else -code)
        h.step()
        [order] = [m for m in h.messages(survivor) if m.kind == "give_back"]
        assert (order.slot, order.died) == (str(victim_no), said)


def test_a_give_back_whose_slot_dies_before_settling_it_goes_to_the_next_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two crashing poison jobs, one per slot: the first dead slot's take was handed to the
    second, which died of its own poison job before settling it. Before, that part was
    dropped once sent, so its jobs waited for lock expiry, which charged the unstarted ones
    (F14 on the embedded broker: an exit job's runs [2, 3], about 1 run in 5)."""
    from qcluster.messages import GaveBack

    for h in harness(monkeypatch, make_app(Q), {Q: 2}, heartbeat_timeout_s=10_000.0):
        victim, survivor = started(h)
        die_running_a_job(h, victim)
        h.step()
        assert h.received(survivor).count("give_back") == 1
        die_running_a_job(h, survivor)  # no GaveBack: it died with the part unsettled
        h.step()
        while len(h.live_pids()) < 2:
            h.step(0.25)
        fresh = h.live_pids()
        h.hello(*fresh)
        h.step()
        handed = [pid for pid in fresh for _ in range(h.received(pid).count("give_back"))]
        assert len(handed) == 2  # the victim's part again, and the survivor's own
        settler = handed[0]
        settled = h.sup.pool.give_backs.handed[settler]
        for part in settled:
            h.say(settler, GaveBack(ref=part.ref))
        h.step()
        assert not h.sup.pool.give_backs.handed[settler]

"""The rolling reload's sequencing (``manager/reloads/rollout.py``, pure): one host at a time, the
next asked only when the previous took the new code or was skipped, a failure stops it.
A table of the steps an operator meets, then hypothesis over whole rollouts of hosts that
take, fail, ignore the request or stop reporting."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.manager.reloads.rollout import (
    TAKE_UP_S,
    Advanced,
    HostSeen,
    Rollout,
    advance,
    start,
    take_up_s,
)
from qcluster.messages import CodeInfo, ReloadState


def seen(reload_id: str = "", state: ReloadState = "idle", *, version: str = "v1",
         generation: int = 0, error: str = "", reporting: bool = True) -> HostSeen:
    return HostSeen(reporting=reporting, code=CodeInfo(
        version=version, generation=generation, state=state, error=error,
        reload_id=reload_id))


def states(rollout: Rollout) -> list[str]:
    return [step.state for step in rollout.steps]


def asked(hosts: list[str], now: float = 0.0) -> Advanced:
    """A rollout over ``hosts`` (all idle on v1) after its first advance."""
    return advance(start("r1", "ops", hosts, now), {h: seen() for h in hosts}, now)


def test_the_first_host_is_asked_alone_with_an_id_of_its_own() -> None:
    first = asked(["a", "b"])
    assert states(first.rollout) == ["asked", "waiting"]
    assert first.asks == (("a", "r1-1"),)
    assert first.reasons == ("reload a: asked",)
    assert first.rollout.steps[0].version_before == "v1"


@pytest.mark.parametrize("state", ["loading", "rolling"])
def test_a_host_loading_or_rolling_is_waited_on(state: ReloadState) -> None:
    rollout = asked(["a", "b"]).rollout
    later = advance(rollout, {"a": seen("r1-1", state), "b": seen()}, 500.0)
    assert states(later.rollout) == ["asked", "waiting"]
    assert later.asks == () and later.reasons == ()


def test_a_host_that_took_it_lets_the_next_be_asked_in_the_same_call() -> None:
    rollout = asked(["a", "b"]).rollout
    later = advance(rollout, {"a": seen("r1-1", version="v2", generation=1), "b": seen()}, 3.0)
    assert states(later.rollout) == ["took", "asked"]
    assert later.asks == (("b", "r1-2"),)
    assert later.reasons == ("reload a: took, version v1 -> v2, generation 1",
                             "reload b: asked")


def test_the_old_id_or_an_idle_report_before_take_up_is_not_taken_for_done() -> None:
    rollout = asked(["a"]).rollout
    for reported in ("", "r0-1"):  # the master has not acted on this request yet
        later = advance(rollout, {"a": seen(reported)}, 5.0)
        assert states(later.rollout) == ["asked"]


def test_a_failure_stops_the_rollout_and_says_who_keeps_the_old_code() -> None:
    rollout = asked(["a", "b", "c"]).rollout
    later = advance(rollout, {"a": seen("r1-1", "failed", error="SyntaxError: bad <b>"),
                              "b": seen(), "c": seen()}, 4.0)
    assert later.rollout.state == "stopped" and later.rollout.ended_at == 4.0
    assert states(later.rollout) == ["failed", "waiting", "waiting"]
    assert later.asks == ()
    assert later.reasons[-1] == later.rollout.note == (
        "reload stopped: a failed: SyntaxError: bad <b>; not asked, still on the old code: "
        "b, c")


def test_a_host_that_stops_reporting_is_skipped_and_the_next_asked() -> None:
    rollout = asked(["a", "b"]).rollout
    later = advance(rollout, {"a": seen("r1-1", "rolling", reporting=False), "b": seen()}, 9.0)
    assert states(later.rollout) == ["skipped", "asked"]
    assert later.rollout.steps[0].note == "stopped reporting"


def test_a_host_that_never_takes_the_request_up_is_skipped_after_the_timeout() -> None:
    rollout = asked(["a", "b"]).rollout
    hosts = {"a": seen(""), "b": seen()}
    assert states(advance(rollout, hosts, TAKE_UP_S).rollout) == ["asked", "waiting"]
    later = advance(rollout, hosts, TAKE_UP_S + 0.1)
    assert states(later.rollout) == ["skipped", "asked"]
    assert "did not take up the reload within 30 s" in later.rollout.steps[0].note
    assert ("a", "") in later.asks  # withdrawn, so a late master does not reload beside b


@pytest.mark.parametrize(("interval_s", "limit_s"), [(2.0, 30.0), (10.0, 30.0), (40.0, 120.0),
                                                    (60.0, 180.0)])
def test_the_take_up_time_covers_three_report_intervals(interval_s: float,
                                                        limit_s: float) -> None:
    """Masters report every [manager] interval_s (up to 60 s): an id sent at one reply is
    shown at the report after. A fixed 30 s skipped every host of a 40 s cluster at the
    first round after asking, and each then reloaded anyway, several at once."""
    assert take_up_s(interval_s) == limit_s
    rollout = asked(["a", "b"]).rollout
    first_round = advance(rollout, {"a": seen(""), "b": seen()}, interval_s, take_up_s(interval_s))
    assert states(first_round.rollout) == ["asked", "waiting"]


def test_a_host_not_reporting_when_its_turn_comes_is_skipped() -> None:
    hosts = {"a": seen(reporting=False), "b": seen()}
    first = advance(start("r1", "ops", ["a", "b", "gone"], 0.0), hosts, 0.0)
    assert states(first.rollout) == ["skipped", "asked", "waiting"]
    done = advance(first.rollout, {**hosts, "b": seen("r1-2", generation=1)}, 2.0)
    assert done.rollout.state == "done"
    assert states(done.rollout) == ["skipped", "took", "skipped"]
    assert done.rollout.note == "reload done: 1 of 3 host(s) took the new code, skipped: a, gone"


def test_done_when_every_host_took_it_and_a_finished_rollout_does_not_move() -> None:
    rollout = asked(["a"]).rollout
    done = advance(rollout, {"a": seen("r1-1", version="v2", generation=1)}, 2.0)
    assert done.rollout.state == "done" and done.rollout.ended_at == 2.0
    assert done.reasons[-1] == "reload done: 1 of 1 host(s) took the new code"
    again = advance(done.rollout, {"a": seen("r1-1", "failed")}, 3.0)
    assert again.rollout == done.rollout and again.reasons == () and again.asks == ()


def test_the_view_is_plain_json() -> None:
    view = asked(["a", "b"]).rollout.view()
    assert view["state"] == "running" and view["by"] == "ops"
    assert [(h["host"], h["state"], h["reload_id"]) for h in view["hosts"]] == [
        ("a", "asked", "r1-1"), ("b", "waiting", "")]


# --- whole rollouts --------------------------------------------------------------


@dataclass
class FakeMaster:
    """A master as the manager sees it: ``behaviour`` is what it does with a request."""

    behaviour: str  # took | failed | ignores | dies
    slow: int  # reports spent loading/rolling
    last_id: str = ""
    working: str = ""
    reports_left: int = 0
    state: ReloadState = "idle"
    generation: int = 0
    reporting: bool = True

    def receive(self, reload_id: str) -> None:
        """The manager's reply carries ``reload_id`` (as Assignment.reload_id)."""
        if not reload_id or reload_id == self.last_id or self.behaviour == "ignores":
            return
        if self.behaviour == "dies":
            self.reporting = False
            return
        self.last_id, self.state, self.reports_left = reload_id, "loading", self.slow

    def tick(self) -> None:
        if self.state in ("loading", "rolling"):
            if self.reports_left > 0:
                self.reports_left -= 1
                self.state = "rolling"
            elif self.behaviour == "failed":
                self.state = "failed"
            else:
                self.state, self.generation = "idle", self.generation + 1

    def seen(self) -> HostSeen:
        return seen(self.last_id, self.state, generation=self.generation,
                    reporting=self.reporting)


behaviours = st.lists(st.tuples(st.sampled_from(["took", "took", "failed", "ignores", "dies"]),
                                st.integers(0, 4)), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(behaviours)
def test_a_rollout_reloads_one_host_at_a_time_and_ends_as_its_hosts_behave(
        script: list[tuple[str, int]]) -> None:
    names = [f"h{n}" for n in range(len(script))]
    masters = {name: FakeMaster(b, slow) for name, (b, slow) in zip(names, script, strict=True)}
    ids: dict[str, str] = {}
    rollout = start("r9", "ops", names, 0.0)
    now = 0.0
    while rollout.running:
        assert now < 100 * (len(names) + 1) * TAKE_UP_S, "the rollout never ended"
        for name, master in masters.items():
            master.receive(ids.get(name, ""))
            master.tick()
        step = advance(rollout, {n: m.seen() for n, m in masters.items()}, now)
        rollout = step.rollout
        ids.update(step.asks)
        order = states(rollout)
        # At most one host asked; every host before it ended, every one after it waits.
        assert order.count("asked") <= 1
        assert order == sorted(order, key=lambda s: s == "waiting")
        assert sum(m.state in ("loading", "rolling") for m in masters.values()) <= 1
        now += 1.0
    expected: list[str] = []
    for behaviour, _ in script:
        expected.append({"took": "took", "failed": "failed", "ignores": "skipped",
                         "dies": "skipped"}[behaviour])
        if behaviour == "failed":
            break
    ended = [s for s in states(rollout) if s != "waiting"]
    assert ended == expected
    assert rollout.state == ("stopped" if "failed" in expected else "done")
    given = [i for i in ids.values() if i]  # "": withdrawn from a skipped host
    assert len(set(given)) == len(given)  # every host asked got an id of its own

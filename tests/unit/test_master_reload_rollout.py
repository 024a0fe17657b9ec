"""The rollout planner (master/rollout.py): tables of single passes, then a property test
that plays whole rollouts (forks starting, saying hello at random, stopped slots leaving
at random) and checks the bounds the issue sets."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.master.reconcile import Action, Fork, LiveSlot, Stop
from qcluster.master.rollout import has_old, in_flight_limit, plan_rollout

NEW = 1


def old(slot_no: int, queue: str = "a", *, idle: bool = False) -> LiveSlot:
    return LiveSlot(slot_no, queue, idle, generation=0)


def new(slot_no: int, queue: str = "a", *, starting: bool = False) -> LiveSlot:
    return LiveSlot(slot_no, queue, starting, generation=NEW, starting=starting)


@pytest.mark.parametrize(("desired", "slots", "limit", "expected"), [
    # all old: one replacement forked above the row
    ({"a": 2}, [old(0), old(1)], 1, [Fork("a")]),
    # the replacement is starting: nothing more for this queue
    ({"a": 2}, [old(0), old(1), new(2, starting=True)], 1, []),
    # it said hello: an old one retires (an idle one first)
    ({"a": 2}, [old(0), old(1, idle=True), new(2)], 1, [Stop(1)]),
    # the replacement is in flight until the retiring one has exited
    ({"a": 2}, [old(0), replace(old(1), stopping=True), new(2)], 1, []),
    ({"a": 2}, [old(0), new(2)], 1, [Fork("a")]),
    # a queue's retiring slot counts against the host's limit too
    ({"a": 1, "b": 1}, [replace(old(0), stopping=True), new(2), old(1, "b")], 1, []),
    ({"a": 1, "b": 1}, [replace(old(0), stopping=True), new(2), old(1, "b")], 2,
     [Fork("b")]),
    # host limit: two queues, one replacement at a time
    ({"a": 1, "b": 1}, [old(0), old(1, "b")], 1, [Fork("a")]),
    ({"a": 1, "b": 1}, [old(0), old(1, "b"), new(2, starting=True)], 1, []),
    ({"a": 1, "b": 1}, [old(0), old(1, "b")], 2, [Fork("a"), Fork("b")]),
    # scaling up during a rollout forks new slots
    ({"a": 3}, [old(0), old(1)], 1, [Fork("a")]),
    ({"a": 4}, [old(0), old(1)], 1, [Fork("a"), Fork("a")]),
    # scaling down stops old slots first
    ({"a": 1}, [old(0), old(1), new(2)], 1, [Stop(1), Stop(0)]),
    ({"a": 0}, [old(0), new(1, starting=True)], 1, [Stop(0), Stop(1)]),
    # a queue dropped from the row: its old slots stop
    ({"b": 1}, [old(0), new(1, "b")], 1, [Stop(0)]),
    # only new slots left above the row: ordinary surplus, idle first
    ({"a": 1}, [new(0), new(1, starting=True)], 1, [Stop(1)]),
    # two replacements starting while the row shrank: one stays in flight
    ({"a": 1}, [old(0), new(1, starting=True), new(2, starting=True)], 1, [Stop(2)]),
])
def test_one_pass(desired: dict[str, int], slots: list[LiveSlot], limit: int,
                  expected: list[Action]) -> None:
    assert plan_rollout(desired, slots, NEW, limit) == expected


def test_in_flight_limit_is_a_quarter_of_the_host_at_least_one() -> None:
    assert in_flight_limit({}) == 1
    assert in_flight_limit({"a": 3}) == 1
    assert in_flight_limit({"a": 8, "b": 4}) == 3
    assert in_flight_limit({"a": 40}) == 10


def test_has_old() -> None:
    assert has_old([old(0), new(1)], NEW) and not has_old([new(1)], NEW)


@dataclass
class Host:
    slots: list[LiveSlot]
    next_no: int = 100

    def apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Fork):
                self.slots.append(new(self.next_no, action.queue, starting=True))
                self.next_no += 1
            elif isinstance(action, Stop):
                self.slots = [replace(s, stopping=True) if s.slot_no == action.slot_no else s
                              for s in self.slots]

    def count(self, queue: str) -> int:
        """Slots of the queue, stopping ones included (processes that still run)."""
        return sum(1 for s in self.slots if s.queue == queue)

    def serving(self, queue: str) -> int:
        """Slots of the queue that take jobs: said hello, not stopping."""
        return sum(1 for s in self.slots if s.queue == queue and not s.stopping
                   and not s.starting)


row_strategy = st.dictionaries(st.sampled_from("abc"), st.integers(0, 6), min_size=1)


@given(row=row_strategy, hellos=st.lists(st.booleans(), min_size=200, max_size=200),
       leaves=st.lists(st.booleans(), min_size=200, max_size=200))
def test_a_rollout_keeps_the_row_serving_bounds_its_flight_and_ends(
    row: dict[str, int], hellos: list[bool], leaves: list[bool]
) -> None:
    host = Host([old(n * 10 + i, q, idle=i % 2 == 0)
                 for n, (q, count) in enumerate(sorted(row.items())) for i in range(count)])
    limit = in_flight_limit(row)
    for step in range(200):
        if not has_old([s for s in host.slots if not s.stopping], NEW):
            break
        actions = plan_rollout(row, host.slots, NEW)
        host.apply(actions)
        assert plan_rollout(row, host.slots, NEW) == []  # twice: nothing new
        for queue, want in row.items():
            assert host.serving(queue) >= want  # never below the row
            # one replacement in flight: a fork above the row, or the old slot it retires
            assert host.count(queue) <= want + 1
        assert len(host.slots) <= sum(row.values()) + limit
        # The world moves: some forks say hello, some stopped slots leave.
        host.slots = [replace(s, starting=False, idle=True) if s.starting and hellos[step]
                      else s for s in host.slots]
        if leaves[step]:
            host.slots = [s for s in host.slots if not s.stopping]
        if step > 150:  # from here on every fork boots at once and every stop completes
            host.slots = [replace(s, starting=False) for s in host.slots if not s.stopping]
    assert not has_old([s for s in host.slots if not s.stopping], NEW)
    assert all(host.serving(q) == n for q, n in row.items())

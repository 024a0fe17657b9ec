"""The capacity formula and the reconcile step: pure, property-tested."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qcluster.master.capacity import CapacityLimits, HostSample, capacity
from qcluster.master.reconcile import Fork, LiveSlot, Stop, Switch, clip_to_capacity, plan_actions

MIB = 1 << 20
LIMITS = CapacityLimits(reserve_bytes=512 * MIB, slot_pss_estimate_bytes=64 * MIB,
                        max_load_per_cpu=4.0, max_slots=256)
samples = st.builds(
    HostSample,
    cpus=st.sampled_from([1.0, 2.0, 8.0]),
    load1=st.floats(0, 64),
    mem_available_bytes=st.integers(0, 64 << 30),
    master_pss_bytes=st.integers(10 * MIB, 500 * MIB),
    slot_pss_bytes=st.lists(st.integers(5 * MIB, 300 * MIB), max_size=40).map(tuple),
    cgroup_memory_free_bytes=st.none() | st.integers(0, 64 << 30),
)


def test_the_seed_formula() -> None:
    sample = HostSample(cpus=2, load1=0.1, mem_available_bytes=1000 * MIB,
                        master_pss_bytes=100 * MIB, slot_pss_bytes=(50 * MIB,) * 4)
    # (300 + 1000 - 512) / (300 / 4) = 788 / 75 = 10.5 -> 10
    assert capacity(sample, LIMITS) == 10


@given(samples)
def test_bounded(sample: HostSample) -> None:
    assert 0 <= capacity(sample, LIMITS) <= LIMITS.max_slots


@given(samples, st.integers(1, 8 << 30))
def test_more_free_memory_never_means_fewer_slots(sample: HostSample, extra: int) -> None:
    richer = HostSample(sample.cpus, sample.load1, sample.mem_available_bytes + extra,
                        sample.master_pss_bytes, sample.slot_pss_bytes, None)
    poorer = HostSample(sample.cpus, sample.load1, sample.mem_available_bytes,
                        sample.master_pss_bytes, sample.slot_pss_bytes, None)
    assert capacity(richer, LIMITS) >= capacity(poorer, LIMITS)


@given(samples)
def test_cgroup_limit_caps_memory(sample: HostSample) -> None:
    unlimited = HostSample(sample.cpus, sample.load1, sample.mem_available_bytes,
                           sample.master_pss_bytes, sample.slot_pss_bytes, None)
    assert capacity(sample, LIMITS) <= capacity(unlimited, LIMITS)


def test_overloaded_cpus_cap_slots() -> None:
    sample = HostSample(cpus=2, load1=50, mem_available_bytes=64 << 30,
                        master_pss_bytes=100 * MIB, slot_pss_bytes=(50 * MIB,) * 4)
    assert capacity(sample, LIMITS) == 8


rows = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 6))
live_slots = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "gone"]), st.booleans()), max_size=12
).map(lambda items: [LiveSlot(n, q, idle) for n, (q, idle) in enumerate(items)])


def apply(actions: list[Fork | Stop | Switch], slots: list[LiveSlot]) -> list[LiveSlot]:
    by_no = {s.slot_no: s for s in slots}
    next_no = max(by_no, default=-1) + 1
    for action in actions:
        if isinstance(action, Fork):
            by_no[next_no] = LiveSlot(next_no, action.queue, True)
            next_no += 1
        elif isinstance(action, Stop):
            del by_no[action.slot_no]
        else:
            by_no[action.slot_no] = LiveSlot(action.slot_no, action.queue, True)
    return list(by_no.values())


@given(rows, live_slots)
def test_reconcile_reaches_the_row_and_is_idempotent(row: dict[str, int],
                                                     slots: list[LiveSlot]) -> None:
    after = apply(plan_actions(row, slots), slots)
    counts: dict[str, int] = {}
    for slot in after:
        counts[slot.queue] = counts.get(slot.queue, 0) + 1
    assert {q: n for q, n in counts.items() if n} == {q: n for q, n in row.items() if n}
    assert plan_actions(row, after) == []


@given(rows, live_slots)
def test_reconcile_moves_idle_slots_before_forking(row: dict[str, int],
                                                   slots: list[LiveSlot]) -> None:
    actions = plan_actions(row, slots)
    if any(isinstance(a, Fork) for a in actions):
        assert not any(isinstance(a, Stop) and next(s for s in slots if s.slot_no == a.slot_no).idle
                       for a in actions)


@given(rows, st.integers(0, 20))
def test_clip_respects_capacity_and_priority(row: dict[str, int], cap: int) -> None:
    priorities = {"a": 5, "b": 1, "c": 0}
    clipped = clip_to_capacity(row, cap, priorities)
    assert sum(clipped.values()) == min(cap, sum(row.values()))
    for high, low in (("a", "b"), ("b", "c")):
        if clipped.get(low, 0) > 0 and high in row:
            assert clipped[high] == row[high]

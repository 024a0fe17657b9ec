"""Which master holds a host name (manager/host_owners.py): a restart never refused, a
second master under the same name refused for as long as both report, the name given back
when its holder falls silent or leaves."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qcluster.manager.host_owners import HostOwners

STALE_S = 6.0
intervals = st.floats(min_value=0.2, max_value=2.0)


@given(intervals, st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=6))
def test_a_master_and_its_restarts_are_never_refused(interval: float, lives: list[int]) -> None:
    """Each life reports some rounds, then a new master (a restart) takes over; the last
    report of the old one may arrive after the new one's first (it was in flight)."""
    owners, now = HostOwners(), 0.0
    for life, rounds in enumerate(lives):
        for done in range(rounds):
            now += interval
            assert owners.refusal("h", f"m{life}", now, STALE_S) is None
            if life and not done:
                assert owners.refusal("h", f"m{life - 1}", now + interval / 2, STALE_S) is None


@given(intervals, st.integers(min_value=2, max_value=40))
def test_a_second_master_under_one_name_is_refused_while_both_report(
        interval: float, rounds: int) -> None:
    owners, now = HostOwners(), 0.0
    assert owners.refusal("h", "first", now, STALE_S) is None
    refused = []
    for _ in range(rounds):
        now += interval
        assert owners.refusal("h", "second", now, STALE_S) is None  # the newer one holds
        why = owners.refusal("h", "first", now + interval / 2, STALE_S)
        refused.append(why)
    assert refused[0] is None  # in flight when the second took over
    assert all(why is not None and "'h' is reported by two masters: second holds it, and "
               "this one is first" in why for why in refused[1:])
    assert owners.refusal("other", "first", now, STALE_S) is None  # per name


@given(intervals)
def test_the_name_is_given_back_when_its_holder_falls_silent_or_leaves(interval: float) -> None:
    owners = HostOwners()
    for now, master in ((0.0, "first"), (interval, "second"), (2 * interval, "second")):
        assert owners.refusal("h", master, now, STALE_S) is None
    assert owners.refusal("h", "first", 3 * interval, STALE_S) is not None
    assert owners.refusal("h", "first", 2 * interval + STALE_S + 0.1, STALE_S) is None
    assert owners.refusal("h", "second", 3 * interval + STALE_S, STALE_S) is None  # back
    owners.forget("h")
    assert owners.refusal("h", "first", 4 * interval + STALE_S, STALE_S) is None


def test_an_older_master_that_names_no_one_is_never_compared() -> None:
    owners = HostOwners()
    assert owners.refusal("h", "first", 0.0, STALE_S) is None
    assert owners.refusal("h", "", 0.5, STALE_S) is None
    assert owners.refusal("h", "first", 1.0, STALE_S) is None

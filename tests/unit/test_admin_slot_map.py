"""The slot map's rows at fleet size (admin_ui.views): the hosts that need a look first, each
host's queues converging first then by size, and nothing lost: every queue with a slot planned
or running on a host is in its row."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from qcluster.admin_ui.views import HOST_ORDER, host_rows, matching
from qcluster.messages import CodeInfo, HostView

counts = st.dictionaries(st.sampled_from([f"q{n}" for n in range(12)]), st.integers(0, 5),
                         max_size=12)
hosts = st.lists(st.builds(
    lambda name, alive, slots, planned, failed: HostView(
        name=name, alive=alive, capacity_slots=10, slots=slots, planned=planned,
        mem_available_bytes=1, pss_total_bytes=1, loadavg=(0.0, 0.0, 0.0),
        last_report_at=0.0, code=CodeInfo(state="failed" if failed else "idle")),
    st.text("abcdefgh", min_size=1, max_size=4), st.booleans(), counts, counts,
    st.booleans()), max_size=12, unique_by=lambda h: h.name)


@given(hosts, st.sets(st.text("abcdefgh", min_size=1, max_size=4), max_size=3))
def test_rows_keep_every_cell_and_put_the_hosts_that_need_a_look_first(
        views: list[HostView], drained: set[str]) -> None:
    rows = host_rows(views, drained)
    assert sorted(r.host.name for r in rows) == sorted(h.name for h in views)
    ranks = [(HOST_ORDER[r.state], r.host.name) for r in rows]
    assert ranks == sorted(ranks)
    for row in rows:
        host = row.host
        wanted = {q for q in set(host.slots) | set(host.planned)
                  if host.slots.get(q, 0) or host.planned.get(q, 0)}
        assert {c.queue for c in row.cells} == wanted
        assert (row.planned, row.running) == (sum(host.planned.values()),
                                              sum(host.slots.values()))
        order = [not c.converging for c in row.cells]
        assert order == sorted(order)  # converging queues first
        if host.name in drained:
            assert row.state == "drained"
        elif not host.alive:
            assert row.state == "dead"


@given(st.lists(st.text(min_size=1, max_size=6), max_size=20), st.text(max_size=3))
def test_matching_is_a_case_insensitive_contains(names: list[str], text: str) -> None:
    found = matching(names, text)
    assert found == [n for n in names if text.strip().lower() in n.lower()]

"""A HistogramTally written to a histogram must record exactly what one observe per value
records (buckets, count, sum), in the multiprocess mode slots write in and in the plain
in-process mode, however the values are split between adds and writes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import Histogram, values

from qcluster.metrics import DURATION_BUCKETS, HistogramTally

a_value = st.one_of(st.sampled_from(DURATION_BUCKETS),
                    st.floats(min_value=0, max_value=1e4, allow_nan=False))
# Batches of values; after each, whether the slot writes (its interval came round).
batches = st.lists(st.tuples(st.lists(a_value, max_size=120), st.booleans()), max_size=8)


def samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value
            for metric in histogram.collect() for s in metric.samples
            if not s.name.endswith("_created")}


def same(seen: list[tuple[list[float], bool]], name: str) -> None:
    one_by_one = Histogram(f"{name}_a", "", ["queue"], buckets=DURATION_BUCKETS, registry=None)
    tallied = Histogram(f"{name}_b", "", ["queue"], buckets=DURATION_BUCKETS, registry=None)
    child, tally = one_by_one.labels("q"), HistogramTally(DURATION_BUCKETS)
    for number, (batch, write) in enumerate(seen):
        for value in batch:
            child.observe(value)
        if number % 2 and batch:
            tally.add(batch[0])  # both ways of adding mix
            tally.add_many(batch[1:])
        else:
            tally.add_many(batch)
        if write:
            tally.write_to(tallied.labels("q"))
    tally.write_to(tallied.labels("q"))  # what a stopping slot does
    expected = {(n.replace("_a_", "_b_"), le): v for (n, le), v in samples(one_by_one).items()}
    got = samples(tallied)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


@settings(max_examples=60, deadline=None)
@given(batches)
def test_a_tally_records_what_observe_records_in_process(seen: list[tuple[list[float], bool]]
                                                          ) -> None:
    same(seen, "inproc")


@settings(max_examples=30, deadline=None)
@given(seen=batches)
def test_a_tally_records_what_observe_records_multiprocess(
        seen: list[tuple[list[float], bool]], tmp_path_factory: pytest.TempPathFactory) -> None:
    directory = tmp_path_factory.mktemp("prom")
    saved = values.ValueClass
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        values.ValueClass = values.MultiProcessValue(process_identifier=lambda: "slot1")
        try:
            same(seen, "multi")
            assert list(directory.glob("histogram_slot1.db")), "values were not mmap'ed"
        finally:
            values.ValueClass = saved


def test_a_wait_below_the_floor_counts_as_the_floor() -> None:
    histogram = Histogram("waits", "", ["queue"], buckets=DURATION_BUCKETS, registry=None)
    tally = HistogramTally(DURATION_BUCKETS, floor=0.0)
    tally.add_many([-0.5, 0.002])
    tally.add(-1.0)
    tally.write_to(histogram.labels("q"))
    got = samples(histogram)
    assert got[("waits_bucket", "0.001")] == 2
    assert got[("waits_count", "")] == 3
    assert got[("waits_sum", "")] == pytest.approx(0.002)


def test_a_tally_refuses_a_histogram_with_other_buckets() -> None:
    other = Histogram("other", "", ["queue"], buckets=(1, 2), registry=None)
    tally = HistogramTally(DURATION_BUCKETS)
    tally.add(0.1)
    with pytest.raises(TypeError):
        tally.write_to(other.labels("q"))

"""observe_many must record exactly what one observe per value records (buckets, count,
sum), in the multiprocess mode slots write in and in the plain in-process mode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import Histogram, values

from qcluster.metrics import DURATION_BUCKETS, observe_many

waits = st.lists(
    st.one_of(st.sampled_from(DURATION_BUCKETS),
              st.floats(min_value=0, max_value=1e4, allow_nan=False)),
    max_size=200)


def samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value
            for metric in histogram.collect() for s in metric.samples
            if not s.name.endswith("_created")}


def same(values_seen: list[float], name: str) -> None:
    one_by_one = Histogram(f"{name}_a", "", ["queue"], buckets=DURATION_BUCKETS, registry=None)
    bulk = Histogram(f"{name}_b", "", ["queue"], buckets=DURATION_BUCKETS, registry=None)
    child = one_by_one.labels("q")
    for value in values_seen:
        child.observe(value)
    observe_many(bulk.labels("q"), values_seen)
    expected = {(n.replace("_a_", "_b_"), le): v for (n, le), v in samples(one_by_one).items()}
    got = samples(bulk)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


@settings(max_examples=60, deadline=None)
@given(waits)
def test_observe_many_matches_observe_in_process(values_seen: list[float]) -> None:
    same(values_seen, "inproc")


@settings(max_examples=30, deadline=None)
@given(values_seen=waits)
def test_observe_many_matches_observe_multiprocess(values_seen: list[float],
                                                  tmp_path_factory: pytest.TempPathFactory
                                                  ) -> None:
    directory = tmp_path_factory.mktemp("prom")
    saved = values.ValueClass
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        values.ValueClass = values.MultiProcessValue(process_identifier=lambda: "slot1")
        try:
            same(values_seen, "multi")
            assert list(directory.glob("histogram_slot1.db")), "values were not mmap'ed"
        finally:
            values.ValueClass = saved


def test_observe_many_falls_back_to_observe() -> None:
    class Plain:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, value: float) -> None:
            self.seen.append(value)

    plain = Plain()
    observe_many(plain, [0.1, 2.0])
    assert plain.seen == [0.1, 2.0]

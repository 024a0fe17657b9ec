"""L4's memory rule (tests/chaos/soak.py) on synthetic timelines: copy-on-write convergence
in the warm-up passes, a steady leak fails even when it stays under the budget from the
warm-up baseline, and the trend estimate shrugs off a few outliers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.chaos import soak

SOAK_S = 1800.0
MIB = float(1 << 20)


def timeline(level: float, *, converge_mib: float = 0.0, leak_mib_min: float = 0.0,
             noise: list[float] | None = None) -> list[tuple[float, float]]:
    """A sample every 10 s: ``level`` MiB, plus a climb of ``converge_mib`` over the first
    10 minutes (slots converging), plus a steady leak, plus a repeating noise pattern."""
    points = []
    for n, t in enumerate(range(0, int(SOAK_S), 10)):
        minutes = t / 60
        value = level + converge_mib * min(minutes, 10.0) / 10 + leak_mib_min * minutes
        if noise:
            value += noise[n % len(noise)]
        points.append((float(t), value * MIB))
    return points


@given(level=st.floats(50, 500), converge=st.floats(0, 30),
       noise=st.lists(st.floats(-1.5, 1.5), min_size=1, max_size=7))
def test_convergence_in_the_warm_up_passes(level: float, converge: float,
                                           noise: list[float]) -> None:
    verdict = soak.judge(timeline(level, converge_mib=converge, noise=noise), SOAK_S)
    assert verdict.ok, verdict
    assert verdict.growth_from_start >= verdict.growth_from_warm - 3.0 / level


@given(level=st.floats(50, 200), rate=st.floats(0.2, 2.0))
def test_a_steady_leak_of_the_budget_per_soak_fails(level: float, rate: float) -> None:
    """A leak of more than 10% of the baseline per soak length (the budget) fails, on the
    trend if not on the growth from the warm-up baseline."""
    leak_mib_min = level * 0.1 / 30 * (1 + rate)
    verdict = soak.judge(timeline(level, leak_mib_min=leak_mib_min), SOAK_S)
    assert not verdict.ok, verdict
    assert verdict.trend > soak.TREND_MAX


def test_the_soak_of_2026_11_24_passes_from_the_warm_up_and_not_from_the_start() -> None:
    """The whole make chaos run's shape: 104.6 MiB at 90 s, 114.5 at 10 min, 116 at 30."""
    def mib(t: float) -> float:
        return 104.6 + 9.9 * min(max(t - 90, 0), 510) / 510 + 1.5 * max(t - 600, 0) / 1200

    points = [(float(t), mib(t) * MIB) for t in range(0, 1800, 10)]
    verdict = soak.judge(points, SOAK_S)
    assert verdict.growth_from_start > soak.GROWTH_MAX  # the old rule's verdict
    assert verdict.ok and verdict.growth_from_warm < 0.02, verdict


def test_theil_sen_ignores_a_few_outliers() -> None:
    points = [(float(t), 100.0) for t in range(20)]
    points[3] = (3.0, 1000.0)
    points[15] = (15.0, -500.0)
    assert soak.theil_sen_slope(points) == 0.0
    assert soak.theil_sen_slope([(1.0, 5.0)]) == 0.0


def test_per_minute_keeps_the_first_sample_of_each_minute() -> None:
    points = [(0.0, MIB), (30.0, 2 * MIB), (61.0, 3 * MIB), (185.0, 4 * MIB)]
    assert soak.per_minute(points) == [1.0, 3.0, 4.0]

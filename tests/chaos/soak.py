"""L4's memory rule: growth after a warm-up, and flat after it (docs/chaos.md, L4).

A freshly forked slot shares its master's pages and copies them one by one as it touches
them (copy-on-write), so a host's PSS climbs for minutes after every fork and then stays
flat; a slot re-forked after a fault starts that climb again. Measured from the first
minutes, that convergence reads as growth (the 30-minute soak of 2026-11-24: +10.9% from
90 s, of which +6.3% in the first 10 minutes and flat after). A leak check therefore
measures from a baseline taken after a warm-up, the first third of the soak (as leak checks
usually do), and adds a second check that a warm-up cannot hide: the trend after the
warm-up (Theil-Sen slope of the last two thirds, robust to the saw-tooth of re-forked
slots), projected over the soak's length, stays within the same budget. Growth from the
first samples is reported too.

The trend is taken over the whole time after the warm-up rather than the last third
alone: on the 30-minute re-run of 2026-11-24 (flat 5-minute medians: 113.7, 114.3, 114.4,
113.9, 114.9 MiB) the slope of a 10-minute window, projected over 30 minutes, ranged from
+0.9% to +7% by where the window started (+10% for 5-minute windows), while after the
warm-up it measured +1.0% to +2.7% from minutes 10 to 15 on: projecting a short window
triples its noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: Growth allowed from the warm-up baseline to the end of the soak.
GROWTH_MAX = 0.10
#: Growth allowed at the rate after the warm-up over one soak's length (a leak as fast as
#: the budget per soak fails this even if the warm-up baseline happened to be high).
TREND_MAX = 0.10
#: The first samples are taken from here: the slots are forked and the manager's 60 s
#: window is full.
START_S = 90.0
#: Samples in each median (start, warm-up and end figures).
SPAN = 3


@dataclass(frozen=True)
class MemoryVerdict:
    """One series' figures, in bytes and fractions of the warm-up baseline."""

    start: float  # median of the first samples from START_S
    warm: float  # median of the first samples after the warm-up (a third of the soak)
    end: float  # median of the last samples
    growth_from_start: float  # end / start - 1: reported, not asserted
    growth_from_warm: float  # end / warm - 1: <= GROWTH_MAX
    trend: float  # slope after the warm-up x soak length / warm: <= TREND_MAX

    @property
    def ok(self) -> bool:
        return self.growth_from_warm <= GROWTH_MAX and self.trend <= TREND_MAX


def theil_sen_slope(points: Sequence[tuple[float, float]]) -> float:
    """The median of the slopes between every two points of distinct times (0 if none)."""
    slopes = [(y2 - y1) / (x2 - x1)
              for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1]
    return statistics.median(slopes) if slopes else 0.0


def _median_from(points: Sequence[tuple[float, float]], t: float) -> float:
    after = [y for x, y in points if x >= t][:SPAN] or [points[-1][1]]
    return statistics.median(after)


def judge(points: Sequence[tuple[float, float]], duration_s: float) -> MemoryVerdict:
    """The rule for one series of (seconds since the soak began, bytes) samples, in time
    order, over a soak of ``duration_s``."""
    if not points:
        raise ValueError("no memory samples")
    start_at = min(START_S, duration_s / 3)
    warm_at = max(start_at, duration_s / 3)
    start = _median_from(points, start_at)
    warm = _median_from(points, warm_at)
    end = statistics.median(y for _, y in points[-SPAN:])
    after_warm = [(x, y) for x, y in points if x >= warm_at] or list(points[-SPAN:])
    trend = theil_sen_slope(after_warm) * duration_s / warm if warm > 0 else 0.0

    def ratio(base: float) -> float:
        return round(end / base - 1, 3) if base > 0 else 0.0

    return MemoryVerdict(start=start, warm=warm, end=end, growth_from_start=ratio(start),
                         growth_from_warm=ratio(warm), trend=round(trend, 3))


def per_minute(points: Sequence[tuple[float, float]]) -> list[float]:
    """The first sample of each minute, in MiB (the timeline kept in the row's line)."""
    seen: dict[int, float] = {}
    for x, y in points:
        seen.setdefault(int(x // 60), round(y / (1 << 20), 1))
    return [seen[minute] for minute in sorted(seen)]

"""Inline SVG line charts, drawn on the server: no JavaScript, no chart library.

Pure functions from points to an SVG string, so the queue page renders the same with
JavaScript disabled and the charts can be unit-tested as text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH = 560
HEIGHT = 150
PAD_LEFT = 48
PAD_RIGHT = 8
PAD_TOP = 10
PAD_BOTTOM = 22


@dataclass(frozen=True)
class Series:
    """One line: a label, a CSS colour and (x, y) points with x in seconds."""

    label: str
    color: str
    points: Sequence[tuple[float, float]]


def _bounds(series: Sequence[Series]) -> tuple[float, float, float]:
    """(first x, x span, top y): a span of 0 (one instant) becomes 1 so nothing divides by 0."""
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x_min, span = min(xs), max(xs) - min(xs)
    y_max = max(ys) if ys else 0.0
    return x_min, span if span > 0 else 1.0, y_max if y_max > 0 else 1.0


def _clean(series: Series) -> Series:
    points = [(x, max(0.0, y)) for x, y in series.points if math.isfinite(x) and math.isfinite(y)]
    return Series(series.label, series.color, points)


def _format(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 1_000:
        return f"{value / 1_000:.1f}k"
    return f"{value:.3g}"


def line_chart(title: str, series: Sequence[Series], *, unit: str = "") -> str:
    """An SVG chart of ``series`` sharing one y axis starting at 0; a note when empty.

    Non-finite points are dropped and negative values drawn at 0, so one bad sample can
    never push a line out of the picture.
    """
    drawable = [s for s in map(_clean, series) if s.points]
    head = (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{escape(title)}</title>"
    )
    if not drawable:
        return (
            head + f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" '
            'class="chart-empty">no data yet</text></svg>'
        )
    x_min, span, y_max = _bounds(drawable)
    plot_w = WIDTH - PAD_LEFT - PAD_RIGHT
    plot_h = HEIGHT - PAD_TOP - PAD_BOTTOM

    def sx(x: float) -> float:
        return PAD_LEFT + (x - x_min) / span * plot_w

    def sy(y: float) -> float:
        return PAD_TOP + plot_h - (y / y_max) * plot_h

    parts = [head, _axes(y_max, unit, plot_h, span)]
    for index, one in enumerate(drawable):
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in one.points)
        parts.append(
            f'<polyline fill="none" stroke="{escape(one.color)}" stroke-width="1.6" '
            f'points="{coords}"><title>{escape(one.label)}</title></polyline>'
        )
        parts.append(
            f'<text x="{PAD_LEFT + 6 + index * 130}" y="{PAD_TOP + 10}" '
            f'fill="{escape(one.color)}" class="chart-legend">{escape(one.label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _span(seconds: float) -> str:
    """How far back the left edge is: '-45s', '-12 min'."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f} min"


def _axes(y_max: float, unit: str, plot_h: float, span_s: float) -> str:
    bottom = PAD_TOP + plot_h
    return (
        f'<line x1="{PAD_LEFT}" y1="{bottom}" x2="{WIDTH - PAD_RIGHT}" y2="{bottom}" '
        'class="chart-axis"/>'
        f'<line x1="{PAD_LEFT}" y1="{PAD_TOP}" x2="{PAD_LEFT}" y2="{bottom}" class="chart-axis"/>'
        f'<text x="{PAD_LEFT - 4}" y="{PAD_TOP + 8}" text-anchor="end" class="chart-tick">'
        f"{escape(_format(y_max))}{escape(unit)}</text>"
        f'<text x="{PAD_LEFT - 4}" y="{bottom}" text-anchor="end" class="chart-tick">0</text>'
        f'<text x="{PAD_LEFT}" y="{HEIGHT - 6}" class="chart-tick">'
        f"-{_span(span_s)}</text>"
        f'<text x="{WIDTH - PAD_RIGHT}" y="{HEIGHT - 6}" text-anchor="end" class="chart-tick">'
        "now</text>"
    )

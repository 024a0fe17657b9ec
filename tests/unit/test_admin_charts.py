"""The server-side SVG charts of the queue page: valid SVG, lines inside the picture."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from hypothesis import given
from hypothesis import strategies as st

from qcluster.admin_ui.charts import HEIGHT, PAD_LEFT, PAD_TOP, WIDTH, Series, line_chart

SVG = "{http://www.w3.org/2000/svg}"
finite = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False)
points = st.lists(st.tuples(finite, finite), max_size=40)
# Seconds and counts: large, but never near the float limits; plus NaN and infinities.
odd = st.one_of(finite, st.sampled_from([math.nan, math.inf, -math.inf]))
anything = st.lists(st.tuples(odd, odd), max_size=20)


def polylines(svg: str) -> list[list[tuple[float, float]]]:
    root = ET.fromstring(svg)  # raises on anything that is not well-formed XML
    return [
        [(float(x), float(y)) for x, y in (p.split(",") for p in line.get("points", "").split())]
        for line in root.iter(f"{SVG}polyline")
    ]


@given(st.lists(points, min_size=1, max_size=3))
def test_every_point_is_drawn_inside_the_picture(many: list[list[tuple[float, float]]]) -> None:
    svg = line_chart("t", [Series(f"s{i}", "#000", p) for i, p in enumerate(many)])
    lines = polylines(svg)
    assert len(lines) == sum(1 for p in many if p)
    for line in lines:
        for x, y in line:
            assert 0 <= x <= WIDTH and 0 <= y <= HEIGHT


@given(st.lists(st.tuples(finite, st.floats(min_value=0, max_value=1e9)), min_size=2, max_size=40))
def test_the_highest_point_touches_the_top_and_time_runs_left_to_right(
    data: list[tuple[float, float]],
) -> None:
    (line,) = polylines(line_chart("t", [Series("s", "#000", data)]))
    top = min(y for _, y in line)
    if max(y for _, y in data) > 0:
        assert math.isclose(top, PAD_TOP, abs_tol=0.06)
    earliest = min(range(len(data)), key=lambda i: data[i][0])
    assert math.isclose(line[earliest][0], PAD_LEFT, abs_tol=0.06)


@given(anything)
def test_nan_and_infinity_never_break_the_svg(data: list[tuple[float, float]]) -> None:
    svg = line_chart("t", [Series("s", "#000", data)])
    for line in polylines(svg):
        assert all(math.isfinite(x) and math.isfinite(y) for x, y in line)


def test_labels_title_and_unit_are_escaped() -> None:
    svg = line_chart('<script>"x"', [Series("a&b", '"red', [(0.0, 1.0)])], unit="<u>")
    assert "<script>" not in svg and "&lt;script&gt;" in svg and "a&amp;b" in svg
    ET.fromstring(svg)


def test_no_points_says_so() -> None:
    svg = line_chart("empty", [Series("x", "#000", []), Series("y", "#000", [(math.nan, 1.0)])])
    assert "no data yet" in svg and not polylines(svg)


def test_the_time_axis_reads_in_seconds_then_minutes() -> None:
    assert ">-45s</text>" in line_chart("t", [Series("s", "#000", [(-45.0, 1.0), (0.0, 2.0)])])
    assert ">-60 min</text>" in line_chart("t", [Series("s", "#000", [(-3600.0, 1.0), (0, 2)])])

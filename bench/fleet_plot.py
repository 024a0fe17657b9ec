"""The fleet bench's figures as one SVG picture (no plotting library): a panel per figure,
its value against the masters, one line per queue count, the target as a dashed line.

    python -m bench.fleet_plot [bench/results/fleet.json] [docs/img/fleet-growth.svg]

``python -m bench.fleet`` writes it after each run."""

from __future__ import annotations

import json
import sys
from html import escape
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PICTURE = ROOT / "docs" / "img" / "fleet-growth.svg"
#: (key in a row, title, target or None): the figures the targets are about, and the
#: planning round's CPU they grow from.
PANELS = (
    ("manager_core_share", "manager CPU, share of a core", 0.15),
    ("round_cpu_ms_median", "planning round CPU, ms (median)", None),
    ("report_p50_ms", "report reply p50, ms", None),
    ("report_p99_ms", "report reply p99, ms", 50.0),
    ("cluster_json_kib", "/api/v1/cluster, KiB", 1024.0),
    ("overview_load_s", "admin overview in Chromium, s", 1.0),
)
COLOURS = ("#2c7be5", "#c0392b", "#2e9d58", "#8e44ad")
PANEL_W, PANEL_H, COLUMNS = 300, 190, 3
PAD_L, PAD_R, PAD_T, PAD_B = 52, 14, 30, 34


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _panel(rows: list[dict[str, Any]], key: str, title: str, target: float | None,
           x0: float, y0: float) -> list[str]:
    queues = sorted({row["queues"] for row in rows})
    masters = sorted({row["masters"] for row in rows})
    values = [row[key] for row in rows if isinstance(row.get(key), int | float)]
    top = max([*values, *([target] if target is not None else []), 1e-9]) * 1.1
    plot_w, plot_h = PANEL_W - PAD_L - PAD_R, PANEL_H - PAD_T - PAD_B

    def sx(m: int) -> float:
        if len(masters) == 1:
            return x0 + PAD_L + plot_w / 2
        return x0 + PAD_L + (m - masters[0]) / (masters[-1] - masters[0]) * plot_w

    def sy(v: float) -> float:
        return y0 + PAD_T + plot_h - v / top * plot_h

    bottom = y0 + PAD_T + plot_h
    parts = [f'<text x="{x0 + PAD_L}" y="{y0 + 18}" class="title">{escape(title)}</text>',
             f'<line x1="{x0 + PAD_L}" y1="{bottom}" x2="{x0 + PAD_L + plot_w}" '
             f'y2="{bottom}" class="axis"/>',
             f'<line x1="{x0 + PAD_L}" y1="{y0 + PAD_T}" x2="{x0 + PAD_L}" y2="{bottom}" '
             'class="axis"/>',
             f'<text x="{x0 + PAD_L - 4}" y="{y0 + PAD_T + 8}" class="tick" '
             f'text-anchor="end">{_number(top)}</text>',
             f'<text x="{x0 + PAD_L - 4}" y="{bottom}" class="tick" text-anchor="end">0</text>']
    for m in masters:
        parts.append(f'<text x="{sx(m):.1f}" y="{bottom + 14}" class="tick" '
                     f'text-anchor="middle">{m}</text>')
    parts.append(f'<text x="{x0 + PAD_L + plot_w / 2}" y="{bottom + 28}" class="tick" '
                 'text-anchor="middle">masters</text>')
    if target is not None:
        parts.append(f'<line x1="{x0 + PAD_L}" y1="{sy(target):.1f}" '
                     f'x2="{x0 + PAD_L + plot_w}" y2="{sy(target):.1f}" class="target">'
                     f'<title>target {_number(target)}</title></line>')
    for index, count in enumerate(queues):
        colour = COLOURS[index % len(COLOURS)]
        points = [(sx(row["masters"]), sy(row[key])) for row in
                  sorted(rows, key=lambda r: r["masters"])
                  if row["queues"] == count and isinstance(row.get(key), int | float)]
        if len(points) > 1:
            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" '
                         'stroke-width="2"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>'
                  for x, y in points]
    return parts


def svg(rows: list[dict[str, Any]], caption: str = "") -> str:
    """The picture of ``rows`` (bench/results/fleet.json's)."""
    lines = (len(PANELS) + COLUMNS - 1) // COLUMNS
    width, height = PANEL_W * COLUMNS, PANEL_H * lines + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
             "<style>.title{font-size:12px;font-weight:600;fill:#1d2330}"
             ".tick{font-size:10px;fill:#6b7280}.axis{stroke:#9aa5b1}"
             ".target{stroke:#6b7280;stroke-dasharray:4 3}</style>",
             f'<rect width="{width}" height="{height}" fill="#fff"/>']
    for index, (key, title, target) in enumerate(PANELS):
        parts += _panel(rows, key, title, target, index % COLUMNS * PANEL_W,
                        index // COLUMNS * PANEL_H)
    legend_y = PANEL_H * lines + 16
    for index, count in enumerate(sorted({row["queues"] for row in rows})):
        colour = COLOURS[index % len(COLOURS)]
        parts.append(f'<rect x="{PAD_L + index * 110}" y="{legend_y - 9}" width="12" '
                     f'height="4" fill="{colour}"/><text x="{PAD_L + 16 + index * 110}" '
                     f'y="{legend_y - 4}" class="tick">{count} queues</text>')
    parts.append(f'<text x="{PAD_L + 240}" y="{legend_y - 4}" class="tick">- - target · '
                 f'{escape(caption)}</text>')
    return "\n".join([*parts, "</svg>"]) + "\n"


def write(result: dict[str, Any], path: Path = PICTURE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg(result["rows"], f"{result.get('command', '')}, {result.get('when', '')}"))
    return path


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    source = Path(args[0]) if args else ROOT / "bench" / "results" / "fleet.json"
    print(write(json.loads(source.read_text()), Path(args[1]) if len(args) > 1 else PICTURE))


if __name__ == "__main__":
    main()

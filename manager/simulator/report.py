"""The figures as a table (terminal), JSON, or one self-contained HTML page (inline SVG)."""

from __future__ import annotations

import html
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from qcluster.manager.simulator.engine import SimulationResult
from qcluster.manager.simulator.figures import figures

COLUMNS = [
    ("wait_p50_s", "p50 wait s"), ("wait_p99_s", "p99 wait s"), ("wait_max_s", "max wait s"),
    ("max_backlog", "max backlog"), ("slot_seconds", "slot-s"), ("slack", "slack"),
    ("slot_moves", "slot moves"),
    ("plan_moves", "plan moves"), ("burst_drain_max_s", "burst drain max s"),
    ("over_target_s", "over target s"),
]
COLORS = {"qcluster": "#1f77b4", "hpa": "#d62728", "static": "#7f7f7f"}


def _cell(value: Any) -> str:
    """A figure as the table shows it: whole numbers without a decimal (16, not 16.0, beside
    9), others to 0.1 from 10 on."""
    if isinstance(value, float):
        return f"{value:,.1f}".removesuffix(".0") if abs(value) >= 10 else f"{value:g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _recovery_text(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['back_within_target_s']:g}s ({r['rounds_after_noticed']} rounds)"
                     for r in rows)


def table_rows(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for policy, body in data["policies"].items():
        rows.append([policy, "(all)", *(_cell(body["overall"][k]) for k, _ in COLUMNS), ""])
        for queue, fig in body["queues"].items():
            rows.append([policy, queue, *(_cell(fig[k]) for k, _ in COLUMNS),
                         _recovery_text(fig["recovery"])])
    return rows


HEADER = ["policy", "queue", *(title for _, title in COLUMNS), "back within target"]


def print_table(result: SimulationResult, console: Console | None = None) -> dict[str, Any]:
    data = figures(result)
    table = Table(title=f"simulated {data['duration_s']:g}s, seed {data['seed']}")
    for title in HEADER:
        table.add_column(title, justify="left" if title in ("policy", "queue") else "right")
    for row in table_rows(data):
        table.add_row(*row)
    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: no terminal width to fit
            console = Console(width=200)
    console.print(table)
    return data


def to_json(result: SimulationResult) -> str:
    return json.dumps(figures(result), indent=2)


# --- HTML ------------------------------------------------------------------------

CHART_W, CHART_H, PAD = 420, 170, 48


def _polyline(ts: list[float], ys: list[float], t_max: float, y_max: float, color: str) -> str:
    if not ts:
        return ""
    sx = (CHART_W - PAD - 8) / (t_max or 1)
    sy = (CHART_H - PAD) / (y_max or 1)
    points = " ".join(f"{PAD + t * sx:.1f},{CHART_H - PAD + 8 - y * sy:.1f}"
                      for t, y in zip(ts, ys, strict=True))
    return (f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
            f'points="{points}"/>')


def _short(value: float) -> str:
    """An axis label that fits: 40k, 3.5, 1.2M."""
    for size, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def _chart(title: str, lines: dict[str, tuple[list[float], list[float]]], t_max: float) -> str:
    y_max = max((max(ys, default=0) for _, ys in lines.values()), default=0) or 1
    body = "".join(_polyline(ts, ys, t_max, y_max, COLORS.get(p, "#2ca02c"))
                   for p, (ts, ys) in lines.items())
    base = CHART_H - PAD + 8
    axes = (f'<line x1="{PAD}" y1="{base}" x2="{CHART_W - 8}" y2="{base}" stroke="#999"/>'
            f'<line x1="{PAD}" y1="8" x2="{PAD}" y2="{base}" stroke="#999"/>'
            f'<text x="{PAD - 4}" y="14" text-anchor="end">{_short(y_max)}</text>'
            f'<text x="{PAD - 4}" y="{base}" text-anchor="end">0</text>'
            f'<text x="{CHART_W - 8}" y="{base + 14}" text-anchor="end">{t_max:,.0f}s</text>')
    return (f'<figure><figcaption>{html.escape(title)}</figcaption>'
            f'<svg width="{CHART_W}" height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}">'
            f'{axes}{body}</svg></figure>')


def to_html(result: SimulationResult, title: str = "qcluster simulate") -> str:
    data = figures(result)
    t_max = result.trace.duration_s
    legend = " ".join(f'<span style="color:{COLORS.get(p, "#2ca02c")}">&#9632; {p}</span>'
                      for p in result.runs)
    sections = []
    for queue in sorted(next(iter(result.runs.values())).queues):
        charts = []
        for label, attr in (("backlog (jobs)", "backlog"), ("slots", "slots"),
                            ("oldest job's wait (s)", "wait")):
            lines = {}
            for policy, run in result.runs.items():
                series = run.queues[queue].series
                lines[policy] = (series.t, [float(v) for v in getattr(series, attr)])
            charts.append(_chart(f"{queue}: {label}", lines, t_max))
        sections.append(f'<section><h2>{html.escape(queue)}</h2>'
                        f'<div class="charts">{"".join(charts)}</div></section>')
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in table_rows(data))
    style = ("body{font:13px system-ui,sans-serif;margin:16px;color:#222}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;"
             "text-align:right}td:nth-child(-n+2),th:nth-child(-n+2){text-align:left}"
             ".charts{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0}"
             "figcaption{font-weight:600}svg text{font-size:10px;fill:#555}"
             "h2{margin:14px 0 4px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>simulated {data['duration_s']:g}s, planning every {data['interval_s']:g}s, "
            f"seed {data['seed']}. {legend}</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
            f"{''.join(sections)}</body></html>")

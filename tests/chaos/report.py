"""tests/chaos/results/latest.jsonl (the rows' JSON lines) -> latest.md (a Markdown table).

    python -m tests.chaos.report [LATEST_JSONL] [OUTPUT_MD]

One table row per chaos row and broker (the last line wins when a row ran twice), in the
order the rows ran; the columns are the issue's fields, the residue summed (its parts in
the notes when not 0), the row-specific figures as notes, and the run the line comes from
(``run``, numbered; the runs are named above the table when the file merges several, e.g. a
row re-run alone after a whole ``make chaos``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
COLUMNS = ["row", "broker", "seed", "attempted", "acknowledged", "completed", "lost",
           "unexpected", "dup_exec", "dead", "faults", "recovery_p99_s", "throughput_jobs_s",
           "p99_latency_s", "residue", "wall_s"]


def load(path: Path) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for raw in path.read_text().splitlines():
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        key = (str(line.get("row")), str(line.get("broker")))
        rows.pop(key, None)  # a rerun moves to the end, where it ran
        rows[key] = line
    return list(rows.values())


def run_of(line: dict[str, Any]) -> str:
    """Which run the line comes from (lines written before runs were named: unknown)."""
    return str(line.get("run") or "unnamed run")


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {cell(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(cell(v) for v in value) + "]"
    return str(value).replace("|", "\\|")


def render(lines: list[dict[str, Any]]) -> str:
    out = ["# Chaos suite: latest results", "",
           "Written by `tests/chaos/report.py` from `latest.jsonl` (`make chaos`). "
           "What each row does and its threshold: docs/chaos.md.", ""]
    profiles = sorted({str(line.get("profile", "?")) for line in lines})
    out += [f"Profile: {', '.join(profiles)}. Rows: {len(lines)}.", ""]
    runs = list(dict.fromkeys(run_of(line) for line in lines))
    if len(runs) > 1:
        out += ["Runs (a row re-run alone replaces its line from the whole run):", ""]
        out += [f"{n}. {run}: {sum(1 for line in lines if run_of(line) == run)} rows"
                for n, run in enumerate(runs, 1)]
        out.append("")
    out.append("| " + " | ".join([*COLUMNS, "notes", "run"]) + " |")
    out.append("|" + "---|" * (len(COLUMNS) + 2))
    for line in lines:
        cells = []
        for column in COLUMNS:
            value = line.get(column)
            if column == "residue" and isinstance(value, dict):
                value = sum(int(v) for v in value.values())
            cells.append(cell(value))
        notes = dict(line.get("extra") or {})
        residue = line.get("residue")
        if isinstance(residue, dict) and any(residue.values()):
            notes["residue"] = residue
        cells.append("; ".join(f"{k}: {cell(v)}" for k, v in notes.items()))
        cells.append(str(runs.index(run_of(line)) + 1))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else RESULTS_DIR / "latest.jsonl"
    target = Path(argv[1]) if len(argv) > 1 else source.with_suffix(".md")
    if not source.exists():
        print(f"no {source}: run make chaos first", file=sys.stderr)
        return 1
    lines = load(source)
    target.write_text(render(lines))
    print(f"{target}: {len(lines)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

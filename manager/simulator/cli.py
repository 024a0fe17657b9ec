"""``qcluster simulate --trace FILE``: the policies side by side on one trace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from qcluster.manager.simulator.engine import simulate as run_simulation
from qcluster.manager.simulator.policies import POLICIES
from qcluster.manager.simulator.report import print_table, to_html, to_json
from qcluster.manager.simulator.trace import TraceError, load_trace

err = Console(stderr=True)


def simulate(
    trace: Annotated[Path, typer.Option("--trace", help="Trace (JSON) or manager recording "
                                                        "(JSON Lines)")],
    policy: Annotated[list[str] | None, typer.Option(
        "--policy", help="qcluster, hpa or static; repeat for several (default: all)")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Same seed, same result")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Figures as JSON")] = False,
    html_out: Annotated[Path | None, typer.Option(
        "--html", help="Write a self-contained HTML report here")] = None,
) -> None:
    """Simulate the manager's planning (and baselines) on a trace; print the figures."""
    chosen = policy or list(POLICIES)
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown:
        err.print(f"error: unknown policy {unknown[0]!r}: choose from {', '.join(POLICIES)}")
        raise typer.Exit(2)
    try:
        loaded = load_trace(trace)
    except TraceError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    result = run_simulation(loaded, chosen, seed)
    if html_out is not None:
        html_out.write_text(to_html(result, f"qcluster simulate {trace.name}"))
    if as_json:
        typer.echo(to_json(result))
    else:
        print_table(result)
        if html_out is not None:
            err.print(f"report written to {html_out}")

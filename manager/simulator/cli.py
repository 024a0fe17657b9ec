"""``qcluster simulate --trace FILE``: the policies side by side on one trace."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qcluster.config import load_settings
from qcluster.errors import ConfigError
from qcluster.manager.simulator.engine import SimulationResult
from qcluster.manager.simulator.engine import simulate as run_simulation
from qcluster.manager.simulator.policies import POLICIES
from qcluster.manager.simulator.report import print_table, to_html, to_json
from qcluster.manager.simulator.trace import Trace, TraceError, load_trace, with_settings

err = Console(stderr=True)
#: The progress bar moves every this many simulated rounds.
PROGRESS_EVERY = 100


def simulate(
    trace: Annotated[Path, typer.Option("--trace", help="Trace (JSON) or manager recording "
                                                        "(JSON Lines)")],
    policy: Annotated[list[str] | None, typer.Option(
        "--policy", help="qcluster, hpa or static; repeat for several (default: all)")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Same seed, same result")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Figures as JSON")] = False,
    html_out: Annotated[Path | None, typer.Option(
        "--html", help="Write a self-contained HTML report here")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", help="qcluster.toml whose [queues.NAME] policies and [manager] "
                         "target_utilization replace the trace's")] = None,
) -> None:
    """Simulate the manager's planning (and baselines) on a trace; print the figures."""
    chosen = policy or list(POLICIES)
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown:
        _fail(f"unknown policy {unknown[0]!r}: choose from {', '.join(POLICIES)}", 2)
    try:
        loaded = load_trace(trace)
        if config is not None:
            loaded = _configured(loaded, config)
    except (TraceError, ConfigError) as exc:
        _fail(str(exc), 2)
    if html_out is not None and (why := _unwritable(html_out)):
        # Refused before the simulation: a day of 150 queues takes a minute to simulate.
        _fail(f"--html {html_out}: {why}", 2)
    result = _simulate_with_progress(loaded, chosen, seed)
    if html_out is not None:
        try:
            html_out.write_text(to_html(result, f"qcluster simulate {trace.name}"))
        except OSError as exc:
            _fail(f"--html {html_out}: cannot write: {exc.strerror}", 1)
    if as_json:
        typer.echo(to_json(result))
    else:
        print_table(result)
        if html_out is not None:
            err.print(f"report written to {html_out}")


def _simulate_with_progress(trace: Trace, policies: list[str], seed: int) -> SimulationResult:
    """The simulation, with a bar per policy on a terminal (a day of 150 queues takes a
    minute); nothing on a pipe or in a log."""
    if not err.is_terminal:
        return run_simulation(trace, policies, seed)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("rounds"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        tasks = {name: bar.add_task(f"simulating {name}", total=None) for name in policies}

        def advance(name: str, done: int, rounds: int) -> None:
            if done % PROGRESS_EVERY == 0 or done == rounds:  # a day is 43,200 rounds
                bar.update(tasks[name], completed=done, total=rounds)

        return run_simulation(trace, policies, seed, advance)


def _configured(trace: Trace, config: Path) -> Trace:
    """The trace with the policies and target utilization of ``config`` (qcluster.toml)."""
    settings = load_settings(config)
    manager = settings.manager
    utilization = (manager.target_utilization
                   if "target_utilization" in manager.model_fields_set else None)
    configured, unused = with_settings(trace, settings.queues, utilization)
    if unused:
        err.print(f"note: {config} configures queues the trace does not have: "
                  f"{', '.join(unused)}", markup=False, highlight=False, soft_wrap=True)
    return configured


def _unwritable(path: Path) -> str:
    """Why a report cannot be written at ``path`` ('' if it can, as far as can be told)."""
    folder = path.parent
    if path.is_dir():
        return "is a folder"
    if not folder.is_dir():
        return f"no folder {folder}"
    if not os.access(path if path.exists() else folder, os.W_OK):
        return "not writable"
    return ""


def _fail(message: str, code: int) -> NoReturn:
    # soft_wrap: one line whatever the width (rich folds at 80 columns on a pipe).
    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)

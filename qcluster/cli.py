"""The ``qcluster`` command line.

Producer and inspection commands live here; each role contributes its own command
(``master/cli.py``, ``manager/cli.py``, ``qcluster/demo.py``), registered below.
Expected failures (bad config, unreachable broker, unknown app) print one clear
line and exit with the code of :mod:`qcluster.exitcodes`; no traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qcluster import exitcodes
from qcluster.config import Settings, load_settings
from qcluster.errors import (
    AppImportError,
    BrokerUnavailable,
    ConfigError,
    EnvelopeError,
    HandlerNotFound,
    InvalidDelay,
    InvalidQueueName,
    QClusterError,
)

cli = typer.Typer(
    name="qcluster",
    help="A self-managing queue-processing cluster.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True)
out = Console()

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="qcluster.toml (default: $QCLUSTER_CONFIG)")
]
BrokerOpt = Annotated[
    str | None,
    typer.Option("--broker", help="Broker URL (default: $QCLUSTER_BROKER_URL, config, embedded)"),
]

_EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (ConfigError, exitcodes.CONFIG),
    (AppImportError, exitcodes.APP_IMPORT),
    (HandlerNotFound, exitcodes.BOOT_ERROR),
    (BrokerUnavailable, exitcodes.BROKER_CONNECT),
    (EnvelopeError, exitcodes.USAGE),
    (InvalidQueueName, exitcodes.USAGE),
    (InvalidDelay, exitcodes.USAGE),
    (QClusterError, exitcodes.FAILURE),
]


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn expected errors into one red line and a named exit code."""
    try:
        yield
    except tuple(cls for cls, _ in _EXIT_CODES) as exc:
        code = next(c for cls, c in _EXIT_CODES if isinstance(exc, cls))
        # escape(): a message naming "[queues.foo]" or a queue "[/q]" is text, not markup.
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(code) from None


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        stream=sys.stderr,
    )


def settings_for(config: Path | None, **overrides: Any) -> Settings:
    with user_errors():
        return load_settings(config, **overrides)


def open_configured_broker(settings: Settings) -> Any:
    from qcluster.broker import open_broker

    with user_errors():
        return open_broker(settings.broker_url, state_dir=settings.state_dir)


# --- producer commands -----------------------------------------------------------


def _read_jsonl(path: Path) -> Iterator[Any]:
    with path.open() as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise EnvelopeError(f"{path}:{number}: not JSON: {exc.msg}") from exc


def _count_lines(path: Path) -> int:
    with path.open("rb") as file:
        return sum(1 for line in file if line.strip())


@cli.command()
def enqueue(
    queue: Annotated[str, typer.Argument(help="Queue name")],
    payload: Annotated[str | None, typer.Argument(help="Job payload as JSON")] = None,
    delay: Annotated[float, typer.Option(help="Seconds before the job may run")] = 0.0,
    count: Annotated[int, typer.Option(help="Enqueue the payload this many times")] = 1,
    file: Annotated[
        Path | None, typer.Option("--file", help="JSON Lines file, one payload per line")
    ] = None,
    config: ConfigOpt = None,
    broker: BrokerOpt = None,
) -> None:
    """Enqueue jobs: one payload (optionally --count times) or a --file of JSON lines."""
    from rich.progress import Progress

    from qcluster.client import Client
    from qcluster.job import check_delay
    from qcluster.names import check_queue_name

    settings = settings_for(config, broker_url=broker)
    with user_errors():
        if (payload is None) == (file is None):
            raise EnvelopeError("give either a JSON payload or --file, not both or neither")
        if count < 1:
            raise EnvelopeError("--count must be at least 1")
        check_queue_name(queue)
        check_delay(delay, what="--delay")
        client = Client(settings.broker_url, state_dir=settings.state_dir,
                        app=_declaring_app(settings))
        if client.declares(queue) is False:
            err.print(f"[yellow]warning:[/yellow] no queue of the app is named "
                      f"{escape(repr(queue))}: no slot will run these jobs", highlight=False)
        if file is not None:
            total = _count_lines(file)
            items: Iterator[Any] = _read_jsonl(file)
        else:
            try:
                value = json.loads(payload or "")
            except json.JSONDecodeError as exc:
                raise EnvelopeError(f"payload is not JSON: {exc.msg}") from exc
            total, items = count, (value for _ in range(count))
        done = 0
        try:
            with Progress(console=err, transient=True, disable=total < 1000) as progress:
                task = progress.add_task(escape(f"enqueue {queue}"), total=total)
                for chunk in _chunks(items, 1000):
                    ids = client.enqueue_many(queue, chunk, delay=delay)
                    done += len(ids)
                    progress.update(task, advance=len(ids))
                    if total == 1:
                        out.print(ids[0])
        except QClusterError:
            if done:  # the jobs before the bad line are stored: say so
                err.print(escape(f"enqueued {done} job(s) to {queue!r} before the error"),
                          highlight=False)
            raise
        finally:
            client.close()
    if total != 1:
        err.print(escape(f"enqueued {done} job(s) to {queue!r}"), highlight=False)


def _declaring_app(settings: Settings) -> Any:
    """The configured app (to check queue names and message sizes), or None."""
    if not settings.app:
        return None
    from qcluster.app import load_app

    try:
        return load_app(settings.app).with_overrides(settings.queues)
    except QClusterError as exc:
        err.print(f"[yellow]warning:[/yellow] cannot load the app to check the queue: "
                  f"{escape(str(exc))}", highlight=False)
        return None


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@cli.command()
def stats(
    queue: Annotated[str | None, typer.Argument(help="One queue (default: all known)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
    config: ConfigOpt = None,
    broker: BrokerOpt = None,
) -> None:
    """Ready, locked, delayed and dead counts per queue."""
    settings = settings_for(config, broker_url=broker)
    queue_broker = open_configured_broker(settings)
    with user_errors():
        names = [queue] if queue else sorted(queue_broker.queues())
        rows = {name: queue_broker.stats(name).model_dump() for name in names}
        notes = queue_broker.durability()
        queue_broker.close()
    if as_json:
        out.print_json(json.dumps(rows))
        for note in notes:
            err.print(f"[yellow]durability:[/yellow] {escape(note)}", highlight=False)
        return
    table = Table("queue", "ready", "locked", "delayed", "dead")
    for name, row in rows.items():
        table.add_row(escape(name), *(str(row[k]) for k in ("ready", "locked", "delayed", "dead")))
    out.print(table)
    for note in notes:
        out.print(f"[yellow]durability:[/yellow] {escape(note)}", highlight=False)


@cli.command()
def dead(
    queue: Annotated[str, typer.Argument(help="Queue name")],
    requeue: Annotated[bool, typer.Option(help="Move every dead job back to ready")] = False,
    limit: Annotated[int, typer.Option(min=0, help="Show at most this many")] = 20,
    config: ConfigOpt = None,
    broker: BrokerOpt = None,
) -> None:
    """Show the dead-letter jobs of a queue, or requeue them."""
    settings = settings_for(config, broker_url=broker)
    queue_broker = open_configured_broker(settings)
    with user_errors():
        if requeue:
            moved = queue_broker.requeue_dead(queue)
            out.print(escape(f"requeued {moved} job(s) of {queue!r}"))
            return
        jobs = queue_broker.dead_jobs(queue, limit=limit) if limit > 0 else []
    table = Table("id", "attempts", "reason", "body")
    for job in jobs:
        table.add_row(escape(job.id), str(job.attempts), escape(job.reason), escape(job.body[:80]))
    out.print(table)


@cli.command()
def slot(
    queue: Annotated[str, typer.Option("--queue", help="Queue to serve")],
    app: Annotated[str | None, typer.Option("--app", help="MODULE or MODULE:ATTR")] = None,
    burst: Annotated[bool, typer.Option(help="Exit 0 when the queue has no ready job")] = False,
    config: ConfigOpt = None,
    broker: BrokerOpt = None,
    log_level: Annotated[str, typer.Option(help="Logging level")] = "INFO",
) -> None:
    """Run one slot in the foreground (development, tests, benchmarks)."""
    from qcluster.app import load_app
    from slot.runtime import run_slot

    setup_logging(log_level)
    settings = settings_for(config, broker_url=broker, app=app)
    with user_errors():
        if not settings.app:
            raise ConfigError("no application: pass --app MODULE or set app in qcluster.toml")
        application = load_app(settings.app).with_overrides(settings.queues)
        application.spec(queue)
        code = run_slot(
            application, queue, broker_url=settings.broker_url, state_dir=settings.state_dir,
            burst=burst,
        )
    raise typer.Exit(code)


# --- role commands, each defined by its role -------------------------------------

_ROLE_COMMANDS = {
    "master": "master.cli:master",
    "manager": "manager.cli:manager",
    "demo": "qcluster.demo:demo",
    "simulate": "manager.simulator.cli:simulate",
}


def _register_roles() -> None:
    for name, target in _ROLE_COMMANDS.items():
        module_name, _, attr = target.partition(":")
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
        except ModuleNotFoundError:  # the role's package itself is not there (yet)
            continue
        command: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
        cli.command(name)(command)


def main() -> None:
    _register_roles()
    cli()

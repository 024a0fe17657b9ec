"""The ``qcluster`` command line.

Producer and inspection commands live here; each role contributes its own commands
(``master``, ``manager``, ``slot``, ``simulate``, ``demo``), declared as entry points of the
group ``qcluster.commands`` in pyproject.toml and registered by :func:`main`: the core
never imports a role. Expected failures (bad config, unreachable broker, unknown app)
print one clear line and exit with the code of :mod:`qcluster.exitcodes`; no traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from qcluster.cli_support import (
    BrokerInUse,
    BrokerOpt,
    ConfigOpt,
    UsageError,
    err,
    load_app_checked,
    open_existing_broker,
    out,
    settings_for,
    user_errors,
)
from qcluster.config import Settings
from qcluster.errors import EnvelopeError, QClusterError
from qcluster.names import closest

if TYPE_CHECKING:
    from qcluster.client import Client

#: Where the roles declare their commands (``[project.entry-points."qcluster.commands"]``).
COMMANDS_GROUP = "qcluster.commands"

cli = typer.Typer(
    name="qcluster",
    help="A self-managing queue-processing cluster.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",  # a docstring's wrapped lines read as one paragraph
)


# --- producer commands -----------------------------------------------------------


def _read_jsonl(path: Path) -> Iterator[Any]:
    with path.open("rb") as file:
        for number, raw in enumerate(file, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise EnvelopeError(f"{path}:{number}: not UTF-8 text (byte "
                                    f"{raw[exc.start]:#04x})") from None
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise EnvelopeError(f"{path}:{number}: not JSON: {exc.msg}") from exc


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as file:
            return sum(1 for line in file if line.strip())
    except OSError as exc:
        raise UsageError(f"--file {path}: cannot read: {exc.strerror or exc}") from None


@cli.command()
def enqueue(
    queue: Annotated[str, typer.Argument(help="Queue name")],
    payload: Annotated[str | None, typer.Argument(help="Job payload as JSON")] = None,
    delay: Annotated[float, typer.Option(help="Seconds before the job may run")] = 0.0,
    count: Annotated[int, typer.Option(help="Enqueue the payload this many times")] = 1,
    file: Annotated[
        Path | None, typer.Option("--file", help="JSON Lines file, one payload per line")
    ] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Enqueue even to a queue the app does not declare")] = False,
    config: ConfigOpt = None,
    broker: BrokerOpt = None,
) -> None:
    """Enqueue jobs: one payload (optionally --count times) or a --file of JSON lines.

    With an app configured (--config / QCLUSTER_APP), a queue it does not declare is
    refused (exit 2, the closest declared name suggested) unless --force."""
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
        application = _declaring_app(settings)
        _check_declared(application, queue, force)
        # the client's own warning about an undeclared queue would repeat the one above
        logging.getLogger("qcluster.client").setLevel(logging.ERROR)
        client = Client(settings.broker_url, state_dir=settings.state_dir, app=application)
        try:
            total, items = _payloads(payload, file, count)
            done = _enqueue_all(client, queue, items, total, delay)
        finally:
            client.close()
    if total != 1:
        err.print(escape(f"enqueued {done} job(s) to {queue!r}"), highlight=False)


def _payloads(payload: str | None, file: Path | None, count: int) -> tuple[int, Iterator[Any]]:
    """How many payloads and the payloads: the --file's lines, or one parsed --count times."""
    if file is not None:
        return _count_lines(file), _read_jsonl(file)
    try:
        value = json.loads(payload or "")
    except json.JSONDecodeError as exc:
        raise EnvelopeError(f"payload is not JSON: {exc.msg}") from exc
    return count, (value for _ in range(count))


def _enqueue_all(client: Client, queue: str, items: Iterator[Any], total: int,
                 delay: float) -> int:
    """Enqueue in chunks of 1000 (a progress bar from 1000 jobs; one job prints its id);
    the jobs enqueued."""
    from rich.progress import Progress

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
    return done


def _check_declared(application: Any, queue: str, force: bool) -> None:
    """Refuse (UsageError) a queue the app does not declare, suggesting the closest name;
    with --force, say it once and go on. No app: nothing to check against."""
    if application is None or queue in application.queues:
        return
    close = closest(queue, application.queues)
    hint = f" (did you mean {close}?)" if close else ""
    if not force:
        raise UsageError(f"no queue of the app is named {queue!r}{hint}: no slot would run "
                         "these jobs; --force enqueues them anyway")
    err.print(escape(f"warning: no queue of the app is named {queue!r}{hint}: no slot will "
                     "run these jobs until one declares it"), highlight=False)


def _declaring_app(settings: Settings) -> Any:
    """The configured app (to check queue names and message sizes), or None."""
    if not settings.app:
        return None
    try:
        return load_app_checked(settings.app).with_overrides(settings.queues)
    except QClusterError as exc:
        err.print(f"[yellow]warning:[/yellow] cannot load the app to check the queue: "
                  f"{escape(str(exc))}", highlight=False, soft_wrap=True)
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


# ``stats``, ``dead``, ``job`` and ``purge`` are in qcluster/jobs_cli.py (entry points).


# --- the embedded broker's life ------------------------------------------------

broker_cli = typer.Typer(
    name="broker", no_args_is_help=True,
    help="The embedded broker of a state directory: is it running, stop it. It starts with "
         "the first qcluster process that needs it and stops with the last one of those.")
cli.add_typer(broker_cli)


@broker_cli.command("status")
def broker_status(config: ConfigOpt = None, broker: BrokerOpt = None) -> None:
    """Whether the broker runs (exit 0) or not (exit 5), and which processes use it."""
    from qcluster.broker.embedded_life import server_pid, users

    settings = settings_for(config, broker_url=broker)
    queue_broker = open_existing_broker(settings)  # exit 5, one line, when it does not run
    url = queue_broker.safe_url
    queue_broker.close()
    state_dir = _embedded_dir(settings)
    if state_dir is None:
        out.print(escape(f"{url}: answers"), highlight=False, soft_wrap=True)
        return
    pids = users(state_dir)
    out.print(escape(f"{url}: running (redis-server pid {server_pid(state_dir)}); used by "
                     + (f"qcluster process(es) {', '.join(map(str, pids))}" if pids
                        else "no qcluster process (qcluster broker stop stops it)")),
              highlight=False, soft_wrap=True)


@broker_cli.command("stop")
def broker_stop(
    force: Annotated[bool, typer.Option(
        "--force", help="Stop it even while qcluster processes use it")] = False,
    config: ConfigOpt = None, broker: BrokerOpt = None,
) -> None:
    """Stop the embedded broker (it saves its data first). Exit 0 when none runs after it;
    9 when qcluster processes still use it (stop them, or --force)."""
    from qcluster.broker.embedded import stop_embedded
    from qcluster.broker.embedded_life import running, users

    settings = settings_for(config, broker_url=broker)
    state_dir = _embedded_dir(settings)
    with user_errors():
        if state_dir is None:
            raise EnvelopeError("qcluster broker stop stops the embedded broker only: this "
                                "configuration names another broker (--broker / broker_url)")
        if not running(state_dir):
            out.print(escape(f"no embedded broker is running in {state_dir.resolve()}"),
                      highlight=False, soft_wrap=True)
            return
        pids = users(state_dir)
        if pids and not force:
            raise BrokerInUse(f"the embedded broker in {state_dir.resolve()} is used by "
                              f"qcluster process(es) {', '.join(map(str, pids))}: stop them "
                              "(it stops with the last one), or give --force")
        stop_embedded(state_dir)
    out.print(escape(f"stopped the embedded broker in {state_dir.resolve()}"), highlight=False,
              soft_wrap=True)


def _embedded_dir(settings: Settings) -> Path | None:
    """The embedded broker's state directory, or None when another broker is configured."""
    from qcluster.broker import parse_broker_url

    with user_errors():
        parsed = parse_broker_url(settings.broker_url)
    if parsed.kind != "embedded":
        return None
    return Path(parsed.state_dir or settings.state_dir)


# --- role commands, each defined by its role -------------------------------------


def register_commands() -> None:
    """Add the commands the roles declare (entry points of ``qcluster.commands`` in this
    distribution's metadata; read from it alone: 0.3 ms, where scanning every installed
    distribution took 15-25 ms at each start of every qcluster process).

    Idempotent; a name already registered keeps its first command. Without installed
    metadata (sources on PYTHONPATH, never installed) only the core's commands exist.
    """
    try:
        points = distribution("qcluster").entry_points.select(group=COMMANDS_GROUP)
    except PackageNotFoundError:
        return
    known = {info.name or getattr(info.callback, "__name__", None)
             for info in cli.registered_commands}
    for point in points:
        if point.name in known:
            continue
        command: Callable[..., Any] = point.load()
        cli.command(point.name)(command)
        known.add(point.name)


def main() -> None:
    register_commands()
    cli()

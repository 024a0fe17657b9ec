"""What every ``qcluster`` command shares, whichever package defines it: the ``--config``
and ``--broker`` options, loading the settings, opening the configured broker, logging,
and expected errors turned into one line and a named exit code (:mod:`qcluster.exitcodes`).

The core's commands (:mod:`qcluster.cli`) and the roles' commands (``master/cli.py``,
``manager/cli.py``, ``slot/cli.py``, the demo) import from here; nothing here imports a
role, so the imports point one way: roles -> core.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from qcluster import exitcodes
from qcluster.cluster_identity import WrongBroker
from qcluster.config import Settings, load_settings
from qcluster.errors import (
    AppImportError,
    BrokerUnavailable,
    ConfigError,
    EnvelopeError,
    HandlerNotFound,
    InvalidDelay,
    InvalidJobId,
    InvalidQueueName,
    QClusterError,
)
from qcluster.names import closest

# soft_wrap: a message is one line whatever the width (rich folds at 80 columns on a pipe,
# and a log or a script reading stderr gets the message cut in pieces).
err = Console(stderr=True, soft_wrap=True)
out = Console()

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="qcluster.toml (default: $QCLUSTER_CONFIG)")
]
BrokerOpt = Annotated[
    str | None,
    typer.Option("--broker", help="Broker URL (default: $QCLUSTER_BROKER_URL, config, embedded)"),
]

class AddressInUse(ConfigError):
    """A port this process must listen on is taken (exit ADDRESS_IN_USE)."""


class UsageError(QClusterError):
    """The command was given something it cannot do (exit USAGE)."""


class BrokerInUse(QClusterError):
    """``qcluster broker stop`` refused: other qcluster processes use it (exit BROKER_IN_USE)."""


_EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (AddressInUse, exitcodes.ADDRESS_IN_USE),
    (WrongBroker, exitcodes.WRONG_BROKER),
    (BrokerInUse, exitcodes.BROKER_IN_USE),
    (ConfigError, exitcodes.CONFIG),
    (AppImportError, exitcodes.APP_IMPORT),
    (HandlerNotFound, exitcodes.BOOT_ERROR),
    (BrokerUnavailable, exitcodes.BROKER_CONNECT),
    (EnvelopeError, exitcodes.USAGE),
    (UsageError, exitcodes.USAGE),
    (InvalidQueueName, exitcodes.USAGE),
    (InvalidDelay, exitcodes.USAGE),
    (InvalidJobId, exitcodes.USAGE),
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
    warn_misspelt_variables()
    with user_errors():
        return load_settings(config, **overrides)


def warn_misspelt_variables(environ: Any = None) -> list[str]:
    """One warning line per ``QCLUSTER_*`` variable that is no setting but nearly one
    (``QCLUSTER_BROKER`` for ``QCLUSTER_BROKER_URL``): it would be ignored in silence.
    Other ``QCLUSTER_*`` names (a deployment's own, e.g. QCLUSTER_REDIS_PASSWORD) pass."""
    import os

    known = {f"QCLUSTER_{name.upper()}" for name in Settings.model_fields} | {"QCLUSTER_CONFIG"}
    said = []
    for name in sorted(environ if environ is not None else os.environ):
        if not name.startswith("QCLUSTER_") or name in known:
            continue
        close = closest(name, known, cutoff=0.85)
        if close:
            said.append(f"warning: {name} is not a qcluster setting (did you mean {close}?):"
                        " it is ignored")
            err.print(escape(said[-1]), highlight=False, soft_wrap=True)
    return said


def open_configured_broker(settings: Settings) -> Any:
    """The configured broker; the embedded one is started if it does not run (a producer
    or a role: this process then counts as one of its users, see embedded_life)."""
    from qcluster.broker import open_broker

    with user_errors():
        return open_broker(settings.broker_url, state_dir=settings.state_dir)


def open_existing_broker(settings: Settings) -> Any:
    """For a command that only reads (stats, dead, job...): never starts the embedded
    broker, and a broker that does not answer is an error (exit BROKER_CONNECT, one line),
    never an empty answer, within seconds (SHORT_LIVED_GIVE_UP_S)."""
    from qcluster.broker import SHORT_LIVED_GIVE_UP_S, open_broker, parse_broker_url

    with user_errors():
        parsed = parse_broker_url(settings.broker_url)
        if parsed.kind == "embedded":
            from qcluster.broker.embedded_life import open_running

            return open_running(Path(parsed.state_dir or settings.state_dir))
        broker = open_broker(parsed.text, state_dir=settings.state_dir,
                             give_up_s=SHORT_LIVED_GIVE_UP_S)
        try:
            broker.ping()
        except BaseException:
            broker.close()
            raise
        return broker


def announce_broker(settings: Settings, role: str) -> None:
    """Say loudly which broker a role uses when none is configured: every process of a
    cluster must use the same one, and the embedded broker is this directory's alone."""
    if settings.broker_url:
        return
    logging.getLogger(f"qcluster.{role}").warning(
        "no broker configured (--broker, QCLUSTER_BROKER_URL or broker_url in qcluster.toml): "
        "this %s uses the EMBEDDED broker in %s, which only processes started with the same "
        "state directory share", role, Path(settings.state_dir).resolve())


def check_port_free(host: str, port: int, flag: str) -> None:
    """Refuse, in one line naming the flag to change, an address another process holds
    (the server itself binds right after; this only turns the usual traceback into words)."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(f"{host}:{port} is already in use (another qcluster "
                                   f"process?): choose another port with {flag}") from None
            raise ConfigError(f"{flag}: cannot listen on {host}:{port}: "
                              f"{exc.strerror or exc}") from None


def load_app_checked(target: str) -> Any:
    """:func:`qcluster.app.load_app` whose every failure is one line (AppImportError):
    a syntax error names file:line, an exception raised by the module names its type and
    the app's line, a missing attribute names what the module has."""
    import sys
    import traceback

    from qcluster.app import App, load_app

    module_name, _, attr = target.partition(":")
    try:
        return load_app(target)
    except SyntaxError as exc:
        raise AppImportError(f"cannot import app module {module_name!r}: {exc.filename}:"
                             f"{exc.lineno}: {exc.msg}") from None
    except AppImportError:
        module = sys.modules.get(module_name)
        if module is None or hasattr(module, attr or "app"):
            raise
        apps = sorted(k for k, v in vars(module).items() if isinstance(v, App))
        raise AppImportError(f"module {module_name!r} has no attribute {attr or 'app'!r} "
                             f"(qcluster.App objects in it: {', '.join(apps) or 'none'})"
                             ) from None
    except Exception as exc:  # the module raised while importing: say where, in one line
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if "importlib" not in f.filename]
        # The app's own line, not qcluster's: a decorator that refuses a declaration
        # raises inside qcluster, and the line to fix is the one that called it.
        ours = os.path.realpath(os.path.dirname(__file__)) + os.sep
        users = [f for f in frames if not os.path.realpath(f.filename).startswith(ours)]
        where = next((f"{f.filename}:{f.lineno}: " for f in reversed(users or frames)), "")
        message = " ".join(str(exc).split())
        raise AppImportError(f"cannot import app module {module_name!r}: {where}"
                             f"{type(exc).__name__}: {message}") from None

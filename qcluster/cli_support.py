"""What every ``qcluster`` command shares, whichever package defines it: the ``--config``
and ``--broker`` options, loading the settings, opening the configured broker, logging,
and expected errors turned into one line and a named exit code (:mod:`qcluster.exitcodes`).

The core's commands (:mod:`qcluster.cli`) and the roles' commands (``master/cli.py``,
``manager/cli.py``, ``slot/cli.py``, the demo) import from here; nothing here imports a
role, so the imports point one way: roles -> core.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

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

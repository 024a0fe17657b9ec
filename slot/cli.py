"""``qcluster slot``: one slot in the foreground (development, tests, benchmarks).

Registered on the ``qcluster`` command by its entry point (pyproject.toml); the master
does not use it: it forks its slots from the pre-imported app.
"""

from __future__ import annotations

from typing import Annotated

import typer

from qcluster.cli_support import (
    BrokerOpt,
    ConfigOpt,
    load_app_checked,
    settings_for,
    setup_logging,
    user_errors,
)
from qcluster.errors import ConfigError


def slot(
    queue: Annotated[str, typer.Option("--queue", help="Queue to serve")],
    app: Annotated[str | None, typer.Option("--app", help="MODULE or MODULE:ATTR")] = None,
    burst: Annotated[bool, typer.Option(help="Exit 0 when the queue has no ready job")] = False,
    config: ConfigOpt = None,
    broker: BrokerOpt = None,
    log_level: Annotated[str, typer.Option(help="Logging level")] = "INFO",
) -> None:
    """Run one slot in the foreground (development, tests, benchmarks)."""
    from qcluster.slot.runtime import run_slot

    setup_logging(log_level)
    settings = settings_for(config, broker_url=broker, app=app)
    with user_errors():
        if not settings.app:
            raise ConfigError("no application: pass --app MODULE or set app in qcluster.toml")
        application = load_app_checked(settings.app).with_overrides(settings.queues)
        application.spec(queue)
        code = run_slot(
            application, queue, broker_url=settings.broker_url, state_dir=settings.state_dir,
            burst=burst,
        )
    raise typer.Exit(code)

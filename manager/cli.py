"""``qcluster manager``: one per cluster."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from pydantic import ValidationError

from qcluster.cli_support import (
    BrokerOpt,
    ConfigOpt,
    announce_broker,
    check_port_free,
    open_configured_broker,
    settings_for,
    setup_logging,
    user_errors,
)
from qcluster.cluster_identity import claim
from qcluster.config import ManagerSettings, Settings
from qcluster.errors import ConfigError
from qcluster.local_token import LOCAL_TOKEN_NAME, ensure_local_token, token_path

logger = logging.getLogger("qcluster.manager")


def validated_manager_settings(settings: Settings, flags: dict[str, object]) -> ManagerSettings:
    """``[manager]`` with the command-line flags applied, validated like the file (a NaN or
    astronomic ``--interval`` is refused: it is the masters' report interval too)."""
    try:
        return ManagerSettings.model_validate({**settings.manager.model_dump(), **flags})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid manager option: {problems}") from None


def check_named_tokens(settings: Settings) -> None:
    """``[tokens]`` without the unnamed ``token`` is refused: masters report with
    ``token`` only, and a manager that has named tokens requires one on reports, so every
    master's report would be refused (its slots never planned)."""
    if settings.tokens and not settings.token:
        raise ConfigError("[tokens] is set without `token`: masters report with `token`; "
                          "set it too (QCLUSTER_TOKEN or `token` in qcluster.toml)")


def manager(
    config: ConfigOpt = None,
    broker: BrokerOpt = None,
    listen: Annotated[
        str | None, typer.Option(
            "--listen", help="HOST:PORT, [IPV6]:PORT or PORT (default 127.0.0.1:7300); "
                             "anything but loopback needs a token")
    ] = None,
    interval: Annotated[
        float | None, typer.Option("--interval", help="Seconds between planning rounds")
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "INFO",
    record: Annotated[
        Path | None, typer.Option("--record", help="Append what each planning round observed "
                                  "to FILE (JSON Lines; qcluster simulate --trace FILE)")
    ] = None,
) -> None:
    """Plan slots per queue and host from backlog and throughput; serve the API and admin UI."""
    import uvicorn

    from qcluster.manager.api import create_app
    from qcluster.manager.learned_periodic import LearnedPeriodic
    from qcluster.manager.periodic import app_for_periodic
    from qcluster.manager.recorder import recorder_for
    from qcluster.manager.service import ManagerService
    from qcluster.manager.serving import uvicorn_options
    from qcluster.manager.state import ClusterState
    from qcluster.security import check_server_security, parse_listen

    setup_logging(log_level)
    settings = settings_for(config, broker_url=broker)
    with user_errors():
        overrides: dict[str, object] = {}
        if listen:
            overrides["listen"] = listen
        if interval is not None:
            overrides["interval_s"] = interval
        if record:
            overrides["record"] = record
        settings = settings.model_copy(
            update={"manager": validated_manager_settings(settings, overrides)})
        address = parse_listen(settings.manager.listen)
        check_server_security(address, settings.token, role="manager")
        check_named_tokens(settings)
        check_port_free(address.host, address.port, "--listen")
        broker_conn = open_configured_broker(settings)
        announce_broker(settings, "manager")  # once it opened: a refusal stays one line
        identity = claim(broker_conn)
        recorder = recorder_for(settings.manager, started_at=time.time())
        local = _local_token(settings, address.loopback)
        service = ManagerService(ClusterState(settings), broker_conn, settings.token,
                                 recorder=recorder,
                                 tokens={LOCAL_TOKEN_NAME: local} if local else None)
        application = app_for_periodic(settings)
        service.learned = LearnedPeriodic(
            service, settings, application.periodic_jobs if application else None)
        app = create_app(service, loopback=address.loopback)
        app.state.cluster = identity  # masters on another broker are refused (api_reports)
        app.state.local_token_only = local is not None
    logger.info("manager on http://%s/ (admin UI), broker %s (cluster %s)", address,
                broker_conn.safe_url, identity.id[:8] if identity else "unknown")
    # uvicorn re-raises the SIGTERM it caught once it has shut down: with the default
    # handler the process would die there, before the broker is closed and before the
    # embedded broker's last user stops it (embedded_life, at exit). Exit 0 instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        # a deadline on each request's head, a bound on concurrency (manager/serving.py)
        uvicorn.run(app, host=address.host, port=address.port, **uvicorn_options())
    finally:
        service.stop()  # the lifespan stopped it already, unless the server never started
        broker_conn.close()


def _local_token(settings: Settings, loopback: bool) -> str | None:
    """The local token (written on the first start) when no token is configured and the
    manager listens on loopback only; None otherwise."""
    if settings.token or settings.tokens or not loopback:
        return None
    local = ensure_local_token(settings.state_dir)
    logger.info("no token configured: controls take the local token in %s (qcluster pause, "
                "drain, reload and qcluster login read it on this machine)",
                token_path(settings.state_dir))
    return local


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)  # stopped on request: the finally blocks and atexit run

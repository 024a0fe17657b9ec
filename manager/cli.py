"""``qcluster manager``: one per cluster."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

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

if TYPE_CHECKING:
    from fastapi import FastAPI

    from qcluster.broker.base import Broker
    from qcluster.manager.service import ManagerService
    from qcluster.messages import ClusterClaim

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

    from qcluster.manager.api.serving import uvicorn_options
    from qcluster.security import check_server_security, parse_listen

    setup_logging(log_level)
    settings = settings_for(config, broker_url=broker)
    with user_errors():
        settings = _with_flags(settings, listen=listen, interval=interval, record=record)
        address = parse_listen(settings.manager.listen)
        check_server_security(address, settings.token, role="manager")
        check_named_tokens(settings)
        check_port_free(address.host, address.port, "--listen")
        broker_conn = open_configured_broker(settings)
        announce_broker(settings, "manager")  # once it opened: a refusal stays one line
        identity = claim(broker_conn)
        local = _local_token(settings, address.loopback)
        service = _service(settings, broker_conn, local)
        app = _app(service, address.loopback, identity, local_token_only=local is not None)
    logger.info("manager on http://%s/ (admin UI), broker %s (cluster %s)", address,
                broker_conn.safe_url, identity.id[:8] if identity else "unknown")
    # uvicorn re-raises the SIGTERM it caught once it has shut down: with the default
    # handler the process would die there, before the broker is closed and before the
    # embedded broker's last user stops it (embedded_life, at exit). Exit 0 instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        # a deadline on each request's head, a bound on concurrency (manager/api/serving.py)
        uvicorn.run(app, host=address.host, port=address.port, **uvicorn_options())
    finally:
        service.stop()  # the lifespan stopped it already, unless the server never started
        broker_conn.close()


def _with_flags(settings: Settings, *, listen: str | None, interval: float | None,
                record: Path | None) -> Settings:
    """The settings with the command-line flags given applied to ``[manager]``."""
    overrides: dict[str, object] = {}
    if listen:
        overrides["listen"] = listen
    if interval is not None:
        overrides["interval_s"] = interval
    if record:
        overrides["record"] = record
    return settings.model_copy(
        update={"manager": validated_manager_settings(settings, overrides)})


def _service(settings: Settings, broker_conn: Broker, local: str | None) -> ManagerService:
    """The service on its state and broker, with its recorder, the local token when
    there is one, and the periodic jobs it learns from the reports."""
    from qcluster.manager.planning.learned_periodic import LearnedPeriodic
    from qcluster.manager.planning.periodic import app_for_periodic
    from qcluster.manager.planning.recorder import recorder_for
    from qcluster.manager.service import ManagerService
    from qcluster.manager.state import ClusterState

    recorder = recorder_for(settings.manager, started_at=time.time())
    service = ManagerService(ClusterState(settings), broker_conn, settings.token,
                             recorder=recorder,
                             tokens={LOCAL_TOKEN_NAME: local} if local else None)
    application = app_for_periodic(settings)
    service.learned = LearnedPeriodic(
        service, settings, application.periodic_jobs if application else None)
    return service


def _app(service: ManagerService, loopback: bool, identity: ClusterClaim | None, *,
         local_token_only: bool) -> FastAPI:
    """The HTTP app on the service, knowing the cluster's identity and whether the local
    token is the only one."""
    from qcluster.manager.api.app import create_app

    app = create_app(service, loopback=loopback)
    app.state.cluster = identity  # masters on another broker are refused (api/reports.py)
    app.state.local_token_only = local_token_only
    return app


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

"""``qcluster master``: one per host."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import os
import re
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qcluster import metrics
from qcluster.cli_support import (
    BrokerOpt,
    ConfigOpt,
    UsageError,
    announce_broker,
    check_port_free,
    load_app_checked,
    settings_for,
    setup_logging,
    user_errors,
)
from qcluster.config import DEFAULT_MANAGER_URL, Settings
from qcluster.errors import ConfigError
from qcluster.messages import ClusterClaim
from qcluster.names import check_queue_name
from qcluster.policy import QUEUE_NAME_PATTERN
from qcluster.security import ListenAddress, is_decimal
from qcluster.slot.prefork import prepare_slots

if TYPE_CHECKING:
    from qcluster.master.supervisor import Supervisor

logger = logging.getLogger("qcluster.master")
#: The files prometheus_client's multiprocess mode writes (``TYPE_IDENTITY.db``): a slot's
#: identity is ``slot<N>``, any other process's its PID.
METRIC_FILE = re.compile(r"(counter|histogram|summary|gauge_[a-z]+)_(slot\d+|\d+)\.db")


def clear_metric_files(directory: Path) -> int:
    """Remove the metric files a previous master's slots left, and nothing else: the
    directory may be shared with the user's own files. Returns how many were removed."""
    removed = 0
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        if METRIC_FILE.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed


def metrics_directory(configured: Path | None, host: str) -> Path:
    """Where this master's slots write their metric files: ``QCLUSTER_METRICS_DIR/HOST``
    (masters of several hosts may share the variable, as two units of one machine share
    an environment file), else the per-host default."""
    return configured / host if configured else metrics.default_metrics_dir(host)


def hold_metrics_directory(directory: Path, host: str) -> int:
    """Lock the directory for this master's life (the descriptor stays open; the slots it
    forks inherit it, so the lock lasts while any of them writes). A second master of the
    same host name would wipe the first one's files and write over its slots' counts:
    refused with a ConfigError naming the master that holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / ".master.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"another master (pid {holder}) of host {host!r} runs on this machine (it holds "
            f"{directory}): give each master its own --host-name") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def parse_slots(text: str) -> dict[str, int]:
    """``resize=4,mail=2`` -> {"resize": 4, "mail": 2}; a bad command line (UsageError,
    InvalidQueueName: exit 2) otherwise."""
    row: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        queue, sep, count = part.partition("=")
        if not sep or not queue or not is_decimal(count.strip()):
            raise UsageError(f"--slots: expected QUEUE=N[,QUEUE=N...], got {part!r}")
        row[check_queue_name(queue.strip())] = int(count)
    return row


def master(
    host_auto: Annotated[
        bool,
        typer.Option("--host-auto",
                     help="Size this host from its memory, load and cgroups, and run the slots "
                          "the manager plans (the default; see docs/master.md). --slots is the "
                          "fixed alternative: giving both is an error"),
    ] = False,
    slots: Annotated[
        str | None,
        typer.Option("--slots", help="Fixed row without a manager: QUEUE=N,... (instead of "
                                     "--host-auto)"),
    ] = None,
    manager: Annotated[
        str | None,
        typer.Option("--manager", help="Manager URL to report to (default: "
                                       "$QCLUSTER_MANAGER_URL, config manager_url, "
                                       "http://127.0.0.1:7300)"),
    ] = None,
    app: Annotated[
        str | None,
        typer.Option("--app", help="Application module (MODULE or MODULE:ATTR)"),
    ] = None,
    broker: BrokerOpt = None,
    host_name: Annotated[
        str | None,
        typer.Option("--host-name", help="Name reported to the manager (default: hostname)"),
    ] = None,
    listen: Annotated[
        str,
        typer.Option("--listen", help="HOST:PORT, [IPV6]:PORT or PORT of /metrics and the "
                                      "JSON API (read-only); anything but loopback needs a token"),
    ] = "127.0.0.1:7301",
    config: ConfigOpt = None,
    metrics_on: Annotated[
        bool,
        typer.Option("--metrics/--no-metrics", help="Slot metrics (prometheus multiprocess files)"),
    ] = True,
    log_level: Annotated[
        str,
        typer.Option("--log-level"),
    ] = "INFO",
) -> None:
    """Run this host's slots: fork them from the pre-imported app, size, watch, recycle."""
    # A reload asked for while the app imports (systemd's ExecReload) must not end the
    # master (SIGHUP's default): the code being imported is the newest. The loop installs
    # its own handler (Supervisor.run).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    setup_logging(log_level)
    with user_errors():
        if host_auto and slots is not None:
            raise UsageError("--host-auto and --slots: give one (--host-auto sizes the host "
                              "and runs what the manager plans; --slots is a fixed row)")
        settings = settings_for(config, broker_url=broker, app=app, manager_url=manager)
        supervisor, address, claim = _prepare(settings, slots, host_name, listen, metrics_on,
                                              config=config, log_level=log_level)
        manager_url = None if slots is not None else _manager_url(settings)
        if manager_url:
            manager_url = _checked_manager(manager_url, settings, claim, supervisor.host_name)
        code = _run(supervisor, address, manager_url, claim)
    raise typer.Exit(code)


def _prepare(settings: Settings, slots: str | None, host_name: str | None, listen: str,
             metrics_on: bool, *, config: Path | None = None,
             log_level: str = "INFO",
             ) -> tuple[Supervisor, ListenAddress, ClusterClaim | None]:
    """Everything checked and imported before the first fork; errors are one line."""
    from qcluster.app import code_version
    from qcluster.master.supervisor import Supervisor
    from qcluster.master.template import TemplateSpec
    from qcluster.security import check_server_security, parse_listen
    from qcluster.slot import identity
    from qcluster.slot.runtime import run_slot

    if not settings.app:
        raise ConfigError("no application: pass --app MODULE or set app in qcluster.toml")
    address = parse_listen(listen)
    check_server_security(address, settings.token, role="master")
    check_port_free(address.host, address.port, "--listen")
    row = parse_slots(slots) if slots else None
    name = host_name or socket.gethostname()
    if not re.fullmatch(QUEUE_NAME_PATTERN, name):
        raise ConfigError(f"--host-name: {name!r} is not a valid host name for the manager "
                          "(1-128 letters, digits, '_', '.', ':' or '-', starting with a "
                          "letter or digit)")
    identity.set_identity(name)  # the slots it forks inherit it (process titles, errors)
    identity.set_title("master", with_generation=False)
    if metrics_on:
        directory = metrics_directory(settings.metrics_dir, name)
        hold_metrics_directory(directory, name)
        clear_metric_files(directory)
        metrics.prepare_multiprocess_dir(directory, wipe=False)
    application = load_app_checked(settings.app).with_overrides(settings.queues)
    for queue in row or ():
        application.spec(queue)
    # The app's import made the master's garbage: collected here, not just before the
    # fork (see _run), so that what it frees is reused by the master's own start.
    gc.collect()
    prepare_slots(settings.broker_url, metrics_on)
    claim = check_broker(settings)
    announce_broker(settings, "master")  # once it answered: a refusal stays one line
    # A reload's template imports the app as here, re-reading the same configuration.
    spec = TemplateSpec(app=settings.app, config=str(config) if config else None,
                        broker_url=settings.broker_url, state_dir=str(settings.state_dir),
                        master_pid=0, log_level=log_level, metrics=metrics_on,
                        host_name=name)
    supervisor = Supervisor(application, settings, host_name=name, fixed_row=row,
                            run_slot=run_slot, version=code_version(application, settings.app),
                            template_spec=spec)
    return supervisor, address, claim


def check_broker(settings: Settings) -> ClusterClaim | None:
    """Open the broker once before any fork, as every other command does: a Redis that
    evicts keys is refused here with one line (exit 6) instead of by each slot in turn.
    A broker that cannot be reached is not refused: the slots retry it. Returns the
    broker's cluster identity (None: not reachable now)."""
    from qcluster.broker import open_broker
    from qcluster.cluster_identity import claim
    from qcluster.errors import BrokerError

    try:
        broker = open_broker(settings.broker_url, state_dir=settings.state_dir)
    except BrokerError as exc:
        logger.warning("broker not reachable at start (%s): the slots will retry", exc)
        return None
    try:
        return claim(broker)
    finally:
        broker.close()


def _manager_url(settings: Settings) -> str:
    """The manager this master reports to: ``manager_url``, else the default one on this
    machine, said at start (a master that reported nowhere ran its queues' min_slots and
    never said that no manager planned it)."""
    if settings.manager_url:
        return settings.manager_url
    logger.info("reporting to the manager at %s, the default (set --manager, "
                "QCLUSTER_MANAGER_URL or manager_url in qcluster.toml for another; --slots "
                "runs a fixed row without one)", DEFAULT_MANAGER_URL)
    return DEFAULT_MANAGER_URL


def _checked_manager(url: str, settings: Settings, claim: ClusterClaim | None,
                     host: str) -> str | None:
    """``url`` once its manager is known to work on this master's broker (or not known
    yet). The default manager of this machine on another broker (a local demo beside
    --broker PROD) is not this master's: it reports to none, said in one line. A manager
    the user named on another broker is refused (WrongBroker)."""
    from qcluster.cluster_identity import WrongBroker

    try:
        check_manager_broker(url, claim, host)
    except WrongBroker as exc:
        if settings.manager_url:
            raise
        logger.warning("%s: this master reports to no manager (--manager names one)", exc)
        return None
    return url


def check_manager_broker(manager_url: str, mine: ClusterClaim | None, host: str) -> None:
    """Refuse to start (WrongBroker, one line naming both URLs) when the manager works on
    another broker than this master; a manager not reachable yet is not refused (its
    reports are, the reporter logs why)."""
    import httpx

    from qcluster.cluster_identity import WrongBroker, mismatch

    url = manager_url.rstrip("/")
    try:
        answer = httpx.get(f"{url}/api/v1/identity", timeout=5.0)
        answer.raise_for_status()
        theirs = answer.json().get("cluster")
        manager = None if theirs is None else ClusterClaim.model_validate(theirs)
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        logger.info("the manager's broker not checked at start (%s): its replies will say", exc)
        return
    refusal = mismatch(manager, mine, who=f"master {host}", manager_url=url)
    if refusal is not None:
        raise WrongBroker(refusal)


def _run(supervisor: Supervisor, listen: ListenAddress, manager_url: str | None,
         cluster: ClusterClaim | None = None) -> int:
    from qcluster.master.broker_health import BrokerConnectCheck
    from qcluster.master.http import serve
    from qcluster.master.reporter import Reporter

    settings = supervisor.settings
    health = BrokerConnectCheck(settings.broker_url, settings.state_dir,
                                supervisor.effects.fork_lock)
    server = serve(listen, lambda: supervisor.snapshot, supervisor.host_name, health.status,
                   token=settings.token)
    supervisor.extra_fds.append(server.socket.fileno())
    logger.info("master %s: http://%s/metrics, queues %s, version %s", supervisor.host_name,
                listen, ", ".join(sorted(supervisor.app.queues)),
                supervisor.reload.code.serving.version)
    reporter = None
    if manager_url:
        reporter = Reporter(supervisor, manager_url,
                            supervisor.settings.master.report_interval_s,
                            token=supervisor.settings.token, cluster=cluster)
        reporter.start()
    # Everything imported so far is shared copy-on-write by every slot: keep the GC from
    # touching (and so copying) those objects' pages in the slots. No full collection
    # right before (the garbage was collected in _prepare): finding none, it still empties
    # the interpreter's free lists into the master's pymalloc pools, free blocks each slot
    # then fills with objects of its own, a page copied per block (0.1 MiB of a no-op
    # slot's Private_Dirty).
    gc.freeze()
    try:
        code = supervisor.run()
    finally:
        server.shutdown()
    if reporter is not None:  # stopped cleanly, every slot ended: not a lost host
        reporter.leave()
    return code

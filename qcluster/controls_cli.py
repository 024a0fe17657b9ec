"""``qcluster pause|resume QUEUE``, ``qcluster drain|undrain HOST``, ``qcluster controls``,
``qcluster reload [HOST] [--all] [--wait]``, ``qcluster login``: the manager's controls from
the command line, through its HTTP API.

The manager keeps every control in the broker (a restart keeps them) and records who set
it: the name of the token sent (``token`` / ``QCLUSTER_TOKEN``; never on the command line,
where ``ps`` would show it). Registered as entry points of ``qcluster.commands``.

Exit codes (docs/operations.md, "Pause, resume, drain" and "Deploying new code"): 0 done;
2 a name outside the queue-name rule; 6 no token configured (and no local token the manager
takes: a manager on this machine with none configured writes one to its state directory,
which these commands read when the manager's URL is loopback); 10 the manager is unreachable
or failed (the broker did not store the change: 503); 11 the manager refused the token
(401); ``reload``: 12 refused (no such host, a reload already running), 13 a host failed
to load the new code (the rollout stopped), 14 a host was skipped or ``--wait`` gave up;
``pause --wait``: 1 a slot still ran the queue at ``--timeout``.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, NoReturn
from urllib.parse import urlsplit

import httpx
import typer
from rich.markup import escape
from rich.table import Table

from qcluster import exitcodes
from qcluster.cli_support import ConfigOpt, err, out, settings_for, user_errors
from qcluster.config import DEFAULT_MANAGER_URL, Settings
from qcluster.controls import utc_text
from qcluster.errors import ConfigError
from qcluster.local_token import read_local_token, token_path
from qcluster.names import check_queue_name
from qcluster.security import is_loopback

#: The manager could not be reached, or answered with a server error.
MANAGER_UNREACHABLE = 10
#: The manager refused the token.
TOKEN_REFUSED = 11
#: The manager refused the reload (404: no host of that name; 409: a reload is running,
#: the host is not reporting, or no host is).
RELOAD_REFUSED = 12
#: A host failed to load the new code: the rollout stopped, the hosts after it keep the old.
RELOAD_FAILED = 13
#: The rollout ended with a host skipped, or ``--wait`` gave up or lost it.
RELOAD_INCOMPLETE = 14
TIMEOUT_S = 30.0
#: Seconds between two reads of the rollout under ``--wait``.
POLL_S = 1.0

ManagerOpt = Annotated[
    str | None,
    typer.Option("--manager", help="The manager's URL (default: $QCLUSTER_MANAGER_URL, "
                                   f"config manager_url, {DEFAULT_MANAGER_URL})"),
]
QueueArg = Annotated[str, typer.Argument(help="Queue name")]
HostArg = Annotated[str, typer.Argument(help="Host name (as the master reports it)")]


def pause(
    queue: QueueArg,
    wait: Annotated[bool, typer.Option(
        "--wait", help="Return once no slot runs QUEUE (its slots finish their batch first)")
    ] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds --wait waits before giving up (exit 1)", min=1)] = 120.0,
    manager: ManagerOpt = None, config: ConfigOpt = None,
) -> None:
    """Plan no slot for QUEUE until it is resumed (kept across manager restarts)."""
    reply = _post(config, manager, f"/api/v1/queues/{_name(queue)}/pause")
    out.print(escape(f"queue {queue} paused by {reply.get('by')}: no slot from the "
                     "next planning round"), highlight=False, soft_wrap=True)
    _unknown(reply, f"no master has reported a queue named {queue!r}", f"resume {queue}")
    if wait:
        _wait_no_slot(config, manager, queue, timeout)


def _wait_no_slot(config: Any, manager: str | None, queue: str, timeout: float) -> None:
    """Until the manager's view has no slot running ``queue``: the slots it had go at the
    next planning round, each after its batch, and until then they still take its jobs."""
    deadline = time.monotonic() + timeout
    running: int | None = None
    while True:
        try:
            view = _request(config, manager, "GET", "/api/v1/cluster", needs_token=False,
                            retry=True)
        except httpx.HTTPError:
            view = None  # restarting, say: try again until the timeout
        if isinstance(view, dict):
            row: dict[str, Any] = next(
                (q for q in view.get("queues", []) if q.get("name") == queue), {})
            running = int(row.get("slots_current") or 0)
            if running == 0:
                out.print(escape(f"queue {queue}: no slot runs it"), highlight=False,
                          soft_wrap=True)
                return
        if time.monotonic() > deadline:
            still = "the manager did not answer" if running is None else \
                f"{running} slot(s) still run it"
            _fail(exitcodes.FAILURE, f"queue {queue} is paused, but {still} after "
                                     f"{timeout:g} s (they go at the manager's next rounds)")
        time.sleep(POLL_S)


def resume(queue: QueueArg, manager: ManagerOpt = None, config: ConfigOpt = None) -> None:
    """Plan slots for QUEUE again."""
    _post(config, manager, f"/api/v1/queues/{_name(queue)}/resume")
    out.print(escape(f"queue {queue} resumed"), highlight=False, soft_wrap=True)


def drain(host: HostArg, manager: ManagerOpt = None, config: ConfigOpt = None) -> None:
    """Plan no slot on HOST (its slots move to the others) until it is undrained."""
    reply = _post(config, manager, f"/api/v1/hosts/{_name(host)}/drain")
    out.print(escape(f"host {host} drained by {reply.get('by')}: its slots move to the "
                     "other hosts"), highlight=False, soft_wrap=True)
    _unknown(reply, f"no host named {host!r} reports to this manager", f"undrain {host}")


def undrain(host: HostArg, manager: ManagerOpt = None, config: ConfigOpt = None) -> None:
    """Plan slots on HOST again."""
    _post(config, manager, f"/api/v1/hosts/{_name(host)}/undrain")
    out.print(escape(f"host {host} undrained"), highlight=False, soft_wrap=True)


def login(manager: ManagerOpt = None, config: ConfigOpt = None) -> None:
    """Print a one-time link that signs a browser in to the admin page (valid 10 minutes,
    once): its buttons then work without pasting the token."""
    settings = settings_for(config, manager_url=manager)
    reply = _post(config, manager, "/api/v1/login")
    base = (settings.manager_url or DEFAULT_MANAGER_URL).rstrip("/")
    out.print(escape(f"{base}{reply.get('path')}"), highlight=False, soft_wrap=True)


def controls(
    manager: ManagerOpt = None, config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """The pauses and drains in force, with who set them and when."""
    rows = _request(config, manager, "GET", "/api/v1/controls", needs_token=False)
    if as_json:
        out.print_json(json.dumps(rows))
        return
    table = Table("control", "name", "by", "since (UTC)")
    for row in rows:
        table.add_row(escape(str(row["kind"])), escape(str(row["name"])), escape(str(row["by"])),
                      escape(_since(row.get("at"))))
    out.print(table)


def reload(
    host: Annotated[str | None, typer.Argument(help="Host to reload (or --all)")] = None,
    all_hosts: Annotated[bool, typer.Option(
        "--all", help="Every reporting host, one at a time")] = False,
    wait: Annotated[bool, typer.Option(
        "--wait", help="Follow the reload until it ends (exit 0: every host took it)")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds --wait follows it before giving up", min=1)] = 900.0,
    manager: ManagerOpt = None, config: ConfigOpt = None,
) -> None:
    """Reload HOST's code (a fresh template, its slots replaced a few at a time), or every
    host's one at a time (--all): the next host is asked once the previous one took it, and
    a host that fails to load it stops the rollout (the others keep the old code)."""
    if (host is None) == (not all_hosts):
        _fail(exitcodes.USAGE, "name one HOST, or give --all")
    path = "/api/v1/reload" if host is None else f"/api/v1/hosts/{_name(host)}/reload"
    rollout = _post(config, manager, path)
    hosts = [str(step["host"]) for step in rollout.get("hosts", [])]
    out.print(escape(f"reload {rollout.get('id')} asked by {rollout.get('by')}: "
                     + (f"{', '.join(hosts)}, one at a time" if host is None else host)),
              highlight=False, soft_wrap=True)
    if not wait:
        out.print("follow it on the admin page or at GET /api/v1/reload", highlight=False,
                  soft_wrap=True)
        return
    _follow(config, manager, rollout, timeout)


def _follow(config: Any, manager: str | None, rollout: dict[str, Any], timeout: float) -> None:
    """Print each host's step as it changes until the rollout ends; exit as it ended."""
    shown: dict[str, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout
    while True:
        for step in rollout.get("hosts", []):
            now = (str(step.get("state")), str(step.get("note") or ""))
            if shown.get(step["host"]) != now and now[0] != "waiting":
                shown[step["host"]] = now
                out.print(escape(f"{step['host']}: {now[0]}" + (f", {now[1]}" if now[1] else "")),
                          highlight=False, soft_wrap=True)
        if rollout.get("state") != "running":
            break
        if time.monotonic() > deadline:
            _fail(RELOAD_INCOMPLETE, f"reload {rollout['id']} still running after "
                                     f"{timeout:.0f} s (it goes on: GET /api/v1/reload)")
        time.sleep(POLL_S)
        rollout = _current(config, manager, str(rollout["id"]), rollout)
    note = str(rollout.get("note") or rollout.get("state"))
    if rollout.get("state") == "stopped":
        _fail(RELOAD_FAILED, note)
    if any(step.get("state") != "took" for step in rollout.get("hosts", [])):
        _fail(RELOAD_INCOMPLETE, note)
    out.print(escape(note), highlight=False, soft_wrap=True)


def _current(config: Any, manager: str | None, rollout_id: str,
             last: dict[str, Any]) -> dict[str, Any]:
    """The rollout as the manager has it now; the last one while the manager is unreachable
    (it may be restarting: --wait keeps trying until its timeout)."""
    try:
        current = _request(config, manager, "GET", "/api/v1/reload", needs_token=False,
                           retry=True)
    except httpx.HTTPError:
        return last
    if not isinstance(current, dict) or current.get("id") != rollout_id:
        _fail(RELOAD_INCOMPLETE, f"the manager no longer knows reload {rollout_id} (restarted?"
                                 " a rollout in progress is lost then): see the hosts' code "
                                 "on the admin page")
    return current


def _unknown(reply: dict[str, Any], what: str, undo: str) -> None:
    """A note when the manager has heard of no queue or host of that name (a typo pauses or
    drains nothing): the control is kept and applies if one appears."""
    if reply.get("known", True) is not False:
        return
    like = [str(name) for name in reply.get("like") or []]
    guess = f" (did you mean {', '.join(like)}?)" if like else ""
    err.print(escape(f"note: {what}{guess}: nothing changes until one does; "
                     f"`qcluster {undo}` lifts it"), highlight=False, soft_wrap=True)


def _since(at: Any) -> str:
    """A control's ``at`` as UTC text; anything else the manager sent is shown as it is."""
    if isinstance(at, int | float) and not isinstance(at, bool):
        return utc_text(float(at), "%Y-%m-%d %H:%M:%S")
    return str(at)


def _name(name: str) -> str:
    with user_errors():  # exit 2, before any request
        return check_queue_name(name)


def _post(config: Any, manager: str | None, path: str) -> dict[str, Any]:
    reply: dict[str, Any] = _request(config, manager, "POST", path, needs_token=True)
    return reply


def _request(config: Any, manager: str | None, method: str, path: str, *,
             needs_token: bool, retry: bool = False) -> Any:
    """The manager's JSON answer; exits on a refusal (and, unless ``retry``, on an
    unreachable manager or a server error: ``retry`` raises httpx.HTTPError then)."""
    settings = settings_for(config, manager_url=manager)
    url = (settings.manager_url or DEFAULT_MANAGER_URL).rstrip("/")
    headers = {}
    token = _token(settings, url)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    elif needs_token:
        with user_errors():
            raise ConfigError(
                "no token: set `token` in qcluster.toml or QCLUSTER_TOKEN to the manager's "
                "token (or one of its named tokens); a manager on this machine without one "
                f"writes a local token to {token_path(settings.state_dir)} (run this command "
                "in the directory it was started in)")
    try:
        response = httpx.request(method, url + path, headers=headers, timeout=TIMEOUT_S)
        if retry and response.status_code >= 500:
            response.raise_for_status()
    except httpx.HTTPError as exc:
        if retry:
            raise
        _fail(MANAGER_UNREACHABLE, f"the manager at {url} is unreachable: {exc}")
    if response.status_code == 401 and token and not settings.token:
        _fail(exitcodes.CONFIG, f"no token configured, and the manager at {url} refused the "
                                f"local token of {token_path(settings.state_dir)} (it was "
                                "started in another directory, or with a token): set `token` "
                                "in qcluster.toml or QCLUSTER_TOKEN to the manager's token")
    if response.status_code == 401:
        _fail(TOKEN_REFUSED, f"the manager at {url} refused the token: set `token` / "
                             "QCLUSTER_TOKEN to the manager's token")
    if response.status_code >= 500:
        _fail(MANAGER_UNREACHABLE, f"the manager at {url} failed: {_detail(response)}")
    if response.status_code >= 400:
        _fail(RELOAD_REFUSED if response.status_code in (404, 409) else exitcodes.USAGE,
              f"the manager at {url} refused it: {_detail(response)}")
    try:
        return response.json()
    except ValueError:
        _fail(MANAGER_UNREACHABLE, f"{url} answered something that is not a qcluster manager")


def _token(settings: Settings, url: str) -> str | None:
    """The configured token; else, for a manager on this machine, the local token its
    first start wrote to the state directory (never sent to another machine)."""
    if settings.token:
        return settings.token
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return None
    if not is_loopback(host):
        return None
    with user_errors():
        return read_local_token(settings.state_dir)


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return f"{response.status_code} {detail or response.reason_phrase}"


def _fail(code: int, message: str) -> NoReturn:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)

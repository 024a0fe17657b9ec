"""``qcluster pause|resume QUEUE``, ``qcluster drain|undrain HOST``, ``qcluster controls``:
the manager's controls from the command line, through its HTTP API.

The manager keeps every control in the broker (a restart keeps them) and records who set
it: the name of the token sent (``token`` / ``QCLUSTER_TOKEN``; never on the command line,
where ``ps`` would show it). Registered as entry points of ``qcluster.commands``.

Exit codes (docs/operations.md, "Pause, resume, drain"): 0 done; 2 a name outside the
queue-name rule; 6 no token configured; 10 the manager is unreachable or failed (the
broker did not store the change: 503); 11 the manager refused the token (401).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.markup import escape
from rich.table import Table

from qcluster import exitcodes
from qcluster.cli_support import ConfigOpt, err, out, settings_for, user_errors
from qcluster.controls import utc_text
from qcluster.errors import ConfigError
from qcluster.names import check_queue_name

#: The manager could not be reached, or answered with a server error.
MANAGER_UNREACHABLE = 10
#: The manager refused the token.
TOKEN_REFUSED = 11
DEFAULT_MANAGER_URL = "http://127.0.0.1:7300"
TIMEOUT_S = 30.0

ManagerOpt = Annotated[
    str | None,
    typer.Option("--manager", help="The manager's URL (default: $QCLUSTER_MANAGER_URL, "
                                   f"config manager_url, {DEFAULT_MANAGER_URL})"),
]
QueueArg = Annotated[str, typer.Argument(help="Queue name")]
HostArg = Annotated[str, typer.Argument(help="Host name (as the master reports it)")]


def pause(queue: QueueArg, manager: ManagerOpt = None, config: ConfigOpt = None) -> None:
    """Plan no slot for QUEUE until it is resumed (kept across manager restarts)."""
    reply = _post(config, manager, f"/api/v1/queues/{_name(queue)}/pause")
    out.print(escape(f"queue {queue} paused by {reply.get('by')}: no slot from the "
                     "next planning round"), highlight=False)


def resume(queue: QueueArg, manager: ManagerOpt = None, config: ConfigOpt = None) -> None:
    """Plan slots for QUEUE again."""
    _post(config, manager, f"/api/v1/queues/{_name(queue)}/resume")
    out.print(escape(f"queue {queue} resumed"), highlight=False)


def drain(host: HostArg, manager: ManagerOpt = None, config: ConfigOpt = None) -> None:
    """Plan no slot on HOST (its slots move to the others) until it is undrained."""
    reply = _post(config, manager, f"/api/v1/hosts/{_name(host)}/drain")
    out.print(escape(f"host {host} drained by {reply.get('by')}: its slots move to the "
                     "other hosts"), highlight=False)


def undrain(host: HostArg, manager: ManagerOpt = None, config: ConfigOpt = None) -> None:
    """Plan slots on HOST again."""
    _post(config, manager, f"/api/v1/hosts/{_name(host)}/undrain")
    out.print(escape(f"host {host} undrained"), highlight=False)


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
             needs_token: bool) -> Any:
    settings = settings_for(config, manager_url=manager)
    url = (settings.manager_url or DEFAULT_MANAGER_URL).rstrip("/")
    headers = {}
    if settings.token:
        headers["Authorization"] = f"Bearer {settings.token}"
    elif needs_token:
        with user_errors():
            raise ConfigError("no token: set `token` in qcluster.toml or QCLUSTER_TOKEN to the "
                              "manager's token (or one of its named tokens)")
    try:
        response = httpx.request(method, url + path, headers=headers, timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        _fail(MANAGER_UNREACHABLE, f"the manager at {url} is unreachable: {exc}")
    if response.status_code == 401:
        _fail(TOKEN_REFUSED, f"the manager at {url} refused the token: set `token` / "
                             "QCLUSTER_TOKEN to the manager's token")
    if response.status_code >= 500:
        _fail(MANAGER_UNREACHABLE, f"the manager at {url} failed: {_detail(response)}")
    if response.status_code >= 400:
        _fail(exitcodes.USAGE, f"the manager at {url} refused it: {_detail(response)}")
    try:
        return response.json()
    except ValueError:
        _fail(MANAGER_UNREACHABLE, f"{url} answered something that is not a qcluster manager")


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return f"{response.status_code} {detail or response.reason_phrase}"


def _fail(code: int, message: str) -> NoReturn:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)

"""The admin pages, mounted by the manager: ``install(app, source)``.

Server-rendered (Jinja2), so every part works with JavaScript disabled; a small script
only refreshes the page regions in place every few seconds. Sorting is a query
parameter, so a refresh (which fetches the same URL) keeps it, and the in-place swap
keeps the scroll position.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from qcluster.admin_ui.display import load_bar_percent, load_text
from qcluster.admin_ui.job_routes import job_routes
from qcluster.admin_ui.jobs_view import preview
from qcluster.admin_ui.source import (
    ActionSource,
    BrokerNodesSource,
    ClusterSource,
    ControlSource,
    JobSource,
    PeriodicSource,
)
from qcluster.admin_ui.views import (
    CELLS_SHOWN,
    GRID_MAX_QUEUES,
    age,
    history_charts,
    host_rows,
    matching,
    mib,
    running_total,
    sort_queues,
    state_counts,
)
from qcluster.broker.health import BrokerHealth
from qcluster.controls import Control, utc_text
from qcluster.errors import BrokerError, InvalidQueueName
from qcluster.jobs import payload_of
from qcluster.names import check_queue_name
from qcluster.periodic import PeriodicJobView
from qcluster.security import bearer_token

HERE = Path(__file__).parent
REFRESH_S = 3
PAYLOAD_PREVIEW_CHARS = 160
DEAD_JOBS_SHOWN = 50
#: The overview's queue table shows this many rows in the chosen order (``?all=1``: every
#: one): at 150 queues the whole table was most of the page's weight in the browser.
QUEUES_SHOWN = 30
#: The overview's newest decisions (the manager keeps more: /api/v1/cluster has them).
DECISIONS_SHOWN = 50

templates = Jinja2Templates(directory=str(HERE / "templates"))
# The page's style and script (10 KiB) go inside each page: fetched from the manager apart,
# they waited for its busy worker threads (1.1 s of a 1.8 s overview load at 40 masters x
# 150 queues). /static keeps serving them for anyone who links to them.
templates.env.globals["admin_css"] = (HERE / "static" / "admin.css").read_text()
templates.env.globals["admin_js"] = (HERE / "static" / "admin.js").read_text()
#: What the overview says after a button did its work (``/?done=KIND&name=NAME``): fixed
#: texts, so a crafted link cannot put words on the page.
DONE = {"pause": "Queue {} paused.", "resume": "Queue {} resumed.",
        "drain": "Host {} drained.", "undrain": "Host {} undrained.",
        "reload": "Reload {} asked: its progress is under Code reload."}


def _context(request: Request, **values: Any) -> dict[str, Any]:
    return {"request": request, "refresh_s": REFRESH_S, "age": age, "mib": mib,
            "load_text": load_text, "load_bar": load_bar_percent, "utc": _utc, **values}


def build_router(source: ClusterSource) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    _overview_route(router, source)
    _detail_routes(router, source)
    _requeue_route(router, source)
    if isinstance(source, ActionSource):
        _action_routes(router, source)
    if isinstance(source, JobSource):
        job_routes(router, source, templates, _context)
    return router


def _overview_route(router: APIRouter, source: ClusterSource) -> None:
    """``GET /``: the cluster at a glance."""

    @router.get("/", response_class=HTMLResponse)
    def overview(request: Request, sort: str = "priority", dir: str = "desc",
                 done: str = "", name: str = "", q: str = "", host: str = "",
                 all: bool = False) -> Response:
        view = source.cluster_view()
        all_names = sorted(queue.name for queue in view.queues)
        queue_names = matching(all_names, q)
        shown = set(queue_names)
        queues = sort_queues([queue for queue in view.queues if queue.name in shown], sort, dir)
        controls = _controls(source)
        actions = isinstance(source, ActionSource)
        drained = {c.name for c in controls if c.kind == "drain"}
        rows = host_rows(list(view.hosts), drained)
        hosts = set(matching([r.host.name for r in rows], host))
        return templates.TemplateResponse(request, "index.html", _context(
            request, view=view, queues=queues, queue_names=queue_names, sort=sort, dir=dir,
            q=q, host=host, all_queues=len(all_names), matched=len(queues),
            queues_shown=queues if all else queues[:QUEUES_SHOWN], show_all=all,
            decisions=view.decisions[:DECISIONS_SHOWN],
            rows=[r for r in rows if r.host.name in hosts],
            host_states=state_counts(rows), slots_running=running_total(rows),
            grid=len(queue_names) <= GRID_MAX_QUEUES,
            cells_shown=CELLS_SHOWN, grid_max=GRID_MAX_QUEUES,
            now=view.generated_at or time.time(), controls=controls,
            periodic=_periodic_jobs(source), broker=_broker_nodes(source),
            paused_by={c.name: c for c in controls if c.kind == "pause"},
            drained_by={c.name: c for c in controls if c.kind == "drain"},
            actions=actions, done=_done(done, name),
            reload=source.reload_status() if isinstance(source, ActionSource) else None,
        ))


def _detail_routes(router: APIRouter, source: ClusterSource) -> None:
    """``GET /queues/{name}`` and ``GET /hosts/{name}``: one queue's, one host's page."""

    @router.get("/queues/{name}", response_class=HTMLResponse)
    def queue_detail(request: Request, name: str, requeued: int | None = None) -> Response:
        view = source.cluster_view()
        queue = next((q for q in view.queues if q.name == name), None)
        if queue is None:
            return _unknown_queue(request, name)
        return templates.TemplateResponse(request, "queue.html", _context(
            request, queue=queue, charts=history_charts(source.queue_history(name)),
            dead=source.dead_jobs(name, limit=DEAD_JOBS_SHOWN), dead_limit=DEAD_JOBS_SHOWN,
            payload=_payload_preview, requeued=requeued,
            paused=next((c for c in _controls(source)
                         if c.kind == "pause" and c.name == name), None),
            decisions=[d for d in view.decisions if d.queue == name][:20],
            broker=_broker_nodes(source),
        ))

    @router.get("/hosts/{name}", response_class=HTMLResponse)
    def host_detail(request: Request, name: str) -> Response:
        view = source.cluster_view()
        drained = {c.name for c in _controls(source) if c.kind == "drain"}
        row = next((r for r in host_rows(list(view.hosts), drained) if r.host.name == name),
                   None)
        if row is None:
            return _message(request, "Unknown host", f"No host named {name!r} has reported.",
                            404)
        return templates.TemplateResponse(request, "host.html", _context(
            request, row=row, now=view.generated_at or time.time()))


def _requeue_route(router: APIRouter, source: ClusterSource) -> None:
    """``POST /queues/{name}/requeue``: every dead job of the queue back, with the token."""

    @router.post("/queues/{name}/requeue", response_class=HTMLResponse)
    def requeue(request: Request, name: str, token: str = Form("")) -> Response:
        try:
            check_queue_name(name)  # the API's rule: the broker is never asked about it
        except InvalidQueueName:
            return _unknown_queue(request, name)
        bearer = bearer_token(request.headers.get("authorization"))
        if not source.check_token(token or bearer):
            return templates.TemplateResponse(
                request, "message.html",
                _context(request, title="Not authorised",
                         text="Requeueing dead jobs needs the manager's token "
                              "(qcluster.toml `token` or QCLUSTER_TOKEN)."),
                status_code=401,
            )
        moved = source.requeue_dead(name)
        return RedirectResponse(f"/queues/{name}?requeued={moved}", status_code=303)


def _action_routes(router: APIRouter, source: ActionSource) -> None:
    """The overview's buttons: each posts the page's token field to one of these."""

    def control(kind: str, path: str, call: Callable[[str, str], object]) -> None:
        def route(request: Request, name: str, token: str = Form("")) -> Response:
            def done(by: str) -> str:
                call(name, by)
                return name

            return _act(request, source, token, kind, name, done)

        router.post(path, response_class=HTMLResponse)(route)

    control("pause", "/queues/{name}/pause", source.pause)
    control("resume", "/queues/{name}/resume", lambda name, by: source.resume(name))
    control("drain", "/hosts/{name}/drain", source.drain)
    control("undrain", "/hosts/{name}/undrain", lambda name, by: source.undrain(name))

    @router.post("/hosts/{name}/reload", response_class=HTMLResponse)
    def reload_host(request: Request, name: str, token: str = Form("")) -> Response:
        return _act(request, source, token, "reload", name,
                    lambda by: str(source.reload(name, by)["id"]))

    @router.post("/reload", response_class=HTMLResponse)
    def reload_all(request: Request, token: str = Form("")) -> Response:
        return _act(request, source, token, "reload", None,
                    lambda by: str(source.reload(None, by)["id"]))


def _act(request: Request, source: ActionSource, token: str, kind: str, name: str | None,
         action: Callable[[str], str]) -> Response:
    """Check the name and the token (the form's field, or a Bearer header), do ``action``
    as the token's name, and go back to the overview saying what was done."""
    if name is not None:
        try:
            check_queue_name(name)
        except InvalidQueueName:
            return _message(request, "Unknown name", f"No queue or host named {name!r}.", 404)
    by = source.token_name(token or bearer_token(request.headers.get("authorization")))
    if by is None:
        return _message(request, "Not authorised", "This button needs the manager's token "
                        "(qcluster.toml `token` or QCLUSTER_TOKEN, or a named [tokens] one).",
                        401)
    try:
        done = action(by)
    except ValueError as exc:  # the manager refused it (ReloadRefused: 404 / 409)
        return _message(request, "Refused", str(exc), int(getattr(exc, "status", 409)))
    except BrokerError as exc:
        return _message(request, "Not done", f"The broker did not store the change: {exc}",
                        503)
    return RedirectResponse(f"/?done={kind}&name={done}", status_code=303)


def _done(kind: str, name: str) -> str | None:
    """The notice for ``/?done=KIND&name=NAME`` (None: nothing, or not ours)."""
    try:
        return DONE[kind].format(check_queue_name(name))
    except (KeyError, InvalidQueueName):
        return None


def _message(request: Request, title: str, text: str, status: int) -> Response:
    return templates.TemplateResponse(request, "message.html",
                                      _context(request, title=title, text=text),
                                      status_code=status)


def _controls(source: ClusterSource) -> list[Control]:
    return source.controls() if isinstance(source, ControlSource) else []


def _periodic_jobs(source: ClusterSource) -> list[PeriodicJobView]:
    return source.periodic_jobs() if isinstance(source, PeriodicSource) else []


def _broker_nodes(source: ClusterSource) -> BrokerHealth | None:
    return source.broker_nodes() if isinstance(source, BrokerNodesSource) else None


def _payload_preview(body: str) -> str:
    """A dead letter's payload on one line, out of its stored envelope."""
    return preview(payload_of(body), PAYLOAD_PREVIEW_CHARS)


def _utc(at: float) -> str:
    """'2026-11-24 03:10:05 UTC': when a control was set, as an operator compares it (a
    value no date can show is shown as the number: the page never fails on it)."""
    return utc_text(at)


def _unknown_queue(request: Request, name: str) -> Response:
    return templates.TemplateResponse(
        request, "message.html",
        _context(request, title="Unknown queue", text=f"No queue named {name!r}."),
        status_code=404,
    )


def install(app: FastAPI, source: ClusterSource) -> None:
    """Mount the admin pages at ``/`` and their assets at ``/static``."""
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="admin-static")
    app.include_router(build_router(source))

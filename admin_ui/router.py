"""The admin pages, mounted by the manager: ``install(app, source)``.

Server-rendered (Jinja2), so every part works with JavaScript disabled; a small script
only refreshes the page regions in place every few seconds. Sorting is a query
parameter, so a refresh (which fetches the same URL) keeps it, and the in-place swap
keeps the scroll position.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from admin_ui.charts import Series, line_chart
from admin_ui.display import load_bar_percent, load_text
from admin_ui.source import ClusterSource
from qcluster.messages import HistoryPoint, QueueView
from qcluster.security import bearer_token

HERE = Path(__file__).parent
REFRESH_S = 3
#: Sortable columns of the queue table: query value -> QueueView attribute.
SORT_KEYS = {
    "name": "name", "priority": "priority", "slots": "slots_current", "avg": "slots_avg",
    "planned": "slots_planned", "load": "load", "backlog": "backlog", "locked": "locked",
    "delayed": "delayed", "dead": "dead", "in": "rate_in", "out": "rate_out",
    "job": "mean_job_seconds",
}
PAYLOAD_PREVIEW_CHARS = 160
DEAD_JOBS_SHOWN = 50

templates = Jinja2Templates(directory=str(HERE / "templates"))


def sort_queues(queues: list[QueueView], key: str, direction: str) -> list[QueueView]:
    """Queues ordered by a column; unknown keys fall back to priority, highest first."""
    attribute = SORT_KEYS.get(key)
    if attribute is None:
        return sorted(queues, key=lambda q: (-q.priority, q.name))

    def value(queue: QueueView) -> Any:
        found = getattr(queue, attribute)
        return math.inf if found is None else found  # an undefined load: work, no slot

    return sorted(queues, key=value, reverse=direction == "desc")


def age(seconds: float) -> str:
    """'4s', '3m 10s', '2h 5m': the age of a report as a person reads it."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60}m"


def mib(value: int) -> str:
    return f"{value / (1 << 20):,.0f} MiB"


def history_charts(points: list[HistoryPoint]) -> list[str]:
    """The four charts of the queue page, x in seconds relative to now."""
    now = points[-1].at if points else 0.0

    def line(label: str, color: str, attribute: str, scale: float = 1.0) -> Series:
        return Series(label, color, [(p.at - now, getattr(p, attribute) * scale)
                                     for p in points if getattr(p, attribute) is not None])

    return [
        line_chart("Backlog (ready jobs)", [line("backlog", "#c0392b", "backlog")]),
        line_chart("Slots", [
            line("planned", "#2c7be5", "slots_planned"),
            line("running", "#2e9d58", "slots_current"),
        ]),
        line_chart("Load", [line("load %", "#8e44ad", "load", 100.0)], unit="%"),
        line_chart("Throughput", [line("jobs/s", "#d68910", "rate_out")], unit="/s"),
    ]


def _context(request: Request, **values: Any) -> dict[str, Any]:
    return {"request": request, "refresh_s": REFRESH_S, "age": age, "mib": mib,
            "load_text": load_text, "load_bar": load_bar_percent, **values}


def build_router(source: ClusterSource) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.get("/", response_class=HTMLResponse)
    def overview(request: Request, sort: str = "priority", dir: str = "desc") -> Response:
        view = source.cluster_view()
        queues = sort_queues(list(view.queues), sort, dir)
        queue_names = sorted(q.name for q in view.queues)
        return templates.TemplateResponse(request, "index.html", _context(
            request, view=view, queues=queues, queue_names=queue_names, sort=sort, dir=dir,
            now=view.generated_at or time.time(),
        ))

    @router.get("/queues/{name}", response_class=HTMLResponse)
    def queue_detail(request: Request, name: str, requeued: int | None = None) -> Response:
        view = source.cluster_view()
        queue = next((q for q in view.queues if q.name == name), None)
        if queue is None:
            return templates.TemplateResponse(
                request, "message.html",
                _context(request, title="Unknown queue", text=f"No queue named {name!r}."),
                status_code=404,
            )
        return templates.TemplateResponse(request, "queue.html", _context(
            request, queue=queue, charts=history_charts(source.queue_history(name)),
            dead=source.dead_jobs(name, limit=DEAD_JOBS_SHOWN), dead_limit=DEAD_JOBS_SHOWN,
            preview=PAYLOAD_PREVIEW_CHARS, requeued=requeued,
            decisions=[d for d in view.decisions if d.queue == name][:20],
        ))

    @router.post("/queues/{name}/requeue", response_class=HTMLResponse)
    def requeue(request: Request, name: str, token: str = Form("")) -> Response:
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

    return router


def install(app: FastAPI, source: ClusterSource) -> None:
    """Mount the admin pages at ``/`` and their assets at ``/static``."""
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="admin-static")
    app.include_router(build_router(source))

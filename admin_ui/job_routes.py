"""The job browser's pages: a job found by id (the search box of every page), a queue's
running, delayed, retrying and dead jobs a page at a time, and dead letters requeued or
deleted one by one, by selection or all at once (token-guarded, like every button)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from qcluster.admin_ui.jobs_view import (
    PAGE_SIZE,
    STATE_TEXT,
    STATES,
    Pages,
    duration,
    page_offset,
    pretty_json,
    preview,
)
from qcluster.admin_ui.source import JobSource
from qcluster.errors import BrokerError, InvalidQueueName
from qcluster.names import check_queue_name
from qcluster.security import bearer_token

#: A job id as the API takes it (producers make 32 hex digits; a broker may hold others).
MAX_ID_CHARS = 200
#: The furthest offset a listing link may ask for (the API's bound): a bigger one is read
#: as this, then the last page is shown.
MAX_OFFSET = 10_000_000
#: A payload in a listing's row is cut shorter than on the job's own page.
ROW_PAYLOAD_CHARS = 2_000
#: What a listing says after a button did its work: fixed texts (the count is a number).
DONE = {"requeued": "Requeued {} dead job(s).", "deleted": "Deleted {} dead job(s)."}

#: The ticked rows' ids (a form field given once per row).
NO_IDS: list[str] = Form([])


class _Renderer:
    """The job browser's templates rendered with the admin pages' context."""

    def __init__(self, templates: Jinja2Templates,
                 context: Callable[..., dict[str, Any]]) -> None:
        self.templates, self.context = templates, context

    def render(self, request: Request, name: str, status: int = 200,
               **values: Any) -> Response:
        return self.templates.TemplateResponse(request, name, self.context(
            request, now=time.time(), pretty=pretty_json, preview=preview,
            duration=duration, state_text=STATE_TEXT, **values), status_code=status)

    def message(self, request: Request, title: str, text: str, status: int) -> Response:
        return self.render(request, "message.html", status, title=title, text=text)


def job_routes(router: APIRouter, source: JobSource, templates: Jinja2Templates,
               context: Callable[..., dict[str, Any]]) -> None:
    """Add the job browser's routes to the admin pages' router."""
    ui = _Renderer(templates, context)
    _find_route(router, source, ui)
    _listing_route(router, source, ui)
    _dead_action_route(router, source, ui, "requeued", source.requeue_dead_jobs)
    _dead_action_route(router, source, ui, "deleted", source.delete_dead_jobs)


def _find_route(router: APIRouter, source: JobSource, ui: _Renderer) -> None:
    """``GET /jobs?id=``: a job found by id."""

    @router.get("/jobs", response_class=HTMLResponse)
    def find(request: Request, id: str = "") -> Response:
        job_id = id.strip()
        if not job_id:
            return ui.render(request, "job.html", job=None, job_id="")
        if len(job_id) > MAX_ID_CHARS:
            return ui.message(request, "No such job", "A job id is at most "
                              f"{MAX_ID_CHARS} characters.", 404)
        try:
            found = source.find_job(job_id)
        except (BrokerError, HTTPException) as exc:
            return ui.message(request, "Broker unavailable", _why(exc), 503)
        if found is None:
            return ui.render(request, "job.html", 404, job=None, job_id=job_id)
        return ui.render(request, "job.html", job=found, job_id=job_id)


def _listing_route(router: APIRouter, source: JobSource, ui: _Renderer) -> None:
    """``GET /queues/{name}/jobs``: a page of a queue's jobs in one state."""

    @router.get("/queues/{name}/jobs", response_class=HTMLResponse)
    def listing(request: Request, name: str, state: str = "dead", offset: int = 0,
                done: str = "", n: int = 0) -> Response:
        try:
            check_queue_name(name)
        except InvalidQueueName:
            return ui.message(request, "Unknown queue", f"No queue named {name!r}.", 404)
        if state not in STATES:
            state = "dead"
        offset = page_offset(min(offset, MAX_OFFSET), None)  # a link's number, bounded
        try:
            page = source.job_page(name, state, offset, PAGE_SIZE)
            if not page.jobs and page.total and offset >= page.total:  # past the end
                page = source.job_page(name, state, page_offset(offset, page.total),
                                       PAGE_SIZE)
        except NotImplementedError as exc:
            return ui.message(request, "Not available", str(exc), 501)
        except BrokerError as exc:
            return ui.message(request, "Broker unavailable", _why(exc), 503)
        notice = DONE[done].format(max(0, n)) if done in DONE else None
        return ui.render(request, "jobs.html", queue=name, state=state, states=STATES,
                         page=page, pages=Pages(page.offset, len(page.jobs), page.total),
                         notice=notice, row_chars=ROW_PAYLOAD_CHARS)


def _dead_action_route(router: APIRouter, source: JobSource, ui: _Renderer, kind: str,
                       call: Callable[[str, list[str]], int]) -> None:
    """``POST /queues/{name}/dead/requeue`` or ``.../delete``: the chosen dead jobs, with
    the token; back to the listing, which says how many."""

    def route(request: Request, name: str, token: str = Form(""),
              ids: list[str] = NO_IDS, one: str = Form(""), offset: int = Form(0)
              ) -> Response:
        try:
            check_queue_name(name)
        except InvalidQueueName:
            return ui.message(request, "Unknown queue", f"No queue named {name!r}.", 404)
        if not source.check_token(token or bearer_token(
                request.headers.get("authorization"))):
            return ui.message(request, "Not authorised", "Requeueing or deleting dead "
                              "jobs needs the manager's token (qcluster.toml `token` or "
                              "QCLUSTER_TOKEN).", 401)
        chosen = [one] if one else [i for i in ids if i]
        if not chosen or any(len(i) > MAX_ID_CHARS for i in chosen):
            return ui.message(request, "Nothing chosen", "Choose the dead jobs first "
                              "(a row's button, or the boxes of the rows).", 400)
        try:
            count = call(name, chosen)
        except BrokerError as exc:
            return ui.message(request, "Not done", f"The broker did not do it: {exc}", 503)
        return RedirectResponse(
            f"/queues/{quote(name)}/jobs?state=dead&offset={max(0, offset)}"
            f"&done={kind}&n={count}", status_code=303)

    router.post(f"/queues/{{name}}/dead/{'requeue' if kind == 'requeued' else 'delete'}",
                response_class=HTMLResponse)(route)


def _why(exc: Exception) -> str:
    detail = getattr(exc, "detail", None)
    return str(detail if detail is not None else exc)

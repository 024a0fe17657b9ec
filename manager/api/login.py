"""A one-time login for the admin page: its buttons work without pasting the token.

``POST /api/v1/login`` (with a real token, never a session) mints a one-time code, valid
:data:`CODE_TTL_S`; ``GET /login?code=CODE`` spends it and answers a page whose script keeps
a random session id (never the token) in the browser's ``localStorage`` of the manager's
origin; sessions live in the manager's memory and end with it or after
:data:`SESSION_TTL_S`. The admin page's script sends the session id with each form post
(a ``session`` field) and :class:`SessionMiddleware` hands the session's token to the route
as an ``Authorization: Bearer`` header, so the page's forms check it as they check any token
and record who acted by the token's name.

No cookie: a browser sends a host's cookies to every port of it, so another web server on
this host (any local user's) would receive one. Storage is scoped to the origin, port
included: nothing the browser sends to another port carries the session. A state change
whose ``Origin`` is not the page's own host gets no token from a session either, and the
API (``/api/...``) never takes one.
"""

from __future__ import annotations

import html
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

from qcluster.manager.api.deps import ServiceDep, actor
from qcluster.security import ASGIApp, Receive, Scope, Send, read_body, replay_body

#: The form field the admin page's script adds to each post, and its storage key.
SESSION_FIELD = "session"
STORAGE_KEY = "qcluster_session"
#: Seconds a one-time code may wait before it is used.
CODE_TTL_S = 600.0
#: Seconds a session lasts (a working day).
SESSION_TTL_S = 12 * 3600.0
#: Codes and sessions kept at most (the oldest go first).
MAX_KEPT = 200
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
FORM_TYPE = "application/x-www-form-urlencoded"
MAX_FORM_FIELDS = 10_000
#: The login page is never cached nor named to another site (the spent code is its address).
PRIVATE_HEADERS = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}


class Logins:
    """One-time codes and the sessions they opened: token name -> its secret."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.codes: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def mint(self, secret: str) -> str:
        code = secrets.token_urlsafe(24)
        _keep(self.codes, code, (secret, self.clock() + CODE_TTL_S))
        return code

    def spend(self, code: str) -> str | None:
        """A new session id for a valid unused code (which is then gone); None otherwise."""
        found = self.codes.pop(code, None)
        if found is None or found[1] < self.clock():
            return None
        session = secrets.token_urlsafe(32)
        _keep(self.sessions, session, (found[0], self.clock() + SESSION_TTL_S))
        return session

    def secret(self, session: str | None) -> str | None:
        found = self.sessions.get(session or "")
        if found is None or found[1] < self.clock():
            return None
        return found[0]


def _keep(kept: OrderedDict[str, tuple[str, float]], key: str, value: tuple[str, float]) -> None:
    kept[key] = value
    while len(kept) > MAX_KEPT:
        kept.popitem(last=False)


router = APIRouter(tags=["login"])


def token_actor(request: Request, by: str = Depends(actor)) -> str:
    """:func:`actor`, with a real token only: a session never mints another one (one stolen
    session would otherwise renew itself forever)."""
    if getattr(request.state, "signed_in", False):
        raise HTTPException(401, "a login needs a real token (Authorization: Bearer ...), "
                                 "not a session", headers={"WWW-Authenticate": "Bearer"})
    return by


@router.post("/api/v1/login")
def mint(request: Request, service: ServiceDep, by: str = Depends(token_actor)
         ) -> dict[str, Any]:
    """A one-time login link for the admin page, acting as the token sent."""
    code = _logins(request).mint(service.tokens[by])
    return {"path": f"/login?code={code}", "expires_in_s": CODE_TTL_S}


@router.get("/login", include_in_schema=False)
def login(request: Request, code: str = "") -> Response:
    session = _logins(request).spend(code)
    if session is None:
        return PlainTextResponse("This login link was used already or has expired: ask for a "
                                 "new one (qcluster login).", status_code=401,
                                 headers=PRIVATE_HEADERS)
    return HTMLResponse(LOGIN_PAGE.format(session=html.escape(session)), headers=PRIVATE_HEADERS)


@router.get("/login.js", include_in_schema=False)
def login_script() -> Response:
    return Response(LOGIN_SCRIPT, media_type="text/javascript")


LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Signing in · qcluster admin</title>
<meta name="qcluster-session" content="{session}">
<script src="/login.js"></script></head>
<body><p>Signing in&hellip; (<a href="/">the admin page</a>)</p>
<noscript><p>This login needs JavaScript; without it, type the token into the admin page's
token field.</p></noscript></body></html>
"""

# localStorage belongs to this origin alone (scheme, host and port); admin.js reads it back.
LOGIN_SCRIPT = f"""(function () {{
  "use strict";
  var meta = document.querySelector('meta[name="qcluster-session"]');
  if (meta) {{ window.localStorage.setItem("{STORAGE_KEY}", meta.content); }}
  window.location.replace("/");
}})();
"""


def _logins(request: Request) -> Logins:
    logins: Logins = request.app.state.logins
    return logins


class SessionMiddleware:
    """ASGI: a form post (not to the API) from the page's own origin, with no Authorization
    header and a valid session in its ``session`` field, gets the session's token as
    ``Authorization: Bearer`` (and ``request.state.signed_in``)."""

    def __init__(self, app: ASGIApp, *, logins: Logins) -> None:
        self.app = app
        self.logins = logins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        named = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
        if not _may_sign_in(scope, named):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive) or b""  # GuardMiddleware (outside) bounded it
        secret = self.logins.secret(form_field(body, SESSION_FIELD))
        if secret is not None:
            headers.append((b"authorization", f"Bearer {secret}".encode("latin-1")))
            scope["headers"] = headers
            scope.setdefault("state", {})["signed_in"] = True
        await self.app(scope, replay_body(body, receive), send)


def _may_sign_in(scope: Scope, headers: dict[str, str]) -> bool:
    """A page's state change: an HTTP form post, not to the API, from the page's origin."""
    return (scope["type"] == "http" and scope.get("method") not in SAFE_METHODS
            and not str(scope.get("path", "")).startswith("/api/")
            and "authorization" not in headers
            and headers.get("content-type", "").startswith(FORM_TYPE)
            and _same_origin(headers))


def form_field(body: bytes, name: str) -> str | None:
    """The first value of ``name`` in a urlencoded form body; None when absent (or among
    too many fields)."""
    try:
        values = parse_qs(body.decode("latin-1"), max_num_fields=MAX_FORM_FIELDS).get(name)
    except ValueError:
        return None
    return values[0] if values else None


def _same_origin(headers: dict[str, str]) -> bool:
    """No Origin header (a same-origin form in some browsers, a CLI), or one whose host is
    the request's Host."""
    origin = headers.get("origin")
    if origin is None:
        return True
    try:
        return urlsplit(origin).netloc.lower() == headers.get("host", "").lower()
    except ValueError:
        return False

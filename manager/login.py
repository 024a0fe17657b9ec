"""A one-time login for the admin page: its buttons work without pasting the token.

``POST /api/v1/login`` (with a token) mints a one-time code, valid :data:`CODE_TTL_S`;
``GET /login?code=CODE`` spends it and sets an HttpOnly, SameSite=Strict session cookie
(the cookie is a random session id, never the token; sessions live in the manager's memory
and end with it or after :data:`SESSION_TTL_S`). :class:`SessionMiddleware` then hands the
session's token to the routes as an ``Authorization: Bearer`` header, so the API and the
page's forms check it as they check any token, and records who acted by the token's name.

A cross-site form cannot use the session: the cookie is SameSite=Strict, and a state change
whose ``Origin`` is not the page's own host gets no token from it.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, RedirectResponse, Response

from qcluster.manager.api_deps import ServiceDep, actor
from qcluster.security import ASGIApp, Receive, Scope, Send

COOKIE = "qcluster_session"
#: Seconds a one-time code may wait before it is used.
CODE_TTL_S = 600.0
#: Seconds a session lasts (a working day).
SESSION_TTL_S = 12 * 3600.0
#: Codes and sessions kept at most (the oldest go first).
MAX_KEPT = 200
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


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


@router.post("/api/v1/login")
def mint(request: Request, service: ServiceDep, by: str = Depends(actor)) -> dict[str, Any]:
    """A one-time login link for the admin page, acting as the token sent."""
    code = _logins(request).mint(service.tokens[by])
    return {"path": f"/login?code={code}", "expires_in_s": CODE_TTL_S}


@router.get("/login", include_in_schema=False)
def login(request: Request, code: str = "") -> Response:
    session = _logins(request).spend(code)
    if session is None:
        return PlainTextResponse("This login link was used already or has expired: ask for a "
                                 "new one (qcluster login).", status_code=401)
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(COOKIE, session, max_age=int(SESSION_TTL_S), path="/", httponly=True,
                        samesite="strict")
    return response


def _logins(request: Request) -> Logins:
    logins: Logins = request.app.state.logins
    return logins


class SessionMiddleware:
    """ASGI: a request with a valid session cookie and no Authorization header gets the
    session's token as ``Authorization: Bearer`` (and ``request.state.signed_in``)."""

    def __init__(self, app: ASGIApp, *, logins: Logins) -> None:
        self.app = app
        self.logins = logins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self._sign_in(scope)
        await self.app(scope, receive, send)

    def _sign_in(self, scope: Scope) -> None:
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        named = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
        if "authorization" in named:
            return
        secret = self.logins.secret(_cookie(named.get("cookie", ""), COOKIE))
        if secret is None:
            return
        if scope.get("method") not in SAFE_METHODS and not _same_origin(named):
            return  # a cross-site state change: not with this session
        headers.append((b"authorization", f"Bearer {secret}".encode("latin-1")))
        scope["headers"] = headers
        scope.setdefault("state", {})["signed_in"] = True


def _cookie(header: str, name: str) -> str | None:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


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

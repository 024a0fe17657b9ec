"""What the manager's routes share: the service (``app.state.service``, set by
``create_app``), the token checks and the path-name rule.

Every mutating endpoint needs the token (``Authorization: Bearer``); so do the masters'
reports once a token is set (without one, only a loopback manager takes them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import Depends, Header, HTTPException, Path, Request

from qcluster.errors import BrokerError
from qcluster.manager.service import ManagerService
from qcluster.policy import QUEUE_NAME_PATTERN
from qcluster.security import bearer_token

#: A queue or host in a path: the queue-name rule (422 otherwise, before any broker call).
NamePath = Annotated[str, Path(pattern=QUEUE_NAME_PATTERN)]
#: The Authorization header (``Bearer TOKEN``), when sent.
AuthorizationHeader = Annotated[str | None, Header()]

T = TypeVar("T")


async def get_service(request: Request) -> ManagerService:
    """The service the app was created for."""
    service: ManagerService = request.app.state.service
    return service


ServiceDep = Annotated[ManagerService, Depends(get_service)]


def _token_required() -> HTTPException:
    return HTTPException(401, "a valid token is required (Authorization: Bearer ...)",
                         headers={"WWW-Authenticate": "Bearer"})


def authorised(service: ServiceDep, authorization: AuthorizationHeader = None) -> None:
    if not service.check_token(bearer_token(authorization)):
        raise _token_required()


async def reporter_authorised(request: Request, service: ServiceDep,
                              authorization: AuthorizationHeader = None) -> None:
    """With a token set, reports need it; without one (the local token alone does not
    count: masters do not read it), only a loopback manager (the CLI refuses a public bind
    without a token) takes them, from this machine.

    Async (a few comparisons, no I/O): a report's checks run on the event loop instead of
    waiting for a thread of the pool."""
    configured = service.tokens and not getattr(request.app.state, "local_token_only", False)
    if configured or not request.app.state.loopback:
        authorised(service, authorization)


def actor(service: ServiceDep, authorization: AuthorizationHeader = None) -> str:
    """The name of the request's token (who changes a control); 401 without one."""
    name = service.token_name(bearer_token(authorization))
    if name is None:
        raise _token_required()
    return name


#: A route's dependency: 401 without a valid token.
GUARDED = [Depends(authorised)]


def stored(change: Callable[[], T]) -> T:
    """A control change, or 503 when the broker cannot keep it (nothing changed)."""
    try:
        return change()
    except BrokerError as exc:
        raise HTTPException(503, f"the broker did not store the change: {exc}") from None

"""The RabbitMQ backend's message conventions: qcluster's headers and how a delivered
message is read (counted redeliveries, malformed properties, dead letters), pure."""

from __future__ import annotations

import math
from typing import Any

from qcluster.broker.base import DeadJob
from qcluster.failures import JobError
from qcluster.job import JSON_CONTENT_TYPE, Delivery

ATTEMPTS_HEADER = "x-qc-attempts"
ACTIVATE_HEADER = "x-qc-activate-at"
REASON_HEADER = "x-qc-reason"
DEAD_AT_HEADER = "x-qc-dead-at"
#: The job's last error (qcluster.failures.JobError as JSON), on a postponed copy and a
#: dead letter.
ERROR_HEADER = "x-qc-error"
#: Present on a copy republished after its take ended without a settle (its slot died,
#: or a lock expired): the slot runs it alone.
SUSPECT_HEADER = "x-qc-suspect"
#: Set by a quorum queue on a redelivery: how many consumers holding this message died.
DELIVERY_COUNT_HEADER = "x-delivery-count"


def uncounted_redelivery(message: Any) -> bool:
    """Redelivered after a consumer died, on a queue that does not count deliveries."""
    headers = message.headers or {}
    return bool(message.delivery_info.get("redelivered")) and DELIVERY_COUNT_HEADER not in headers


def charged(suspect: bool, redeliveries: int) -> int:
    """Attempts charged for ``redeliveries`` (deaths of consumers that held the message).

    A consumer that dies gets every message it held redelivered: the one running and the
    rest of its take and read-ahead, and nothing left says which one ran. So the first
    death of a message that was not suspect is not charged: it comes back suspect and
    runs alone (see Consumers._hold_one_suspect). A death of a suspect message is its
    own (it ran alone) and is charged. A quorum queue counts every death, suspect or not
    when it happened: only the first is forgiven (the message is suspect from then on,
    being redelivered)."""
    if redeliveries <= 0:
        return 0
    return redeliveries if suspect else redeliveries - 1


def charge_redelivery(headers: dict[str, Any], redeliveries: int) -> None:
    """Record ``redeliveries`` in the headers of a redelivered message's copy: attempts
    charged by :func:`charged`, and suspect. An unreadable count stays as it is: the slot
    dead-letters the copy as malformed."""
    if redeliveries <= 0:
        return
    attempts = whole(headers.get(ATTEMPTS_HEADER, 0))
    if attempts is not None:
        headers[ATTEMPTS_HEADER] = attempts + charged(SUSPECT_HEADER in headers, redeliveries)
    headers[SUSPECT_HEADER] = 1


def fold_delivery_count(headers: dict[str, Any]) -> None:
    """A copy of a quorum queue's message records the broker's redeliveries in qcluster's
    own count (charged as :func:`charged` says): the broker's header is dropped (the copy
    is a new message whose count starts at 0, and RabbitMQ would overwrite a kept one at
    its first redelivery, losing the earlier deaths; kept as it is, it would be added
    again). Unreadable values stay: the slot dead-letters the copy as malformed."""
    if DELIVERY_COUNT_HEADER not in headers:
        return
    redeliveries = whole(headers[DELIVERY_COUNT_HEADER])
    if redeliveries is None or whole(headers.get(ATTEMPTS_HEADER, 0)) is None:
        return
    del headers[DELIVERY_COUNT_HEADER]
    charge_redelivery(headers, redeliveries)


def taken_attempts(headers: dict[str, Any]) -> tuple[int, bool]:
    """A delivered message's attempt number (this take included) and whether it is
    suspect. Raises ValueError or TypeError on an unreadable count (malformed)."""
    attempts = int(headers.get(ATTEMPTS_HEADER, 0)) + 1
    suspect = SUSPECT_HEADER in headers
    if DELIVERY_COUNT_HEADER in headers:  # quorum queues count redeliveries
        redeliveries = int(headers[DELIVERY_COUNT_HEADER])
        attempts += charged(suspect, redeliveries)
        suspect = suspect or redeliveries > 0
    return attempts, suspect


def released_headers(delivery: Delivery) -> dict[str, Any]:
    """Headers of the copy of an unstarted job: its takes before this one, as before."""
    headers: dict[str, Any] = {ATTEMPTS_HEADER: max(delivery.attempts - 1, 0),
                               ACTIVATE_HEADER: delivery.activate_at}
    if delivery.suspect:
        headers[SUSPECT_HEADER] = 1
    return headers


def whole(value: Any) -> int | None:
    """A header's whole number, or None when it is not one."""
    if isinstance(value, bool):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number >= 0 else None


def is_clean(text: str) -> bool:
    """Valid Unicode text: py-amqp decodes an invalid UTF-8 string with escapes
    (see :mod:`qcluster.broker.amqp_readahead`) instead of failing the whole read."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(value: Any) -> str:
    """``value`` as clean text: invalid bytes (escaped by the reader) become U+FFFD."""
    text = value if isinstance(value, str) else str(value)
    if is_clean(text):
        return text
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def malformed_delivery(
    message: Any, exc: BaseException, receipt: tuple[int, int], now: float, why: str
) -> Delivery:
    """A delivery the slot dead-letters without running: the message's properties or
    headers could not be read (the reason says which)."""
    properties = getattr(message, "properties", None) or {}
    raw_id = properties.get("message_id") or f"amqp-{receipt[1]}"
    body = getattr(message, "body", b"")
    return Delivery(
        id=printable(raw_id)[:200],
        body=body if isinstance(body, bytes) else printable(body).encode(),
        attempts=1, activate_at=now, taken_at=now, content_type=JSON_CONTENT_TYPE,
        receipt=receipt,
        malformed=why or printable(f"malformed: {_what_is_wrong(message, exc)}")[:1000],
    )


def _what_is_wrong(message: Any, exc: BaseException) -> str:
    headers = getattr(message, "headers", None) or {}
    for name, check in ((ATTEMPTS_HEADER, whole), (DELIVERY_COUNT_HEADER, whole),
                        (ACTIVATE_HEADER, _finite)):
        if name in headers and check(headers[name]) is None:
            return f"header {name}={headers[name]!r} is not a valid value"
    message_id = (getattr(message, "properties", None) or {}).get("message_id")
    if isinstance(message_id, str) and not is_clean(message_id):
        return "message_id is not valid UTF-8"
    return f"{type(exc).__name__}: {exc}"


def _finite(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def message_body(message: Any) -> bytes:
    body = message.body
    return body if isinstance(body, bytes) else printable(body).encode()


def dead_job(queue: str, message: Any) -> DeadJob:
    headers = message.properties.get("application_headers") or {}
    reason = headers.get(REASON_HEADER, "") or _broker_reason(headers)
    return DeadJob(
        id=printable(message.properties.get("message_id") or ""),
        queue=queue,
        body=message_body(message).decode("utf-8", "replace"),
        reason=reason.decode("utf-8", "replace") if isinstance(reason, bytes)
        else printable(reason),
        attempts=whole(headers.get(ATTEMPTS_HEADER, 0)) or 0,
        dead_at=_finite(headers.get(DEAD_AT_HEADER, 0.0)) or 0.0,
        error=JobError.from_json(_text_header(headers.get(ERROR_HEADER))),
    )


def _text_header(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _broker_reason(headers: dict[str, Any]) -> str:
    """Why RabbitMQ itself dead-lettered a message (a quorum queue's delivery limit)."""
    why = headers.get("x-first-death-reason")
    if not why:
        return ""
    why = why.decode("utf-8", "replace") if isinstance(why, bytes) else printable(why)
    return f"dead-lettered by RabbitMQ: {why}"

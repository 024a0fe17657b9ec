"""The job envelope: JSON only, never pickle.

What a producer stores is an :class:`Envelope` encoded as compact JSON. The broker
adds what only it can know at take time (attempts, activation time from its clock)
and hands the slot a :class:`Delivery`; the slot decodes it into a :class:`Job`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NewType

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qcluster.errors import EnvelopeError, InvalidDelay

SCHEMA_VERSION: Literal[1] = 1
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
JSON_CONTENT_TYPE = "application/json"
#: The longest delay a job may get (enqueue, ``job.retry``): one year, in seconds.
MAX_DELAY_S = 365 * 24 * 3600.0


def check_delay(delay: float, *, what: str = "delay") -> float:
    """``delay`` as a float if it is finite and in [0, MAX_DELAY_S]; else :class:`InvalidDelay`.

    A NaN or infinite delay cannot be stored as a time, and a huge one overflows the
    brokers' clocks; both used to crash slots long after the producer went away. A string
    or a bool is refused too, though float() would take "5" and True: a mix-up would run.
    """
    try:
        if isinstance(delay, str | bytes | bool):
            raise TypeError(delay)
        value = float(delay)
    except (TypeError, ValueError):
        raise InvalidDelay(f"{what} must be a number of seconds, not {delay!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= MAX_DELAY_S:
        raise InvalidDelay(
            f"{what} must be between 0 and {MAX_DELAY_S:.0f} seconds (one year), not {delay!r}"
        )
    return value


class Envelope(BaseModel):
    """What is stored on the broker for one job."""

    # No string cache: pydantic-core's process-wide one kept the last 16,384 job ids a
    # slot decoded (each seen once) alive, 1.9 MiB of each slot's private memory; without
    # it a decode costs about the same (at most 1% more instructions, docs/benchmarks.md).
    model_config = ConfigDict(frozen=True, extra="forbid", cache_strings=False)

    v: Literal[1] = SCHEMA_VERSION
    id: str = Field(min_length=1, max_length=200)
    queue: str = Field(min_length=1, max_length=200)
    payload: Any = None
    enqueued_at: float = Field(allow_inf_nan=False)
    """Producer wall-clock time (unix seconds), for display and wait metrics."""
    headers: dict[str, str] = Field(default_factory=dict)


def encode_new_jobs(
    queue: str,
    payloads: Iterable[Any],
    *,
    enqueued_at: float,
    random_bytes: Callable[[int], bytes],
    headers: dict[str, str] | None = None,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> list[tuple[str, bytes]]:
    """``(id, envelope bytes)`` of a new job per payload: an :class:`Envelope` as JSON.

    The clock and the randomness are the caller's (``time.time()``, ``os.urandom``): each
    id is 16 bytes of ``random_bytes`` in hex, so this module stays pure.

    Built without a model per job: the queue and headers are validated once, their JSON is
    shared, and each job adds only its id and its payload's JSON (a model, a JSON check and
    a dump per job made a producer spend 20 us per job, more than the broker). A payload
    that is not JSON (NaN and infinities included) or a message over ``max_bytes`` is
    refused with an :class:`EnvelopeError` naming it; nothing is encoded then.
    """
    items = payloads if isinstance(payloads, list) else list(payloads)
    try:
        shared = Envelope(id="-", queue=queue, enqueued_at=enqueued_at, headers=headers or {})
    except ValidationError as exc:
        raise EnvelopeError(f"job for queue {queue!r}: {_problem(exc)}") from exc
    if not_text := _not_utf8(shared.headers):  # a lone surrogate, refused as in a payload
        raise EnvelopeError(f"job for queue {queue!r}: headers must be UTF-8 text: {not_text}")
    head = shared.model_dump_json(exclude={"id", "payload"})[:-1].encode() + b',"id":"'
    ids = random_bytes(16 * len(items)).hex()
    out = []
    for index, payload in enumerate(items):
        job_id = ids[32 * index : 32 * index + 32]
        payload_json = _payload_json(queue, payload, index if len(items) > 1 else None)
        body = b"".join((head, job_id.encode(), b'","payload":', payload_json, b"}"))
        if len(body) > max_bytes:
            raise EnvelopeError(
                f"job for queue {queue!r} is {len(body)} bytes, over the "
                f"{max_bytes}-byte limit (max_message_bytes)"
            )
        out.append((job_id, body))
    return out


def _problem(exc: ValidationError) -> str:
    """The first problem, naming the header it is in (``header 'a': Input should be a
    valid string``): a producer's headers come from many places."""
    error = exc.errors()[0]
    loc, msg = error.get("loc", ()), error.get("msg", "")
    if len(loc) > 1 and loc[0] == "headers":
        return f"header {'name ' if loc[-1] == '[key]' else ''}{loc[1]!r}: {msg}"
    return f"{loc[0]}: {msg}" if loc else str(msg)


def _not_utf8(headers: dict[str, str]) -> str:
    """The first header whose name or value UTF-8 cannot encode ('': none). Checked here:
    the JSON dump fails with a traceback on such a value and, for a name, writes U+FFFD
    in its place (another header name, silently)."""
    for name, value in headers.items():
        for text in (name, value):
            try:
                text.encode()
            except UnicodeEncodeError:
                return f"header {name!r} holds {text!r}"
    return ""


def _payload_json(queue: str, payload: Any, index: int | None) -> bytes:
    try:
        return _dump_payload(payload).encode()
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError (a lone surrogate) included
        which = "payload" if index is None else f"payload #{index}"
        raise EnvelopeError(f"{which} for queue {queue!r} is not JSON: {exc}") from exc


_dump_payload = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":")
).encode


#: The model's compiled validator, called directly: ``Envelope.model_validate_json`` wraps
#: it in Python that costs a slot about 1 us per job (a third of decoding a small job).
_validate_envelope_json = Envelope.__pydantic_validator__.validate_json


def decode_envelope(body: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Envelope:
    """Parse stored bytes; any problem is an :class:`EnvelopeError` with the reason."""
    if len(body) > max_bytes:
        raise EnvelopeError(f"oversized: {len(body)} bytes > {max_bytes}")
    try:
        envelope: Envelope = _validate_envelope_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise EnvelopeError(f"malformed: {where}: {first.get('msg')}") from exc
    if _has_non_finite(envelope.payload):
        # pydantic's JSON parser reads NaN, Infinity and numbers past the float range (1e999)
        # as floats; no producer can send them (allow_nan=False), so neither may a raw message.
        raise EnvelopeError("malformed: payload: NaN or infinite number (not JSON)")
    return envelope


_PLAIN = frozenset({str, int, bool, type(None)})


def _has_non_finite(value: Any) -> bool:
    """A NaN or infinite float anywhere in a decoded JSON value (dicts and lists walked;
    a plain loop: this runs for every job a slot takes)."""
    kind = type(value)
    if kind is float:
        return not math.isfinite(value)
    if kind is dict:
        value = value.values()
    elif kind is not list:
        return False
    for item in value:  # noqa: SIM110 (a loop: no generator frame per job)
        if type(item) not in _PLAIN and _has_non_finite(item):
            return True
    return False


LockToken = NewType("LockToken", int)
"""A take's lock on a broker whose ``settles_for_others`` is True (Redis): one integer,
the receipt of every delivery of the take, with which any process may settle them (a
master has the jobs of a slot that died given back with it)."""

Receipt = Any
"""A delivery's receipt: the backend's own handle, opaque to everyone but the backend
(RabbitMQ: the channel's generation and the delivery tag). On a broker that settles for
others it is the take's :data:`LockToken`, the one thing a slot may pass on (to its
master) without asking the backend."""


@dataclass(slots=True)
class Delivery:
    """One taken message as the broker hands it out, before decoding.

    ``receipt`` (:data:`Receipt`) is the backend's own handle; slots pass deliveries
    back to settle them and never look inside it.
    """

    id: str
    body: bytes
    attempts: int
    activate_at: float
    """Broker-clock unix seconds at which the job became ready (for wait metrics)."""
    taken_at: float
    """Broker-clock unix seconds of the take: the same for every delivery of one take."""
    content_type: str = JSON_CONTENT_TYPE
    receipt: Receipt = None
    suspect: bool = False
    """The job's previous take ended by lock expiry (its slot died or hung, maybe of
    this very job): the slot runs it alone so that it cannot take batch-mates with it."""
    malformed: str = ""
    """Set by the broker when the message cannot even be decoded into a delivery
    (a non-UTF-8 id, an unreadable header): the reason, starting with ``malformed:``.
    The slot dead-letters it without running it."""


OutcomeKind = Literal["done", "retry", "fail", "error"]


@dataclass(slots=True)
class Job:
    """A job handed to a handler. Handlers may call :meth:`retry` or :meth:`fail`."""

    id: str
    queue: str
    payload: Any
    attempts: int
    enqueued_at: float
    activate_at: float
    headers: dict[str, str] = field(default_factory=dict)
    delivery: Delivery | None = field(default=None, repr=False)
    outcome: OutcomeKind | None = None
    retry_delay_s: float = 0.0
    fail_reason: str = ""
    error: str = ""
    """Set with outcome "error": the exception, as "Type: message"."""
    exception: BaseException | None = field(default=None, repr=False, compare=False)
    """Set with outcome "error": the exception itself (its traceback is logged)."""

    def retry(self, delay: float = 0.0) -> None:
        """Postpone: hand the job out again after ``delay`` seconds."""
        self.retry_delay_s = check_delay(delay, what="retry delay")
        self.outcome = "retry"

    def fail(self, reason: str) -> None:
        """Dead-letter the job with ``reason``; it is not retried."""
        self.outcome, self.fail_reason = "fail", str(reason)

    def mark_error(self, exc: BaseException) -> None:
        """The handler raised for this job: the queue's on_error policy decides."""
        self.outcome, self.error = "error", f"{type(exc).__name__}: {exc}"[:1000]
        self.exception = exc

    @classmethod
    def from_delivery(cls, delivery: Delivery, envelope: Envelope) -> Job:
        # Positional (it runs once per job); the envelope is thrown away after, so its
        # headers dict is handed over, not copied.
        return cls(delivery.id, envelope.queue, envelope.payload, delivery.attempts,
                   envelope.enqueued_at, delivery.activate_at, envelope.headers, delivery)

"""The RabbitMQ backend's topology: each queue's exchange, its dead-letter store and its
delay ladder, with their names, declared once per connection (again after someone
deleted them) by :class:`Topology`. A queue is a classic queue or a quorum queue
(``queue_type``): its store and its ladder are declared of the same type."""

from __future__ import annotations

import logging
import re
from typing import Any, Literal, cast
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import amqp
from kombu import Exchange, Queue
from kombu.transport import native_delayed_delivery as ndd

from qcluster.broker.amqp_link import AmqpLink
from qcluster.broker.amqp_readahead import Connection
from qcluster.broker.base import DeadRetention
from qcluster.broker.urls import join_urls, split_urls
from qcluster.errors import BrokerError
from qcluster.policy import QueuePolicy

logger = logging.getLogger(__name__)

#: The ladder's top level; kombu publishes every delayed message there.
TOP_LEVEL = ndd.MAX_LEVEL
#: (queue, retention) pairs whose store was found declared otherwise: warned once.
_warned_stores: set[tuple[str, DeadRetention]] = set()
#: (queue, what) whose queue or ladder was found declared otherwise: warned once.
_warned_queues: set[tuple[str, str]] = set()

QueueType = Literal["classic", "quorum"]
QUEUE_TYPES: tuple[QueueType, ...] = ("classic", "quorum")
#: The URL option naming the type of every queue this process declares (a queue's policy
#: ``queue_type`` overrides it).
QUEUE_TYPE_OPTION = "queue_type"
DEFAULT_MAX_ATTEMPTS: int = QueuePolicy.model_fields["max_attempts"].default
#: x-delivery-limit is max_attempts plus this (see :func:`delivery_limit`).
DELIVERY_LIMIT_MARGIN = 10
#: RabbitMQ's words for an argument that differs from the existing queue's (it names the
#: first one only): "current is none", "... is the value '5' of type 'signedint'", "... is '5'".
_MISMATCH = re.compile(
    r"inequivalent arg '([^']+)'.*current is "
    r"(?:(none)|the value '([^']*)' of type '(\w+)'|'([^']*)')")
#: Declares tried at most to learn an existing queue's arguments (one per argument).
MAX_LEARNING_DECLARES = 12


class QueueTypeMismatch(BrokerError):
    """The queue exists in RabbitMQ with another type than the one asked for."""


def delivery_limit(max_attempts: int) -> int:
    """A quorum queue's ``x-delivery-limit`` for a queue of ``max_attempts``: a backstop.

    The broker counts a redelivery each time a consumer holding the message died, and
    qcluster adds those redeliveries to the job's attempts; the slot dead-letters the job
    (with its reason, kept for dead_max_age) at the first take where the count passes
    max_attempts, that is at the latest when the broker has counted max_attempts
    redeliveries. RabbitMQ acts when a return brings the count to the limit (measured on
    3.10: a limit of 11 gives the job out 11 times), so a limit of max_attempts + 10 leaves
    qcluster the one that acts, with room for jobs that were only read ahead (never run)
    by slots that died, which are charged a redelivery too. A job at the limit goes to the
    queue's dead-letter store (``x-death`` names ``delivery_limit``), never dropped while
    that store exists."""
    return max_attempts + DELIVERY_LIMIT_MARGIN


def split_queue_type(url: str) -> tuple[str, QueueType | None]:
    """The URL(s) without the ``queue_type`` option, and its value (None: not given)."""
    found: QueueType | None = None
    urls = []
    for one in split_urls(url):
        parts = urlsplit(one)
        rest = []
        for piece in parts.query.split("&") if parts.query else []:
            ((key, value),) = parse_qsl(piece, keep_blank_values=True) or [("", "")]
            if key != QUEUE_TYPE_OPTION:
                rest.append(piece)
                continue
            found = check_queue_type(value, f"RabbitMQ URL option {QUEUE_TYPE_OPTION}")
        urls.append(urlunsplit(parts._replace(query="&".join(rest))))
    return join_urls(urls), found


def check_queue_type(value: str, what: str) -> QueueType:
    for known in QUEUE_TYPES:
        if value == known:
            return known
    raise BrokerError(f"{what}={value!r}: want one of {', '.join(QUEUE_TYPES)}")


def _learn(arguments: dict[str, Any], refusal: str) -> bool:
    """Change ``arguments`` to the existing queue's value of the argument RabbitMQ's
    ``refusal`` names; False when the refusal is not about one argument."""
    match = _MISMATCH.search(refusal)
    if match is None:
        return False
    name, none, typed_value, value_type, short_value = match.groups()
    if none:
        arguments.pop(name, None)
    elif typed_value is not None:
        arguments[name] = typed_value if value_type == "longstr" else _number(typed_value)
    else:
        sent = arguments.get(name)
        arguments[name] = short_value if isinstance(sent, str) else _number(short_value)
    return True


def _number(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text


def migration_hint(queue: str, current: str, wanted: str) -> str:
    return (
        f"queue {queue!r} exists in RabbitMQ as a {current} queue and was asked for as a "
        f"{wanted} queue: RabbitMQ cannot change a queue's type. Either set queue_type = "
        f"\"{current}\" for it (its policy, or ?queue_type= in the broker URL), or move it: "
        "drain it, delete it and declare it again (docs/operations.md, 'Moving a queue to "
        "quorum queues')"
    )


def ladder_prefix(queue: str) -> str:
    return f"qc~delay.{queue}"


def queue_exchange(queue: str) -> Exchange:
    return Exchange(f"qc.q.{queue}", type="topic", durable=True)


def dead_queue_name(queue: str) -> str:
    return f"qc~dead.{queue}"


def legacy_dead_queue_name(queue: str) -> str:
    """Where earlier versions kept dead letters (a queue could have that name)."""
    return f"{queue}.dead"


class _ChannelTracker:
    """Stands in for a Connection: remembers the channels it opened, to close them."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.opened: list[Any] = []

    def channel(self) -> Any:
        channel = self.conn.channel()
        self.opened.append(channel)
        return channel

    def close(self) -> None:
        for channel in self.opened:
            try:
                channel.close()
            except Exception:  # a channel the broker closed (an error) is gone already
                logger.debug("closing a declaring channel failed", exc_info=True)



class Topology:
    """Declares queues, dead-letter stores and delay ladders (once per connection) on
    the link's inspecting channel, and knows each queue's options and type."""

    def __init__(self, link: AmqpLink, default_type: QueueType | None) -> None:
        """``default_type``: the URL's ``?queue_type=`` (:func:`split_queue_type`)."""
        self.link = link
        self._default_type = default_type
        self._declared: set[str] = set()
        self._dead_declared: set[str] = set()
        self._laddered: set[str] = set()
        self.seen: set[str] = set()
        """Every queue this process declared (AMQP cannot list a broker's queues)."""
        self._asked_types: dict[str, QueueType] = {}
        """Per-queue types from the queues' policies (set_queue_options)."""
        self._max_attempts: dict[str, int] = {}
        self._types: dict[str, QueueType] = {}
        """Each declared queue's type, as it exists in RabbitMQ."""

    def set_queue_options(
        self, queue: str, *, queue_type: str | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        """What this process knows of ``queue``'s policy: its ``queue_type`` (None: the
        URL's ``?queue_type=``, else classic) and its ``max_attempts`` (a quorum queue's
        delivery limit). Takes effect when the queue is next declared."""
        if queue_type is None:
            self._asked_types.pop(queue, None)
        else:
            self._asked_types[queue] = check_queue_type(queue_type, "queue_type")
        self._max_attempts[queue] = max_attempts
        self._declared.discard(queue)

    def queue_type(self, queue: str) -> QueueType:
        """The type ``queue`` is declared with (as it exists, once declared)."""
        return self._types.get(queue) or self._wanted_type(queue) or "classic"

    def _wanted_type(self, queue: str) -> QueueType | None:
        """The type asked for: the queue's policy, else the URL's; None: nobody asked."""
        return self._asked_types.get(queue) or self._default_type

    def _queue_arguments(self, queue: str, queue_type: QueueType) -> dict[str, Any]:
        if queue_type == "classic":
            return {}
        return {
            "x-queue-type": "quorum",
            "x-delivery-limit": delivery_limit(
                self._max_attempts.get(queue, DEFAULT_MAX_ATTEMPTS)),
            # The backstop's dead letters go to the queue's store, not nowhere.
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dead_queue_name(queue),
        }

    def reset(self) -> None:
        """The connection was lost: declare everything again on the next one."""
        self._declared.clear()
        self._dead_declared.clear()
        self._laddered.clear()

    def declare(self, queue: str) -> None:
        if queue in self._declared:
            return
        wanted = self._wanted_type(queue) or "classic"
        asked = self._queue_arguments(queue, wanted)
        existing = self._declare_as_it_is(queue, asked)
        kind = existing.get("x-queue-type", "classic")
        if kind not in QUEUE_TYPES:
            raise QueueTypeMismatch(
                f"queue {queue!r} exists in RabbitMQ as a {kind} queue: qcluster uses classic "
                "and quorum queues only (docs/operations.md, 'Quorum queues')")
        found: QueueType = "quorum" if kind == "quorum" else "classic"
        if found != wanted and self._wanted_type(queue) is not None:
            raise QueueTypeMismatch(migration_hint(queue, found, wanted))
        if found == wanted and existing != asked and (queue, "arguments") not in _warned_queues:
            _warned_queues.add((queue, "arguments"))
            logger.warning(
                "RabbitMQ at %s: queue %s exists with other arguments (%s, not %s); it is "
                "used as it is: RabbitMQ cannot change them. See docs/operations.md, "
                "'Quorum queues'.", self.link.safe_url, queue, existing, asked)
        self._types[queue] = found
        self._declared.add(queue)
        self.seen.add(queue)

    def _declare_as_it_is(self, queue: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Declare ``queue`` (its exchange and binding too) with ``arguments``; if it
        exists with others, with the ones it has, learnt from RabbitMQ's refusals (each
        names one argument). Returns the arguments it was declared with: those of the
        existing queue, whose type (``x-queue-type``) nobody asked for when a producer
        does not know the queue's policy."""
        exchange = queue_exchange(queue)
        arguments = dict(arguments)
        for _ in range(MAX_LEARNING_DECLARES):
            try:
                Queue(queue, exchange, routing_key=queue, durable=True,
                      queue_arguments=arguments).bind(self.link.inspector()).declare()
                return arguments
            except amqp.exceptions.PreconditionFailed as exc:
                self.link.inspector_closed()
                if not _learn(arguments, str(getattr(exc, "reply_text", "") or exc)):
                    raise
        raise BrokerError(f"RabbitMQ at {self.link.safe_url}: cannot declare queue {queue!r} "
                          "with the arguments it has")

    def declare_dead(self, queue: str, retention: DeadRetention) -> None:
        """The queue's dead-letter store, declared at its first dead letter (by a slot,
        which knows the queue's retention): RabbitMQ drops the oldest letter past
        ``x-max-length`` and any letter past ``x-message-ttl``. A store that exists with
        other arguments is used as it is (RabbitMQ cannot change them), with a warning."""
        if queue in self._dead_declared:
            return
        name = dead_queue_name(queue)
        arguments: dict[str, Any] = {
            "x-max-length": retention.max_count, "x-overflow": "drop-head",
            "x-message-ttl": retention.max_age_ms}
        if self.queue_type(queue) == "quorum":
            arguments["x-queue-type"] = "quorum"
        try:
            Queue(name, durable=True, queue_arguments=arguments).bind(
                self.link.inspector()).declare()
        except amqp.exceptions.PreconditionFailed as exc:
            self.link.inspector_closed()
            self.link.inspector().queue_declare(name, passive=True)
            if (queue, retention) not in _warned_stores:
                _warned_stores.add((queue, retention))
                logger.warning(
                    "RabbitMQ at %s: the dead-letter store %s exists with other arguments "
                    "than dead_max_count=%d, dead_max_age=%gs (%s): it keeps the limits it "
                    "was declared with; a shorter dead_max_age still applies to new dead "
                    "letters. See docs/operations.md, 'Dead-letter retention'.",
                    self.link.safe_url, name, retention.max_count, retention.max_age_s,
                    getattr(exc, "reply_text", exc))
        self._dead_declared.add(queue)

    def dead_store_exists(self, queue: str) -> bool:
        return self.link.exists(dead_queue_name(queue))

    def declare_ladder(self, queue: str) -> None:
        """The queue's own delay ladder, routed back to the queue's exchange."""
        if queue in self._laddered:
            return
        prefix = ladder_prefix(queue)
        # kombu's helpers open a channel per call and leave it open: close them here.
        tracker = _ChannelTracker(self.link.conn)
        try:
            conn = cast(Connection, tracker)
            self._declare_levels(conn, queue, prefix)
            main = Queue(queue, queue_exchange(queue), routing_key=queue, durable=True)
            ndd.bind_queue_to_native_delayed_delivery_exchange(conn, main, prefix)
        finally:
            tracker.close()
        self._laddered.add(queue)

    def _declare_levels(self, conn: Connection, queue: str, prefix: str) -> None:
        """The ladder's 28 levels, of the queue's type (a quorum queue's delayed jobs
        survive a node loss too). A ladder that exists of the other type (declared before
        the queue moved) keeps working as it is, with a warning."""
        queue_type = self.queue_type(queue)
        try:
            ndd.declare_native_delayed_delivery_exchanges_and_queues(conn, queue_type, prefix)
        except amqp.exceptions.PreconditionFailed as exc:
            if (queue, "ladder") not in _warned_queues:
                _warned_queues.add((queue, "ladder"))
                logger.warning(
                    "RabbitMQ at %s: the delay ladder %s.* of %s queue %s exists with other "
                    "arguments (%s); it is used as it is. See docs/operations.md, 'Moving a "
                    "queue to quorum queues'.", self.link.safe_url, prefix, queue_type, queue,
                    getattr(exc, "reply_text", exc))

    def forget(self, queue: str) -> None:
        """Someone deleted the queue (or its store, exchange, ladder): declare again."""
        self._declared.discard(queue)
        self._dead_declared.discard(queue)
        self._laddered.discard(queue)
        self._types.pop(queue, None)

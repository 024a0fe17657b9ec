"""Job lookup and dead letters by id on RabbitMQ: what can be known, and what cannot.

A RabbitMQ queue cannot be searched by id, nor read without taking its messages: a job
waiting in its queue or on the delay ladder, or taken by a slot, cannot be found from
here, and a finished job leaves no record. What can be read is the dead-letter store
(a queue of its own, read with ``basic_get`` and given back unacked); every other answer
is ``unknown`` with a note saying so, never a guessed state. Running jobs are known to
the masters (the manager merges them in). The store is a queue: its letters are listed
oldest first (reading the newest first would mean reading every letter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qcluster.broker.amqp_messages import _body, _dead_job, _printable
from qcluster.broker.amqp_topology import dead_queue_name
from qcluster.broker.base import DeadJob
from qcluster.jobs import MAX_PAGE, JobInfo, JobPage
from qcluster.names import check_queue_name

if TYPE_CHECKING:
    from qcluster.broker.kombu_broker import KombuBroker

#: An action by id reads at most this many dead letters of a queue.
DEAD_SEARCH_LIMIT = 100_000
#: A lookup by id, or a page, reads at most this many dead letters of a queue (from its
#: oldest): reading a letter means taking it and giving it back.
READ_LIMIT = 10_000
#: What a lookup says about the states it cannot see.
UNKNOWN_NOTE = ("RabbitMQ cannot search a queue by id: the job is not a dead letter, and "
                "whether it waits (ready or delayed), runs or finished cannot be read from "
                "the broker (running jobs are known to the masters)")
LISTING_NOTE = ("RabbitMQ cannot list a queue's {state} jobs: its messages cannot be read "
                "without taking them")
ORDER_NOTE = "RabbitMQ keeps dead letters in a queue: listed oldest first"
BOUND_NOTE = ("; a page reads the store from its oldest letter and at most {limit:,} "
              "letters: the letters after the {limit:,}th cannot be listed here "
              "(`qcluster dead QUEUE --requeue ID...` and `--delete` reach them by id)")
PARTIAL_NOTE = ("RabbitMQ cannot search a queue by id: a lookup reads at most {limit:,} dead "
                "letters of a queue, and {queues} held more; the job is not among those "
                "read, and whether it is a later dead letter, waits (ready or delayed), runs "
                "or finished cannot be read from the broker (running jobs are known to the "
                "masters)")


def _dead_messages(broker: KombuBroker, channel: Any, queue: str, limit: int) -> list[Any]:
    return broker._get_all(channel, dead_queue_name(queue), limit)


def dead_page(broker: KombuBroker, queue: str, *, offset: int,
              limit: int) -> tuple[int, list[DeadJob]]:
    """The store's size and ``limit`` letters from ``offset`` (oldest first): reads
    ``offset + limit`` letters, at most ``READ_LIMIT``, and gives them all back."""
    check_queue_name(queue)
    offset, limit = max(0, offset), max(0, limit)
    wanted = max(0, min(offset + limit, READ_LIMIT) - offset)

    def read() -> tuple[int, list[DeadJob]]:
        broker._declare(queue)
        if not broker._dead_store_exists(queue):
            return 0, []
        total = broker._count(dead_queue_name(queue))
        if not wanted:
            return total, []
        channel = broker.conn.channel()
        try:
            messages = _dead_messages(broker, channel, queue, offset + wanted)
        finally:
            channel.close()  # unacked: the broker puts them back, in order
        if messages:  # letters just given back by another reader may not be counted yet
            left = messages[-1].delivery_info.get("message_count")
            total = max(total, len(messages) + (left if isinstance(left, int) else 0))
        return total, [_dead_job(queue, m) for m in messages[offset:offset + wanted]]

    return broker._retrying(read)


def dead_by_ids(broker: KombuBroker, queue: str, action: str, ids: Sequence[str]) -> int:
    """Requeue (to the queue, attempts reset; confirmed before the letter is acked) or
    delete the dead letters ``ids``; the others are given back as they were."""
    check_queue_name(queue)
    wanted = set(ids)

    def move() -> int:
        broker._declare(queue)
        if not wanted or not broker._dead_store_exists(queue):
            return 0
        channel = broker.conn.channel()
        moved = 0
        try:
            seen = 0
            while seen < DEAD_SEARCH_LIMIT and moved < len(wanted):
                batch = _dead_messages(broker, channel, queue, 500)
                if not batch:
                    break
                seen += len(batch)
                found = [m for m in batch if _message_id(m) in wanted]
                if found and action == "requeue":
                    broker._send(queue, [(_message_id(m), _body(m), {}) for m in found], 0.0)
                for message in found:
                    channel.basic_ack(message.delivery_tag)
                moved += len(found)
        finally:
            channel.close()  # the letters not acked go back
        return moved

    return broker._retrying(move)


def lookup(broker: KombuBroker, job_id: str, queues: Sequence[str]) -> JobInfo | None:
    """A dead letter of ``queues`` with this id, else ``unknown`` with the note (None
    when no queue is named: nothing to look in). Each store is read up to
    ``READ_LIMIT`` letters; the note names the stores that held more."""
    partial = []
    for queue in queues:
        found, whole = _find_dead(broker, queue, job_id)
        if found is not None:
            return JobInfo.of_dead(found)
        if not whole:
            partial.append(queue)
    if not queues:
        return None
    note = (PARTIAL_NOTE.format(limit=READ_LIMIT, queues=", ".join(partial)) if partial
            else UNKNOWN_NOTE)
    return JobInfo(id=job_id, queue=queues[0] if len(queues) == 1 else None, state="unknown",
                   note=note)


def _find_dead(broker: KombuBroker, queue: str, job_id: str) -> tuple[DeadJob | None, bool]:
    """The dead letter with this id, and whether the whole store was read."""
    check_queue_name(queue)

    def search() -> tuple[DeadJob | None, bool]:
        broker._declare(queue)
        if not broker._dead_store_exists(queue):
            return None, True
        channel = broker.conn.channel()
        try:
            seen, left = 0, 0
            while seen < READ_LIMIT:
                batch = _dead_messages(broker, channel, queue, min(500, READ_LIMIT - seen))
                if not batch:
                    return None, True
                seen += len(batch)
                for message in batch:
                    if _message_id(message) == job_id:
                        return _dead_job(queue, message), True
                count = batch[-1].delivery_info.get("message_count")
                left = count if isinstance(count, int) else 1
            return None, left == 0
        finally:
            channel.close()

    return broker._retrying(search)


def job_page(broker: KombuBroker, queue: str, state: str, *, offset: int,
             limit: int) -> JobPage:
    """Dead letters (oldest first); the other states cannot be listed (a note says so)."""
    offset, limit = max(0, offset), max(0, min(limit, MAX_PAGE))
    if state != "dead":
        return JobPage(queue=queue, state=state, total=None, offset=offset, limit=limit,
                       jobs=[], note=LISTING_NOTE.format(state=state))
    total, dead = dead_page(broker, queue, offset=offset, limit=limit)
    bounded = offset + limit > READ_LIMIT and total > min(offset + len(dead), READ_LIMIT)
    note = ORDER_NOTE + (BOUND_NOTE.format(limit=READ_LIMIT) if bounded else "")
    return JobPage(queue=queue, state=state, total=total, offset=offset, limit=limit,
                   jobs=[JobInfo.of_dead(one) for one in dead], note=note)


def _message_id(message: Any) -> str:
    return _printable(message.properties.get("message_id") or "")

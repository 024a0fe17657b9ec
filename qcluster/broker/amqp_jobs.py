"""Job lookup and dead letters by id on RabbitMQ: what can be known, and what cannot.

A RabbitMQ queue cannot be searched by id, nor read without taking its messages: a job
waiting in its queue or on the delay ladder, or taken by a slot, cannot be found from
here, and a finished job leaves no record. What can be read is the dead-letter store
(a queue of its own, read with ``basic_get`` and given back unacked); every other answer
is ``unknown`` with a note saying so, never a guessed state. Running jobs are known to
the masters (the manager merges them in).

The store is a queue, read from its oldest letter: a page (``qcluster dead``, the job
browser) lists its letters oldest first and reads only ``offset + limit`` of them, at most
``READ_LIMIT`` (listing the newest first would mean reading the whole store for every
page, one round trip per letter), and its note says so. ``dead_jobs`` (the queue page's
short list) reads the store, at most ``READ_LIMIT`` letters, and lists the newest first.
Every read gives its letters back before it returns (see ``JobReads._read``: a classic
store keeps its order, a quorum store read in part may not).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from qcluster.broker.amqp_link import AmqpLink
from qcluster.broker.amqp_messages import dead_job, message_body, printable
from qcluster.broker.amqp_publish import Publisher
from qcluster.broker.amqp_topology import Topology, dead_queue_name
from qcluster.broker.base import DeadJob
from qcluster.jobs import MAX_PAGE, JobInfo, JobPage
from qcluster.names import check_queue_name

#: An action by id reads at most this many dead letters of a queue.
DEAD_SEARCH_LIMIT = 100_000
#: A lookup by id, a page or a listing reads at most this many dead letters of a queue
#: (from its oldest): reading a letter means taking it and giving it back.
READ_LIMIT = 10_000
#: Letters a requeue or an action by id takes at once (confirmed, then acked together).
MOVE_BATCH = 500
#: How long a read waits for the store to count the letters it gave back (a quorum queue
#: applies returns through its log: a read right after could miss them).
GIVE_BACK_WAIT_S = 2.0
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


def get_all(channel: Any, name: str, limit: int) -> list[Any]:
    """Up to ``limit`` messages of queue ``name``, oldest first, taken unacknowledged
    (given back, in order, when ``channel`` closes)."""
    messages: list[Any] = []
    while len(messages) < limit:
        message = channel.basic_get(name, no_ack=False)
        if message is None:
            break
        messages.append(message)
    return messages


def read_dead(channel: Any, queue: str, limit: int) -> list[Any]:
    """Up to ``limit`` dead letters of ``queue``, oldest first (see :func:`get_all`)."""
    return get_all(channel, dead_queue_name(queue), limit)


def give_back(channel: Any, tags: list[int]) -> None:
    """Return the letters read (``tags``, oldest first) one by one, in order, before the
    channel closes: a quorum queue puts returned messages ahead of the rest in the order it
    gets them back, and those a closing channel returns come back in no set order (a
    classic queue puts each back where it was either way). No reply: one frame each."""
    for tag in tags:
        channel.basic_reject(tag, requeue=True)


class JobReads:
    """Dead letters (listed, looked up, requeued, deleted) and job lookups on RabbitMQ.
    Each call runs inside the link's ``retrying``."""

    def __init__(self, link: AmqpLink, topology: Topology, publisher: Publisher) -> None:
        self.link = link
        self.topology = topology
        self.publisher = publisher

    def _store_exists(self, queue: str) -> bool:
        """Whether ``queue`` has a store (declared at its first dead letter); if so the
        queue is declared too (its type decides how letters are given back). A read
        never creates a queue: a misspelt name would be left in RabbitMQ, of the URL's
        type, and a slot declaring it as a quorum queue later would be refused."""
        if not self.topology.dead_store_exists(queue):
            return False
        self.topology.declare(queue)
        return True

    def dead_jobs(self, queue: str, limit: int) -> list[DeadJob]:
        """``Broker.dead_jobs``: the newest ``limit`` letters, newest first; reads the
        store, at most ``READ_LIMIT`` letters (see :meth:`_read`)."""
        check_queue_name(queue)
        if limit <= 0:
            return []
        return self.link.retrying(lambda: self._read(queue, READ_LIMIT)[1][::-1][:limit])

    def dead_page(self, queue: str, *, offset: int,
                  limit: int) -> tuple[int, list[DeadJob]]:
        """The store's size and ``limit`` letters from ``offset``, oldest first (see the
        module docstring): reads ``offset + limit`` letters, at most ``READ_LIMIT``, and
        gives them all back."""
        check_queue_name(queue)
        offset, limit = max(0, offset), max(0, limit)
        wanted = max(0, min(offset + limit, READ_LIMIT) - offset)

        def read() -> tuple[int, list[DeadJob]]:
            total, letters = self._read(queue, offset + wanted if wanted else 0)
            return total, letters[offset:offset + wanted]

        return self.link.retrying(read)

    def _read(self, queue: str, count: int) -> tuple[int, list[DeadJob]]:
        """The store's size and its oldest ``count`` letters, oldest first, given back.
        A quorum store read whole is given back one by one, in order (:meth:`_give_back`:
        it puts each rejected letter behind the others, so the store keeps its order);
        any other read by closing the channel: a classic queue puts those letters back
        where they were (one by one took 10-25 s for 5,000 letters, against 2-3 s), and a
        partial read rejected one by one would move the letters read to the end of a
        quorum store (those a closing channel returns go back ahead, in no set order)."""
        if not self._store_exists(queue):
            return 0, []
        total = self.link.count(dead_queue_name(queue))
        if not count:
            return total, []
        channel = self.link.conn.channel()
        try:
            messages = read_dead(channel, queue, count)
            left = messages[-1].delivery_info.get("message_count") if messages else None
            if messages and left == 0 and self.topology.queue_type(queue) == "quorum":
                self._give_back(channel, queue, messages)
        finally:
            channel.close()  # the letters not given back: the broker puts them back
        if messages:  # letters another reader just gave back may not be counted yet
            total = max(total, len(messages) + (left if isinstance(left, int) else 0))
        return total, [dead_job(queue, m) for m in messages]

    def _give_back(self, channel: Any, queue: str, messages: list[Any],
                   tags: list[int] | None = None) -> int:
        """Give back the letters read (``messages``, or only ``tags`` of them), in order,
        and wait until the store counts them (at most ``GIVE_BACK_WAIT_S``): a count or a
        read right after, here or in another process, sees the store as it was. Returns
        the store's size as the reads saw it."""
        give_back(channel, [m.delivery_tag for m in messages] if tags is None else tags)
        if not messages:
            return 0
        left = messages[-1].delivery_info.get("message_count")
        held = len(messages) if tags is None else len(tags)
        expected = held + (left if isinstance(left, int) else 0)
        deadline = time.monotonic() + GIVE_BACK_WAIT_S
        while (self.link.count(dead_queue_name(queue)) < expected
               and time.monotonic() < deadline):
            time.sleep(0.01)
        return len(messages) + (left if isinstance(left, int) else 0)

    def job_page(self, queue: str, state: str, *, offset: int, limit: int) -> JobPage:
        """Dead letters (oldest first); the other states cannot be listed (a note says so)."""
        offset, limit = max(0, offset), max(0, min(limit, MAX_PAGE))
        if state != "dead":
            return JobPage(queue=queue, state=state, total=None, offset=offset, limit=limit,
                           jobs=[], note=LISTING_NOTE.format(state=state))
        total, dead = self.dead_page(queue, offset=offset, limit=limit)
        bounded = offset + limit > READ_LIMIT and total > min(offset + len(dead), READ_LIMIT)
        note = ORDER_NOTE + (BOUND_NOTE.format(limit=READ_LIMIT) if bounded else "")
        return JobPage(queue=queue, state=state, total=total, offset=offset, limit=limit,
                       jobs=[JobInfo.of_dead(one) for one in dead], note=note)

    def requeue_all(self, queue: str) -> int:
        """Move every dead letter back to the queue (confirmed before each batch's ack)."""
        check_queue_name(queue)

        def move() -> int:
            if not self._store_exists(queue):
                return 0
            channel = self.link.conn.channel()
            moved = 0
            try:
                while batch := read_dead(channel, queue, MOVE_BATCH):
                    self.publisher.send(
                        queue, [(message_id(m), message_body(m), {}) for m in batch], 0.0)
                    channel.basic_ack(batch[-1].delivery_tag, multiple=True)
                    moved += len(batch)
            finally:
                channel.close()
            return moved

        return self.link.retrying(move)

    def dead_by_ids(self, queue: str, action: str, ids: Sequence[str]) -> int:
        """Requeue (to the queue, attempts reset; confirmed before the letter is acked) or
        delete the dead letters ``ids``; the others are given back as they were."""
        check_queue_name(queue)
        wanted = set(ids)

        def move() -> int:
            if not wanted or not self._store_exists(queue):
                return 0
            channel = self.link.conn.channel()
            moved, kept, last = 0, list[int](), list[Any]()
            try:
                while len(kept) + moved < DEAD_SEARCH_LIMIT and moved < len(wanted):
                    batch = read_dead(channel, queue, MOVE_BATCH)
                    if not batch:
                        break
                    last = batch[-1:]
                    found = [m for m in batch if message_id(m) in wanted]
                    if found and action == "requeue":
                        self.publisher.send(
                            queue, [(message_id(m), message_body(m), {}) for m in found], 0.0)
                    for message in found:
                        channel.basic_ack(message.delivery_tag)
                    moved += len(found)
                    kept += [m.delivery_tag for m in batch if message_id(m) not in wanted]
                self._give_back(channel, queue, last, kept)  # only now: it is read first
            finally:
                channel.close()
            return moved

        return self.link.retrying(move)

    def lookup(self, job_id: str, queues: Sequence[str]) -> JobInfo | None:
        """A dead letter of ``queues`` with this id, else ``unknown`` with the note (None
        when no queue is named: nothing to look in). Each store is read up to
        ``READ_LIMIT`` letters; the note names the stores that held more."""
        partial = []
        for queue in queues:
            found, whole = self._find_dead(queue, job_id)
            if found is not None:
                return JobInfo.of_dead(found)
            if not whole:
                partial.append(queue)
        if not queues:
            return None
        note = (PARTIAL_NOTE.format(limit=READ_LIMIT, queues=", ".join(partial)) if partial
                else UNKNOWN_NOTE)
        return JobInfo(id=job_id, queue=queues[0] if len(queues) == 1 else None,
                       state="unknown", note=note)

    def _find_dead(self, queue: str, job_id: str) -> tuple[DeadJob | None, bool]:
        """The dead letter with this id, and whether the whole store was read."""
        check_queue_name(queue)

        def search() -> tuple[DeadJob | None, bool]:
            if not self._store_exists(queue):
                return None, True
            channel = self.link.conn.channel()
            read: list[Any] = []
            try:
                found = self._search(channel, queue, job_id, read)
                self._give_back(channel, queue, read)  # only now: it would be read first
                return found
            finally:
                channel.close()

        return self.link.retrying(search)

    @staticmethod
    def _search(channel: Any, queue: str, job_id: str,
                read: list[Any]) -> tuple[DeadJob | None, bool]:
        """Read the store up to ``READ_LIMIT`` letters for ``job_id`` (each letter read
        added to ``read``); the letter found, and whether the whole store was read."""
        left = 0
        while len(read) < READ_LIMIT:
            batch = read_dead(channel, queue, min(MOVE_BATCH, READ_LIMIT - len(read)))
            if not batch:
                return None, True
            read += batch
            for message in batch:
                if message_id(message) == job_id:
                    return dead_job(queue, message), True
            count = batch[-1].delivery_info.get("message_count")
            left = count if isinstance(count, int) else 1
        return None, left == 0


def message_id(message: Any) -> str:
    """A message's id as clean text ("" when it has none)."""
    return printable(message.properties.get("message_id") or "")

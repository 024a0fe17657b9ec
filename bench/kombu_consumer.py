"""A plain kombu consumer (what Celery and Dramatiq pay per job, without their framework):
``python -m bench.kombu_consumer URL QUEUE PREFETCH ACK_EVERY``. Exits when idle for 2 s."""

from __future__ import annotations

import sys

from kombu import Connection, Consumer, Queue


def main() -> None:
    url, queue_name, prefetch, ack_every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(
        sys.argv[4])
    pending: list[object] = []
    with Connection(url) as connection:
        queue = Queue(queue_name, durable=True)

        def on_message(body: object, message: object) -> None:
            pending.append(message)
            if len(pending) >= ack_every:
                if ack_every == 1:
                    message.ack()  # type: ignore[attr-defined]
                else:  # one basic.ack with multiple=True for the whole group
                    message.channel.basic_ack(  # type: ignore[attr-defined]
                        message.delivery_tag, multiple=True)  # type: ignore[attr-defined]
                pending.clear()

        with Consumer(connection, [queue], callbacks=[on_message], accept=["json"],
                      prefetch_count=prefetch):
            while True:
                try:
                    connection.drain_events(timeout=2)
                except TimeoutError:
                    break
        for message in pending:
            message.ack()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()

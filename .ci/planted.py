"""A key in the machine's Redis and a queue in its RabbitMQ, planted before a test run and
checked after it: the suite must never touch a user's services.

    python .ci/planted.py plant NAME | check NAME | remove NAME

Only services listening on the default ports are used; a missing one is reported and left
out. Uses only redis-py and kombu (installed in the project's venv).
"""

from __future__ import annotations

import socket
import sys

REDIS_URL = "redis://127.0.0.1:6379/0"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
BODY = "planted by .ci/fresh-check; the test suite must leave it alone"


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def plant(name: str) -> None:
    import redis
    from kombu import Connection

    if listening(6379):
        with redis.Redis.from_url(REDIS_URL) as client:
            client.set(name, BODY)
        print(f"planted Redis key {name} in {REDIS_URL}")
    if listening(5672):
        with Connection(RABBITMQ_URL) as connection:
            queue = connection.SimpleQueue(name, queue_opts={"durable": False,
                                                             "auto_delete": False})
            queue.put(BODY, serializer="json")
            queue.close()
        print(f"planted RabbitMQ queue {name} with one message in {RABBITMQ_URL}")


def check(name: str) -> list[str]:
    import redis
    from kombu import Connection

    problems = []
    if listening(6379):
        with redis.Redis.from_url(REDIS_URL) as client:
            value = client.get(name)
        if value != BODY.encode():
            problems.append(f"Redis key {name} changed: {value!r}")
    if listening(5672):
        with Connection(RABBITMQ_URL) as connection:
            channel = connection.channel()
            try:
                _, ready, _ = channel.queue_declare(name, passive=True)
            except Exception as error:  # the queue is gone
                ready = f"queue missing ({error})"
            if ready != 1:
                problems.append(f"RabbitMQ queue {name}: {ready} messages, planted 1")
    return problems


def remove(name: str) -> None:
    import redis
    from kombu import Connection

    if listening(6379):
        with redis.Redis.from_url(REDIS_URL) as client:
            client.delete(name)
    if listening(5672):
        with Connection(RABBITMQ_URL) as connection:
            connection.channel().queue_delete(name)  # a missing queue is no error


def main(action: str, name: str) -> int:
    if action == "plant":
        plant(name)
    elif action == "remove":
        remove(name)
    else:
        problems = check(name)
        for problem in problems:
            print(f"FAIL: {problem}")
        if not problems:
            print(f"the planted key and queue {name} are unchanged")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))

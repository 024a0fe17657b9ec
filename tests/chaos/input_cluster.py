"""Helpers for the bad-input and security rows (tests/chaos/test_inputs_security.py): a real
``qcluster master`` on the chaos app, the master's view of its slots, and raw bad messages
published around the producer (straight to the broker, as any client of Redis or RabbitMQ
could)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qcluster.broker.base import Broker
from tests.conftest import free_port, wait_until
from tests.e2e.cluster import Procs, try_json

#: A valid envelope's head; the payload follows (see qcluster.job.encode_new_jobs).
ENVELOPE_HEAD = '{{"v":1,"id":"{id}","queue":"{queue}","enqueued_at":{at},"payload":'


def envelope(job_id: str, queue: str, payload_json: str | bytes, at: str = "1.0") -> bytes:
    payload = payload_json if isinstance(payload_json, bytes) else payload_json.encode()
    return ENVELOPE_HEAD.format(id=job_id, queue=queue, at=at).encode() + payload + b"}"


@dataclass
class Bad:
    """One raw message that no slot may run: its broker id, body and (RabbitMQ) properties."""

    id: str | bytes
    body: bytes
    what: str
    props: dict[str, Any] | None = None
    reason: str = "malformed"
    """What the dead letter's reason must start with."""


def bad_bodies(queue: str, tag: str) -> list[Bad]:
    """Bodies that cannot be a job, for any broker (ids unique per ``tag``)."""
    good = envelope(f"{tag}-t", queue, '{"n":1}')
    deep = 100_000
    return [
        Bad(f"{tag}-utf8", b"\xff\xfe{\"v\":1}", "invalid UTF-8 body"),
        Bad(f"{tag}-utf8-str", envelope(f"{tag}-u", queue, b'"\xff\xfe"'),
            "invalid UTF-8 inside a string"),
        Bad(f"{tag}-trunc", good[: len(good) // 2], "truncated JSON"),
        Bad(f"{tag}-empty", b"", "empty body"),
        Bad(f"{tag}-array", b"[]", "wrong schema: an array"),
        Bad(f"{tag}-v2", b'{"v":2,"id":"x","queue":"q","enqueued_at":1.0}', "wrong schema: v 2"),
        Bad(f"{tag}-noid", b'{"v":1,"queue":"q","enqueued_at":1.0}', "wrong schema: no id"),
        Bad(f"{tag}-extra", envelope(f"{tag}-x", queue, "1")[:-1] + b',"pickle":"x"}',
            "wrong schema: unknown field"),
        Bad(f"{tag}-types", b'{"v":1,"id":7,"queue":[],"enqueued_at":"x"}', "wrong types"),
        Bad(f"{tag}-deep", envelope(f"{tag}-d", queue, "[" * deep + "]" * deep),
            "100k-deep nesting"),
        Bad(f"{tag}-bigint", envelope(f"{tag}-b", queue, "9" * 5000), "a 5000-digit int"),
        Bad(f"{tag}-nul", b"\x00" * 64, "NUL bytes"),
        Bad(f"{tag}-id\xff".encode("latin-1"), envelope(f"{tag}-i", queue, "1"),
            "id not UTF-8"),
    ]


def nan_bodies(queue: str, tag: str) -> list[Bad]:
    """JSON's forbidden numbers: NaN and infinities are not JSON, and a producer refuses them
    (EnvelopeError); a decoder that accepted them (before K's fix) ran them."""
    return [
        Bad(f"{tag}-nan", envelope(f"{tag}-n", queue, "NaN"), "NaN payload"),
        Bad(f"{tag}-inf", envelope(f"{tag}-i", queue, '{"x":-Infinity}'), "-Infinity payload"),
        Bad(f"{tag}-at-inf", envelope(f"{tag}-a", queue, "1", at="1e999"),
            "enqueued_at 1e999 (infinite)"),
    ]


def amqp_bad(queue: str, tag: str) -> list[Bad]:
    """RabbitMQ only: wrong content types (pickle's among them) and unreadable headers."""
    body = envelope(f"{tag}-h", queue, '"bad"')
    return [
        Bad(f"{tag}-ct-pickle", b"\x80\x04K\x01.", "content type pickle",
            {"content_type": "application/x-python-serialize"}, reason="refused content type"),
        Bad(f"{tag}-ct-text", body, "content type text/plain",
            {"content_type": "text/plain"}, reason="refused content type"),
        Bad(f"{tag}-ct-none", body, "no content type", {"content_type": ""},
            reason="refused content type"),
        Bad(f"{tag}-hdr-abc", body, "x-qc-attempts 'abc'",
            {"application_headers": {"x-qc-attempts": "abc"}}),
        Bad(f"{tag}-hdr-utf8", body, "header not UTF-8",
            {"application_headers": {"x-qc-attempts": b"\xff\xfe"}}),
    ]


def publish_raw(broker_url: str, broker: Broker, queue: str, bad: list[Bad]) -> None:
    """Publish ``bad`` as they are, bypassing qcluster's producer."""
    if broker_url.startswith("amqp"):
        import amqp
        from kombu import Connection

        from qcluster.broker.kombu_broker import queue_exchange

        with Connection(broker_url) as conn:
            channel = conn.channel()
            for item in bad:
                props = dict(item.props or {})
                props.setdefault("content_type", "application/json")
                if not props["content_type"]:
                    del props["content_type"]
                message = amqp.Message(item.body, message_id=item.id, delivery_mode=2, **props)
                channel.basic_publish(message, exchange=queue_exchange(queue).name,
                                      routing_key=queue)
            channel.close()
        return
    broker.publish_many(queue, [(item.id, item.body) for item in bad])  # type: ignore[misc]


# --- a real master on the chaos app ------------------------------------------------------


def start_master(procs: Procs, broker_url: str, slots: str, *, name: str = "master",
                 extra: tuple[str, ...] = ()) -> int:
    """``qcluster master --app tests.chaos.apps --slots SLOTS`` (env from ``procs``); waits
    until every slot of the row is up and returns the master's HTTP port."""
    port = free_port()
    procs.start(name, "master", "--app", "tests.chaos.apps", "--broker", broker_url,
                "--slots", slots, "--listen", f"127.0.0.1:{port}", "--log-level", "INFO",
                *extra)
    wanted = sum(int(part.split("=")[1]) for part in slots.split(","))

    def up() -> bool:
        found = try_json(port, "/api/v1/slots")
        return bool(found) and sum(1 for s in found if s["state"] in ("idle", "busy")) >= wanted

    wait_until(up, timeout_s=90, message=f"{wanted} slots up\n{procs.log(name)[-2000:]}")
    return port


def slot_pids(port: int) -> set[int]:
    return {int(s["pid"]) for s in try_json(port, "/api/v1/slots") or []}


RESTART_LINE = re.compile(r'^qcluster_slot_restarts_total\{(?P<labels>[^}]*)\}\s+(?P<v>\S+)$')


def slot_restarts(port: int, queue: str) -> int:
    """Restarts of ``queue``'s slots, any reason, from the master's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        match = RESTART_LINE.match(line)
        if match and f'queue="{queue}"' in match["labels"]:
            total += float(match["v"])
    return int(total)


def dead_by_id(broker: Broker, queue: str) -> dict[str, Any]:
    return {dead.id: dead for dead in broker.dead_jobs(queue, limit=100_000)}


def wait_dead(broker: Broker, queue: str, count: int, timeout_s: float = 60.0) -> None:
    wait_until(lambda: broker.stats(queue).dead >= count, timeout_s=timeout_s,
               message=f"{count} dead letters on {queue}")


def log_lines(paths: Iterator[Path]) -> str:
    return "\n".join(p.read_text(errors="replace") for p in paths)


def http_json(url: str, data: bytes | None = None, headers: dict[str, str] | None = None,
              method: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def now() -> float:
    return time.time()



def text_id(job_id: str | bytes) -> str:
    """A bad message's id as the broker shows it (undecodable bytes replaced)."""
    return job_id if isinstance(job_id, str) else job_id.decode("utf-8", "replace")

"""The operator controls on RabbitMQ (the manager's pause and drain,
:mod:`qcluster.controls`): one JSON document, ``{"version": N, "controls": {"KIND:NAME":
value}}``, the only message of the durable queue ``qc~controls`` (``x-max-length`` 1; AMQP
cannot list queues, so one place holds them all).

A reader takes the message unacknowledged and gives it back (closes its channel); a
writer holds it while it publishes the changed document (confirmed), then acks the old
one, so two managers' changes do not overwrite each other (a writer that dies between the
two leaves both: the higher version wins). While another process holds it, a reader finds
the queue empty and keeps what it read last (None), and a writer refuses
(:class:`~qcluster.broker.amqp_single.DocumentHeld`, a BrokerUnavailable; only the call
that creates the queue writes on an empty one: :mod:`~qcluster.broker.amqp_single`).
"""

from __future__ import annotations

import json
from typing import Any

from qcluster.broker.amqp_messages import message_body
from qcluster.broker.amqp_single import SingleDocumentQueue

#: The operator controls' document: the only message of this queue.
CONTROLS_QUEUE = "qc~controls"
#: A writer that finds the existing queue empty (another process holds the document) looks
#: again this often, this long apart (a reader holds it for a round trip), then refuses.
CONTROL_HOLD_TRIES = 20
CONTROL_HOLD_WAIT_S = 0.05


class Controls:
    """The controls' document over a kombu connection; each call runs inside the link's
    ``retrying``."""

    def __init__(self, conn: Any, confirm_timeout_s: float) -> None:
        self.document = SingleDocumentQueue(conn, CONTROLS_QUEUE, confirm_timeout_s)

    def read(self) -> dict[str, bytes] | None:
        """``Broker.read_controls``: {} when never written, None while held elsewhere."""
        channel = self.document.open_existing()
        if channel is None:
            return {}  # never written (a reader does not create the queue)
        try:
            held = self.document.hold(channel)
            return newest(held)[1] if held else None
        finally:
            channel.close()  # unacked: the broker puts the document back

    def write(self, key: str, value: bytes | None) -> None:
        """``Broker.write_control``: set ``key`` (None: remove it) in a new version."""
        channel, created = self.document.open()
        try:
            held = self.document.hold_for_write(channel, created, CONTROL_HOLD_TRIES,
                                                CONTROL_HOLD_WAIT_S)
            version, document = newest(held) if held else (0, {})
            if value is None:
                document.pop(key, None)
            else:
                document[key] = value
            body = json.dumps({"version": version + 1, "controls": {
                k: v.decode("utf-8", "replace") for k, v in sorted(document.items())}})
            self.document.publish(channel, body.encode())
            if held:  # only now: until the new one is confirmed, the old one stays
                channel.basic_ack(held[-1].delivery_tag, multiple=True)
        finally:
            channel.close()


def newest(held: list[Any]) -> tuple[int, dict[str, bytes]]:
    """The highest version among the documents held: ``(version, controls)``."""
    return max((control_document(message_body(message)) for message in held),
               key=lambda d: d[0])


def control_document(body: bytes) -> tuple[int, dict[str, bytes]]:
    """``(version, controls)``; a message that is not a document counts as an empty one of
    version 0 (the next write replaces it)."""
    try:
        document = json.loads(body)
    except ValueError:
        return 0, {}
    if not isinstance(document, dict) or not isinstance(document.get("controls"), dict):
        return 0, {}
    version = document.get("version")
    controls = {str(k): v.encode() for k, v in document["controls"].items()
                if isinstance(v, str)}
    return (version if isinstance(version, int) else 0), controls

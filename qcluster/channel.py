"""The per-slot control channel: one SOCK_SEQPACKET socketpair per slot.

Each packet is one JSON message of :mod:`qcluster.messages`; SEQPACKET keeps message
boundaries, so there is no framing code. Both ends are non-blocking: a slot never
waits on its master, and a master never waits on a slow slot.
"""

from __future__ import annotations

import socket
from typing import Generic, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from qcluster.messages import MASTER_TO_SLOT, SLOT_TO_MASTER, MasterToSlot, SlotToMaster

MAX_PACKET_BYTES = 64 * 1024

In = TypeVar("In")


class Channel(Generic[In]):
    """One end of a slot channel, decoding what it receives with ``adapter``."""

    def __init__(self, sock: socket.socket, adapter: TypeAdapter[In]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._adapter = adapter
        self.closed = False

    def send(self, message: BaseModel) -> bool:
        """Send one message; False if the peer is gone or its buffer is full."""
        if self.closed:
            return False
        try:
            self.sock.send(message.model_dump_json().encode())
            return True
        except BlockingIOError:
            return False  # peer not reading: a counter update is not worth blocking for
        except OSError:
            self.closed = True
            return False

    def receive(self) -> list[In]:
        """Every message waiting now (possibly none). Marks the channel closed on EOF."""
        messages: list[In] = []
        while not self.closed:
            try:
                packet = self.sock.recv(MAX_PACKET_BYTES)
            except BlockingIOError:
                break
            except OSError:
                self.closed = True
                break
            if not packet:
                self.closed = True
                break
            try:
                messages.append(self._adapter.validate_json(packet))
            except ValidationError:
                continue  # a garbled packet must not take the peer down
        return messages

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def slot_channel_pair() -> tuple[Channel[SlotToMaster], Channel[MasterToSlot]]:
    """(master end, slot end) of a new channel. Call before fork; each side closes the other."""
    master_sock, slot_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return Channel(master_sock, SLOT_TO_MASTER), Channel(slot_sock, MASTER_TO_SLOT)

"""The per-slot control channel: one SOCK_SEQPACKET socketpair per slot.

Each packet is one JSON message of :mod:`qcluster.messages`; SEQPACKET keeps message
boundaries, so there is no framing code. Both ends are non-blocking: a slot never
waits on its master, and a master never waits on a slow slot.
"""

from __future__ import annotations

import mmap
import socket
import struct
from typing import Generic, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from qcluster.messages import (
    MASTER_TO_SLOT,
    SLOT_TO_MASTER,
    MasterToSlot,
    Progress,
    SlotToMaster,
)

MAX_PACKET_BYTES = 64 * 1024

In = TypeVar("In")


class TakeProgress(Progress):
    """How far a slot got through its current take, in memory shared with its master.

    The slot writes (no syscall: a store per job); the master reads it only after the
    slot died, to give each held job back by its state (see messages.HeldTake/GiveBack):
    UNSTARTED jobs without charging an attempt, the RUNNING one counted and suspect,
    DONE ones acked, RAN (retry or error outcome) and FAILED ones counted.
    """

    #: Jobs of one take it can follow; a bigger take is not followed (seq 0).
    CAPACITY = 4096
    _HEADER = 8

    def __init__(self) -> None:
        # Anonymous and shared: created before fork, both processes see the same pages.
        self._map = mmap.mmap(-1, self._HEADER + self.CAPACITY)
        self.states = memoryview(self._map)[self._HEADER:]
        """One state byte per job of the take, by its index in the take."""

    @property
    def seq(self) -> int:
        """The current take's number; 0: no take followed."""
        return int(struct.unpack_from("<Q", self._map, 0)[0])

    def begin(self, seq: int, jobs: int) -> bool:
        """A new take of ``jobs`` jobs, all UNSTARTED; False (nothing followed) when it is
        bigger than CAPACITY."""
        struct.pack_into("<Q", self._map, 0, 0)  # never a new number with old states
        if jobs > self.CAPACITY:
            return False
        self.states[:jobs] = bytes(jobs)
        struct.pack_into("<Q", self._map, 0, seq)
        return True

    def clear(self) -> None:
        struct.pack_into("<Q", self._map, 0, 0)


class Channel(Generic[In]):
    """One end of a slot channel, decoding what it receives with ``adapter``."""

    def __init__(self, sock: socket.socket, adapter: TypeAdapter[In]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._adapter = adapter
        self.closed = False
        self.progress: TakeProgress | None = None
        """Shared with the other end (see slot_channel_pair)."""

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
        # Only dropped: the other end (same process before fork) may still read it; the
        # mapping goes with the last reference.
        self.progress = None


def slot_channel_pair() -> tuple[Channel[SlotToMaster], Channel[MasterToSlot]]:
    """(master end, slot end) of a new channel, sharing one TakeProgress. Call before fork;
    each side closes the other (closing an end unmaps only its own process's view)."""
    master_sock, slot_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    master_end: Channel[SlotToMaster] = Channel(master_sock, SLOT_TO_MASTER)
    slot_end: Channel[MasterToSlot] = Channel(slot_sock, MASTER_TO_SLOT)
    master_end.progress = slot_end.progress = TakeProgress()
    return master_end, slot_end

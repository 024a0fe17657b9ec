"""The per-slot control channel: one SOCK_SEQPACKET socketpair per slot.

Each packet is one JSON message of :mod:`qcluster.messages`; SEQPACKET keeps message
boundaries, so there is no framing code. Both ends are non-blocking: a slot never
waits on its master, and a master never waits on a slow slot.
"""

from __future__ import annotations

import errno
import mmap
import os
import socket
import struct
from array import array
from collections.abc import Sequence
from typing import Generic, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from qcluster.job import Delivery
from qcluster.messages import (
    MASTER_TO_SLOT,
    SLOT_TO_MASTER,
    GiveBack,
    HeldJob,
    MasterToSlot,
    Progress,
    SlotToMaster,
)

MAX_PACKET_BYTES = 64 * 1024
#: One part of a message sent in parts (:func:`send_parts`), and the most those carry.
PART_BYTES = 32 * 1024
MAX_PARTS_BYTES = 16 << 20
_MORE, _LAST = b"+", b"."

In = TypeVar("In")


class TakeProgress(Progress):
    """A slot's current take and how far it got, in memory shared with its master.

    At each take the slot writes what the take holds (ids, attempts, activation times,
    the lock token, the queue) and then one state byte per job as it runs them: stores
    into shared pages, no syscall, nothing sent. The master reads it only after the slot
    died (:meth:`read`), to have each held job given back by its state (messages.GiveBack):
    UNSTARTED ones without charging an attempt, the RUNNING one counted and suspect, DONE
    ones acked, RAN (retry or error outcome) and FAILED ones as their outcome said.
    """

    #: Jobs of one take it can follow, and the bytes of their ids (newline-joined); a
    #: bigger take is not followed (its jobs come back when their locks expire).
    CAPACITY = 4096
    IDS_BYTES = 256 * 1024
    #: seq, jobs, ids bytes, receipt, queue bytes, taken at, settleable by the master
    _HEAD = struct.Struct("<QIIqHd?")
    _QUEUE_AT, _QUEUE_BYTES = 40, 256
    _STATES_AT = _QUEUE_AT + _QUEUE_BYTES
    _ATTEMPTS_AT = _STATES_AT + CAPACITY
    _ACTIVATE_AT = _ATTEMPTS_AT + 4 * CAPACITY
    _IDS_AT = _ACTIVATE_AT + 8 * CAPACITY

    SIZE = _IDS_AT + IDS_BYTES

    def __init__(self, fd: int | None = None) -> None:
        """A new shared area, or (``fd``) the one another process made and passed over
        its channel (SCM_RIGHTS; the fd stays the caller's).

        A memfd rather than an anonymous mapping: the master can hand it to a slot
        forked by a reload template (master/template.py), which inherits nothing of the
        master's. Both are shmem pages mapped MAP_SHARED: the slot's stores cost the
        same (only the pages a take touches become resident)."""
        self.fd: int | None = None
        """The memfd while this process may still pass it on (see :meth:`close_fd`)."""
        if fd is None:
            try:
                fd = self.fd = os.memfd_create("qcluster-take", os.MFD_CLOEXEC)
                os.ftruncate(fd, self.SIZE)
            except OSError:  # no memfd here (a seccomp filter, an old kernel): shared
                self.close_fd()  # all the same through fork, but it cannot be passed on
                fd = -1
        try:
            self._map = mmap.mmap(fd, self.SIZE)
        except OSError:
            self.close_fd()
            raise
        view = memoryview(self._map)
        self.states = view[self._STATES_AT : self._ATTEMPTS_AT]
        """One state byte per job of the take, by its index in the take."""
        self._attempts = view[self._ATTEMPTS_AT : self._ACTIVATE_AT].cast("i")
        self._activate = view[self._ACTIVATE_AT : self._IDS_AT].cast("d")

    def close_fd(self) -> None:
        """Close the memfd (the mapping stays): once the slot has it, nobody passes it on."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @property
    def seq(self) -> int:
        """The current take's number; 0: no take followed."""
        return int(struct.unpack_from("<Q", self._map, 0)[0])

    def begin(self, seq: int, queue: str, receipt: int, deliveries: Sequence[Delivery], *,
              settleable: bool = True) -> bool:
        """Follow a new take, every job UNSTARTED; False (nothing followed) when it does
        not fit or a master could not settle it (an id with a newline). A take the master
        cannot settle (``settleable`` False: the broker gives back a dead slot's jobs
        itself, as RabbitMQ does) is followed for lookups only (:meth:`find`)."""
        struct.pack_into("<Q", self._map, 0, 0)  # never a new number with old contents
        jobs = len(deliveries)
        ids = "\n".join([d.id for d in deliveries]).encode("utf-8", "surrogateescape")
        name = queue.encode()
        if (jobs > self.CAPACITY or len(ids) > self.IDS_BYTES or len(name) > self._QUEUE_BYTES
                or ids.count(b"\n") != jobs - 1 or not -(1 << 63) <= receipt < 1 << 63):
            return False
        self._map[self._IDS_AT : self._IDS_AT + len(ids)] = ids
        self._map[self._QUEUE_AT : self._QUEUE_AT + len(name)] = name
        self._attempts[:jobs] = array("i", [d.attempts for d in deliveries])
        self._activate[:jobs] = array("d", [d.activate_at for d in deliveries])
        self.states[:jobs] = bytes(jobs)
        taken_at = deliveries[0].taken_at if deliveries else 0.0
        self._HEAD.pack_into(self._map, 0, 0, jobs, len(ids), receipt, len(name), taken_at,
                             settleable)
        struct.pack_into("<Q", self._map, 0, seq)
        return True

    def clear(self) -> None:
        struct.pack_into("<Q", self._map, 0, 0)

    def receipt(self) -> int | None:
        """The lock token of the take followed now (None: none, or it is being written):
        a master reports it so that a lookup can say which slot runs a job."""
        seq, jobs, _, receipt, _, _, settleable = self._HEAD.unpack_from(self._map, 0)
        return int(receipt) if seq and jobs and settleable and self.seq == seq else None

    def find(self, wanted: set[str]) -> list[HeldJob]:
        """The jobs of ``wanted`` that the followed take holds and has not finished, read
        while the slot works: a take replaced during the read answers nothing (the slot
        moved on, and those jobs with it)."""
        seq, jobs, ids_bytes, _, name_bytes, taken_at, _ = self._HEAD.unpack_from(self._map, 0)
        if not seq or not jobs:
            return []
        ids = self._map[self._IDS_AT : self._IDS_AT + ids_bytes].decode(
            "utf-8", "surrogateescape").split("\n")
        queue = self._map[self._QUEUE_AT : self._QUEUE_AT + name_bytes].decode(errors="replace")
        found = [(job_id, self._attempts[n], self.states[n] == Progress.RUNNING)
                 for n, job_id in enumerate(ids[:jobs])
                 if job_id in wanted and self.states[n] <= Progress.RUNNING]
        if not found or self.seq != seq:  # a torn read is never validated, nor answered
            return []
        return [HeldJob(id=job_id, queue=queue, attempts=attempts, taken_at=taken_at,
                        started=started) for job_id, attempts, started in found]

    def read(self) -> GiveBack | None:
        """The followed take, each job with its state (None: none followed, or one its
        master cannot settle)."""
        seq, jobs, ids_bytes, receipt, name_bytes, _, settleable = self._HEAD.unpack_from(
            self._map, 0)
        if not seq or not jobs or not settleable:
            return None
        ids = self._map[self._IDS_AT : self._IDS_AT + ids_bytes].decode(
            "utf-8", "surrogateescape").split("\n")
        queue = self._map[self._QUEUE_AT : self._QUEUE_AT + name_bytes].decode()
        return GiveBack(queue=queue, receipt=receipt, jobs=[
            (ids[n], self._attempts[n], self._activate[n], self.states[n])
            for n in range(jobs)])


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
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                return False  # this message is too big to send; the peer is still there
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
        # Its memfd is closed (a failed fork leaked one per attempt); the mapping is only
        # dropped: the other end (same process before fork) may still read it, and it
        # goes with the last reference.
        if self.progress is not None:
            self.progress.close_fd()
        self.progress = None


def slot_channel_pair() -> tuple[Channel[SlotToMaster], Channel[MasterToSlot]]:
    """(master end, slot end) of a new channel, sharing one TakeProgress. Call before fork;
    each side closes the other (closing an end unmaps only its own process's view)."""
    master_sock, slot_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        progress = TakeProgress()
    except OSError:  # (no memory for the mapping): nothing left open behind
        master_sock.close()
        slot_sock.close()
        raise
    master_end: Channel[SlotToMaster] = Channel(master_sock, SLOT_TO_MASTER)
    slot_end: Channel[MasterToSlot] = Channel(slot_sock, MASTER_TO_SLOT)
    master_end.progress = slot_end.progress = progress
    return master_end, slot_end


def send_with_fds(sock: socket.socket, message: BaseModel, fds: Sequence[int]) -> None:
    """One JSON packet carrying ``fds`` (SCM_RIGHTS): a slot's channel end and memfd."""
    socket.send_fds(sock, [message.model_dump_json().encode()], list(fds))


def receive_with_fds(sock: socket.socket, max_fds: int = 4) -> tuple[bytes, list[int]]:
    """One packet and the descriptors it carried (b"" on EOF)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_PACKET_BYTES, max_fds)
    return data, fds


def send_parts(sock: socket.socket, payload: bytes) -> None:
    """One message of any size as packets of at most ``PART_BYTES``, each flagged more or
    last: a reload template's answer with 1000 queues' policies exceeds one packet (and
    the socket's send buffer). Blocks while the peer's buffer is full."""
    for at in range(0, max(len(payload), 1), PART_BYTES):
        last = at + PART_BYTES >= len(payload)
        sock.send((_LAST if last else _MORE) + payload[at : at + PART_BYTES])


class PartsReader:
    """Reassembles what :func:`send_parts` sent, across non-blocking reads."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def read(self, sock: socket.socket) -> bytes:
        """The whole message once its last part came (b"" on EOF). BlockingIOError: not
        all of it yet (the parts so far are kept for the next call). ValueError: over
        ``MAX_PARTS_BYTES`` or not in parts."""
        while True:
            packet = sock.recv(MAX_PACKET_BYTES)
            if not packet:
                return b""
            flag, part = packet[:1], packet[1:]
            if flag not in (_MORE, _LAST):
                raise ValueError("not a message in parts")
            self._size += len(part)
            if self._size > MAX_PARTS_BYTES:
                raise ValueError(f"a message over {MAX_PARTS_BYTES} bytes")
            self._parts.append(part)
            if flag == _LAST:
                whole, self._parts, self._size = b"".join(self._parts), [], 0
                return whole

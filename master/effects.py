"""The master's effects on processes: fork a slot, signal it, reap it, wait for its
messages or a signal. Everything here touches the OS; nothing here decides.

Signal handlers only queue the signal (no logging, no kill: a handler runs between two
bytecodes of the loop, which may hold the logging lock); ``set_wakeup_fd`` writes a byte
to a socket the selector watches, so the loop wakes and handles the queue.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import selectors
import signal
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from qcluster import exitcodes
from qcluster.channel import Channel, slot_channel_pair
from qcluster.errors import AppImportError, BrokerError, ConfigError, HandlerNotFound
from qcluster.messages import GiveBack, HeldJob, MasterToSlot, SlotToMaster

if TYPE_CHECKING:
    from qcluster.master.template import Template, Tend

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
#: Process names (``/proc/PID/comm``, what ``ps -o comm`` and ``pgrep`` show): a slot
#: forked by a reload template keeps the template's command line in ``ps -o args``.
SLOT_NAME, TEMPLATE_NAME = "qc-slot", "qc-template"
PR_SET_CHILD_SUBREAPER = 36
#: The key a watched non-slot socket (a reload template's) is reported under by wait().
OTHER_SOCKET = -1
#: Exceptions that end a forked slot, and the exit code the master decodes them by.
CHILD_EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (HandlerNotFound, exitcodes.BOOT_ERROR),
    (ConfigError, exitcodes.BOOT_ERROR),
    (AppImportError, exitcodes.APP_IMPORT),
    (BrokerError, exitcodes.BROKER_CONNECT),
)
SlotMain = Callable[[str, int, Channel[MasterToSlot]], int]
"""What a forked slot runs: (queue, slot number, its channel end) -> exit code."""


@functools.cache
def prctl() -> Any:
    """libc's ``prctl``, loaded once. The master loads it before it forks (it becomes a
    subreaper; the template calls it too), so a slot calls the inherited function: a
    ``ctypes.CDLL`` made in each slot would cost it some 200 KiB of private memory (a
    new function-pointer class, and the shared pages its making touches)."""
    return ctypes.CDLL("libc.so.6", use_errno=True).prctl


def set_parent_death_signal() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the master) dies."""
    prctl()(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def set_process_name(name: str) -> None:
    """Name this process (at most 15 bytes) in /proc/PID/comm; the command line stays."""
    prctl()(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def become_subreaper() -> None:
    """Orphaned descendants are reparented to this process instead of init: the slots a
    reload template double-forks become the master's children (it waits for them, and
    they die with it). Other orphans (a handler's daemon) are reaped and ignored."""
    if prctl()(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        logger.warning("PR_SET_CHILD_SUBREAPER failed (errno %d): reloaded slots would not "
                       "be this master's children", ctypes.get_errno())


def become_slot(master_pid: int, queue: str, slot_no: int, close_inherited: Callable[[], None],
                run: Callable[[], int]) -> int:
    """In a new slot, forked by the master or by a reload template: die with the master,
    take the slot's name and signal dispositions, close what it inherited but must not
    hold (``close_inherited``), then ``run`` it; returns the exit code (an exception
    becomes the code the master decodes it by)."""
    set_parent_death_signal()
    if os.getppid() != master_pid:  # the master died before prctl took effect
        return exitcodes.FAILURE
    set_process_name(SLOT_NAME)
    signal.set_wakeup_fd(-1)  # (the master's wake-up socket is closed below)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal stops no batch
    try:
        close_inherited()
        return int(run())
    except Exception as exc:  # the exit code tells the master a boot error from a crash
        logger.exception("slot %d (%s) failed", slot_no, queue)
        return child_exit_code(exc)


def child_exit_code(exc: BaseException) -> int:
    return next((code for cls, code in CHILD_EXIT_CODES if isinstance(exc, cls)),
                exitcodes.FAILURE)


class SlotChannels:
    """What the loop sleeps on: each slot's channel (by pid), other watched sockets (a
    reload template's) and the socket a signal's wake-up byte is written to."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._channels: dict[int, Channel[SlotToMaster]] = {}
        self._others: list[socket.socket] = []
        """Watched sockets that are not slot channels (reload templates')."""

    def wakeup_fd(self) -> int:
        """The descriptor for ``signal.set_wakeup_fd``: a signal then wakes :meth:`wait`."""
        self._wake_w.setblocking(False)
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        return self._wake_w.fileno()

    def wait(self, timeout_s: float) -> list[int]:
        """Sleep until a channel has messages, a signal came, or ``timeout_s``; returns the
        pids of the slots whose channels have messages."""
        ready: list[int] = []
        for key, _ in self._selector.select(timeout_s):
            if key.fileobj is self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
            else:
                ready.append(key.data)
        return ready

    def add(self, pid: int, master_end: Channel[SlotToMaster]) -> None:
        """Watch a new slot's channel (its TakeProgress mapping stays, its memfd closes)."""
        if master_end.progress is not None:
            master_end.progress.close_fd()  # the slot has its mapping: nothing to pass on
        self._channels[pid] = master_end
        self._selector.register(master_end.sock, selectors.EVENT_READ, pid)

    def watch(self, sock: socket.socket) -> None:
        """Wake the loop when ``sock`` is readable (reported as OTHER_SOCKET)."""
        self._selector.register(sock, selectors.EVENT_READ, OTHER_SOCKET)
        self._others.append(sock)

    def unwatch(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        if sock in self._others:
            self._others.remove(sock)

    def receive(self, pid: int) -> list[SlotToMaster]:
        channel = self._channels.get(pid)
        return channel.receive() if channel is not None else []

    def send(self, pid: int, message: MasterToSlot) -> bool:
        channel = self._channels.get(pid)
        return channel.send(message) if channel is not None else False

    def last_take(self, pid: int) -> GiveBack | None:
        """The take the slot's shared TakeProgress followed, each job with its state (None:
        none). Read after the slot ended, before :meth:`forget`."""
        channel = self._channels.get(pid)
        progress = channel.progress if channel is not None else None
        if progress is None:
            return None
        try:
            return progress.read()
        except ValueError as exc:  # a slot that died mid-write cannot leave garbage here
            logger.warning("slot pid %d: unreadable take progress: %s", pid, exc)
            return None

    def takes(self) -> dict[int, int]:
        """Each slot's lock token of the take it holds now, by pid (a few bytes read per
        slot from the shared TakeProgress; slots whose take is not followed are left out)."""
        found = {}
        for pid, channel in self._channels.items():
            receipt = channel.progress.receipt() if channel.progress is not None else None
            if receipt is not None:
                found[pid] = receipt
        return found

    def held(self, wanted: set[str]) -> dict[int, list[HeldJob]]:
        """Of ``wanted``, the jobs each slot's take holds now, by pid. Safe from another
        thread than the loop's: it reads shared pages, and a take replaced meanwhile
        answers nothing."""
        found = {}
        for pid, channel in list(self._channels.items()):
            progress = channel.progress  # read once: the loop may close the channel meanwhile
            try:
                jobs = progress.find(wanted) if progress is not None else []
            except (ValueError, ValidationError):  # closed, or written while read: skipped
                continue
            if jobs:
                found[pid] = jobs
        return found

    def forget(self, pid: int) -> None:
        channel = self._channels.pop(pid, None)
        if channel is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(channel.sock)
            channel.close()

    def close_in_child(self) -> None:
        """In a forked slot: close the master's descriptors (the slot keeps its own end)."""
        self._selector.close()
        for other in self._channels.values():
            other.sock.close()
        for sock in self._others:
            sock.close()
        for fd in (self._wake_r.fileno(), self._wake_w.fileno()):
            with contextlib.suppress(OSError):
                os.close(fd)


class ProcessEffects:
    def __init__(self) -> None:
        self.signals: deque[int] = deque()
        self.channels = SlotChannels()
        self.extra_fds: list[int] = []
        """Inherited descriptors a slot must close (the HTTP endpoint's socket)."""
        self.fork_lock = threading.Lock()
        """Held by whoever opens a short-lived socket in another thread (the /healthz
        broker check): a fork meanwhile would leave a copy of it open in the slot."""
        self.tend: Tend | None = None
        """What runs while a reload template forks (the supervisor's due kills)."""

    def install_signals(self) -> None:
        signal.set_wakeup_fd(self.channels.wakeup_fd(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, self.queue_signal)

    def queue_signal(self, signum: int, frame: Any) -> None:
        """The handler: NO LOGGING, just queue the signal (deque.append is atomic)."""
        self.signals.append(signum)

    def fork(self, queue: str, slot_no: int, main: SlotMain) -> int | None:
        """Fork a slot running ``main``; returns its pid (its channel is watched by pid), or
        None when another thread holds a socket this instant (the next pass forks).
        OSError: no descriptor, process or memory left (nothing is left open)."""
        if not self.fork_lock.acquire(blocking=False):
            return None
        master_pid = os.getpid()
        try:
            master_end, slot_end = slot_channel_pair()
            try:
                pid = os.fork()
            except OSError:  # no process or memory left: nothing left open behind
                master_end.close()
                slot_end.close()
                raise
        finally:
            if os.getpid() == master_pid:
                self.fork_lock.release()
        if pid == 0:  # the slot
            code = exitcodes.FAILURE
            try:
                master_end.close()
                code = self._become_slot(master_pid, queue, slot_no, slot_end, main)
            finally:
                os._exit(code)
        slot_end.close()
        self.channels.add(pid, master_end)
        return pid

    def fork_via(self, template: Template, queue: str, slot_no: int) -> int | None:
        """Have a reload template fork the slot (its channel end and TakeProgress memfd go
        over with SCM_RIGHTS); None when the template did not answer (every descriptor
        of the attempt is closed). OSError: no descriptor left for the channel."""
        master_end, slot_end = slot_channel_pair()
        progress = master_end.progress
        if progress is not None and progress.fd is None:
            master_end.progress = None  # no memfd to pass: this slot's take is not followed
        try:
            pid = template.fork_slot(queue, slot_no, slot_end.fileno(),
                                     progress.fd if progress else None, tend=self.tend)
        finally:
            slot_end.close()
        if pid is None:
            master_end.close()
            return None
        self.channels.add(pid, master_end)
        return pid

    def _become_slot(self, master_pid: int, queue: str, slot_no: int,
                     channel: Channel[MasterToSlot], main: SlotMain) -> int:
        if channel.progress is not None:
            channel.progress.close_fd()

        def close_inherited() -> None:
            self.channels.close_in_child()
            for fd in self.extra_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

        return become_slot(master_pid, queue, slot_no, close_inherited,
                           lambda: main(queue, slot_no, channel))

    def signal(self, pid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    def reap(self, *, block: bool = False) -> list[tuple[int, int]]:
        """Ended children as (pid, exit code; negative: killed by that signal). Blocking:
        waits for one."""
        ended: list[tuple[int, int]] = []
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return ended
            if pid == 0:
                return ended
            ended.append((pid, os.waitstatus_to_exitcode(status)))
            if block:
                return ended

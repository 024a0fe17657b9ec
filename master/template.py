"""A reload template: a fresh process that imports the app anew and forks slots from it.

The master cannot un-import its app, so a reload (SIGHUP, or the manager's
``Assignment.reload_id``) starts this module as a new process
(``python -m qcluster.master.template FD``; a :class:`TemplateSpec` comes first on FD).
It imports the app as the master did
(``load_app`` + the ``[queues.X]`` overrides of a re-read qcluster.toml), checks every
queue of the row has a handler, freezes the GC, and answers on its control socket with
:class:`Ready` (version, queue policies) or :class:`Failed` (one line), in parts
(``channel.send_parts``: 1000 queues' policies exceed one packet). Any exception at
import, SyntaxError included, is a :class:`Failed`.

Then it forks slots on request: the master sends :class:`ForkSlot` with the slot's
channel end and its TakeProgress memfd (SCM_RIGHTS). The template double-forks: the
middle child exits at once, so the slot is reparented to the master (a child subreaper,
``PR_SET_CHILD_SUBREAPER``), which waits for it and which it dies with, as with the
master's own forks. The reply (:class:`Forked`) carries the slot's pid.

The template dies with the master (``PR_SET_PDEATHSIG``) and exits when its control
socket closes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, Field, TypeAdapter

from qcluster import exitcodes
from qcluster.channel import (
    MAX_PACKET_BYTES,
    Channel,
    PartsReader,
    TakeProgress,
    receive_with_fds,
    send_parts,
    send_with_fds,
)
from qcluster.messages import MASTER_TO_SLOT, MasterToSlot
from qcluster.policy import QueuePolicy

logger = logging.getLogger(__name__)

#: The answer of a template whose socket closed before it answered.
EXITED_EARLY = "the template exited before it answered"
#: How long a slot waits to be reparented to the master after the middle child exits
#: (microseconds in practice: the kernel reparents as the middle child exits).
REPARENT_TIMEOUT_S = 5.0
#: Seconds a template has to fork a slot and answer; then it is killed (and replaced).
FORK_TIMEOUT_S = 5.0
Tend = Callable[[], float | None]
"""What the master's loop must not put off while it waits for a template (kill the slots
past their batch deadline); returns when it is due again (monotonic; None: nothing due)."""


class TemplateSpec(BaseModel):
    """What the master tells a new template (its first argument, JSON)."""

    app: str
    config: str | None = None
    """The master's ``--config`` (None: qcluster.toml is looked up as at start)."""
    row: list[str] = Field(default_factory=list)
    """Queues the master runs now: each needs a handler in the new code."""
    broker_url: str | None = None
    state_dir: str = "."
    master_pid: int
    log_level: str = "INFO"
    metrics: bool = True
    host_name: str = ""
    generation: int = 0
    """The code generation its slots run (shown in their process titles)."""


class Ready(BaseModel):
    kind: Literal["ready"] = "ready"
    version: str
    queues: dict[str, QueuePolicy]


class Failed(BaseModel):
    kind: Literal["failed"] = "failed"
    error: str


class ForkSlot(BaseModel):
    kind: Literal["fork"] = "fork"
    queue: str
    slot_no: int


class Forked(BaseModel):
    kind: Literal["forked"] = "forked"
    pid: int
    """The slot's pid; 0: the template could not fork it."""


TemplateReply = Annotated[Ready | Failed | Forked, Field(discriminator="kind")]
REPLY: TypeAdapter[Ready | Failed | Forked] = TypeAdapter(TemplateReply)


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (a SyntaxError keeps its file and line)."""
    text = " ".join(str(exc).split()) or repr(exc)
    return f"{type(exc).__name__}: {text}"[:500]


def import_app(spec: TemplateSpec) -> tuple[Ready, object]:
    """Import the app anew as the master would; returns the Ready answer and the app."""
    from qcluster.app import code_version, load_app
    from qcluster.config import load_settings
    from qcluster.slot.prefork import prepare_slots, warm_redis

    settings = load_settings(spec.config)
    app = load_app(spec.app).with_overrides(settings.queues)
    for queue in spec.row:
        app.spec(queue)  # HandlerNotFound: the new code lost a queue the host runs
    prepare_slots(spec.broker_url, spec.metrics)
    warm_redis(spec.broker_url, Path(spec.state_dir))  # as the master's check at start
    ready = Ready(version=code_version(app, spec.app),
                  queues={name: q.policy for name, q in app.queues.items()})
    return ready, app


def main(argv: list[str]) -> int:
    control = socket.socket(fileno=int(argv[0]))
    # The spec comes over the socket, not the command line: a broker URL may hold a
    # password, and any local user can read a command line.
    spec = TemplateSpec.model_validate_json(PartsReader().read(control))
    from qcluster.cli_support import setup_logging
    from qcluster.master.effects import TEMPLATE_NAME, set_parent_death_signal, set_process_name

    set_parent_death_signal()
    set_process_name(TEMPLATE_NAME)  # its slots, which share its command line: SLOT_NAME
    if os.getppid() != spec.master_pid:
        return exitcodes.FAILURE  # the master died before prctl took effect
    for signum in (signal.SIGINT, signal.SIGHUP):  # Ctrl-C reaches the whole group: the
        signal.signal(signum, signal.SIG_IGN)      # master decides what ends a template
    setup_logging(spec.log_level)
    from qcluster.slot import identity

    identity.set_identity(spec.host_name, spec.generation)  # its slots inherit it
    identity.set_title("template")
    try:
        ready, app = import_app(spec)
    except BaseException as exc:  # any failure of the new code (SyntaxError, SystemExit)
        with contextlib.suppress(OSError):  # (the master may have gone meanwhile)
            send_parts(control, Failed(error=one_line(exc)).model_dump_json().encode())
        return exitcodes.OK
    gc.collect()
    gc.freeze()  # the slots share what the import made, copy-on-write
    try:
        send_parts(control, ready.model_dump_json().encode())  # 1000 queues: ~300 KB
    except OSError:
        return exitcodes.OK  # the master ended this template (or is gone)
    return serve(control, spec, app)


def serve(control: socket.socket, spec: TemplateSpec, app: object) -> int:
    """Fork a slot for each request until the master closes the socket."""
    while True:
        data, fds = receive_with_fds(control)
        if not data:
            return exitcodes.OK
        try:
            order = ForkSlot.model_validate_json(data)
            pid = fork_slot(control, spec, app, order, fds) if fds else 0
        except OSError as exc:  # no process left (EAGAIN), no memory: the master retries
            logger.error("template: cannot fork a slot: %s", exc)
            pid = 0
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        try:
            control.send(Forked(pid=pid).model_dump_json().encode())
        except OSError:
            return exitcodes.OK


def fork_slot(control: socket.socket, spec: TemplateSpec, app: object, order: ForkSlot,
              fds: list[int]) -> int:
    """Double fork: returns the grandchild's pid once the middle child has exited."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        code = exitcodes.OK
        try:
            os.close(read_end)
            middle_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(write_end)
                code = exitcodes.FAILURE
                code = become_slot(control, spec, app, order, fds, middle_pid)
            else:
                os.write(write_end, str(pid).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read(32)
    os.waitpid(middle, 0)
    return int(text) if text.isdigit() else 0


def become_slot(control: socket.socket, spec: TemplateSpec, app: object,
                order: ForkSlot, fds: list[int], middle_pid: int) -> int:
    """In the grandchild: wait to be the master's child, then run the slot."""
    from qcluster.app import App
    from qcluster.master.effects import become_slot as become
    from qcluster.slot.runtime import run_slot

    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while (parent := os.getppid()) != spec.master_pid:
        # One read per check: the middle child exits meanwhile, and a second read could
        # see the master already, which is neither the middle child nor gone.
        if parent != middle_pid or time.monotonic() > deadline:
            logger.error("slot %d (%s): its parent is pid %d, not the master (pid %d): "
                         "the master is gone", order.slot_no, order.queue, parent,
                         spec.master_pid)
            return exitcodes.FAILURE
        time.sleep(0.0005)
    assert isinstance(app, App)

    def run() -> int:
        channel: Channel[MasterToSlot] = Channel(socket.socket(fileno=fds[0]), MASTER_TO_SLOT)
        if len(fds) > 1:  # (none: the master has no memfd, this slot's take is not followed)
            channel.progress = TakeProgress(fds[1])  # mmap keeps its own copy of the fd
            os.close(fds[1])
        return run_slot(app, order.queue, broker_url=spec.broker_url,
                        state_dir=Path(spec.state_dir), channel=channel, slot_no=order.slot_no)

    return become(spec.master_pid, order.queue, order.slot_no, control.close, run)


class Template(Protocol):
    """What the master uses of a template (TemplateHandle; the tests' fakes)."""

    pid: int
    sock: socket.socket
    answer: Ready | Failed | None
    ended: bool
    reaped: bool

    def poll(self) -> Ready | Failed | None: ...

    def fork_slot(self, queue: str, slot_no: int, channel_fd: int,
                  progress_fd: int | None, *, tend: Tend | None = None) -> int | None: ...

    def end(self) -> None: ...


class TemplateHandle:
    """The master's end of one template process: spawn it, read its answer without
    blocking the loop, ask it for slots (a short synchronous exchange, during which what
    the loop must not put off still runs: ``tend``), end it."""

    def __init__(self, spec: TemplateSpec) -> None:
        master_end, template_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        os.set_inheritable(template_end.fileno(), True)
        args = [sys.executable, "-m", "qcluster.master.template", str(template_end.fileno())]
        try:
            # posix_spawn, not subprocess: the master reaps every child itself
            # (waitpid(-1)), and a Popen object would race it for this one's status.
            self.pid = os.posix_spawn(sys.executable, args, dict(os.environ))
        except OSError:
            master_end.close()  # (no process: nothing left open behind)
            raise
        finally:
            template_end.close()  # (before sending: a template that dies is then seen)
        try:
            send_parts(master_end, spec.model_dump_json().encode())  # read first
        except OSError:
            master_end.close()  # it died at once (it is reaped as any other child)
            raise
        master_end.setblocking(False)
        self.sock = master_end
        self._answer_parts = PartsReader()
        self.answer: Ready | Failed | None = None
        self.ended = False
        self.reaped = False
        """The master has waited for it: its pid may be another process's now."""

    def poll(self) -> Ready | Failed | None:
        """Its answer once it came (a closed socket before it: Failed)."""
        if self.answer is not None or self.ended:
            return self.answer
        try:
            packet = self._answer_parts.read(self.sock)  # several packets: see send_parts
        except BlockingIOError:
            return None
        except (OSError, ValueError) as exc:
            packet, self.answer = b"", Failed(error=f"template unreachable: {one_line(exc)}")
        if not packet:
            self.answer = self.answer or Failed(error=EXITED_EARLY)
            return self.answer
        try:
            reply = REPLY.validate_json(packet)
        except ValueError as exc:
            reply = Failed(error=f"the template's answer is not readable: {one_line(exc)}")
        self.answer = reply if isinstance(reply, Ready | Failed) else None
        return self.answer

    def fork_slot(self, queue: str, slot_no: int, channel_fd: int, progress_fd: int | None,
                  *, tend: Tend | None = None, timeout_s: float = FORK_TIMEOUT_S) -> int | None:
        """The new slot's pid (the template forked it; it is the master's child), or None
        when the template did not answer within ``timeout_s``. ``tend`` runs whenever it
        is due meanwhile: a stalled template (stopped, swapping) delays no hung slot's kill."""
        if self.ended:
            return None
        try:
            self.sock.settimeout(timeout_s)
            fds = [channel_fd] if progress_fd is None else [channel_fd, progress_fd]
            send_with_fds(self.sock, ForkSlot(queue=queue, slot_no=slot_no), fds)
            packet = self._reply(time.monotonic() + timeout_s, tend)
            reply = REPLY.validate_json(packet) if packet else None
        except (OSError, ValueError) as exc:
            # A template that cannot fork in time is of no use: it is killed, and the
            # master starts another when it reaps this one (reload.Reloader).
            logger.error("reload template pid %d did not fork a slot: %s", self.pid,
                         exc or "no answer")
            if not self.reaped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
            reply = None
        finally:
            with contextlib.suppress(OSError):
                self.sock.setblocking(False)
        return reply.pid or None if isinstance(reply, Forked) else None

    def _reply(self, deadline: float, tend: Tend | None) -> bytes:
        """The template's next packet, by ``deadline`` (TimeoutError), waiting in steps
        that end when ``tend`` is due."""
        while True:
            due = tend() if tend is not None else None
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"no answer within {FORK_TIMEOUT_S:g} s")
            wait = deadline - now if due is None else min(deadline, due) - now
            self.sock.settimeout(max(wait, 0.001))
            with contextlib.suppress(TimeoutError):
                return self.sock.recv(MAX_PACKET_BYTES)

    def end(self) -> None:
        """SIGKILL it (it holds nothing: its slots are the master's children)."""
        if not self.ended:
            self.ended = True
            self.sock.close()
            if not self.reaped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The master's supervisor pinned as a component, driven without processes: fork, kill
and waitpid are fakes, the clock is a number the test moves, the probe returns what the
test sets, and each slot's end of its control channel stays with the test, which speaks
for the slot.

The tests below only use the harness's verbs (``step``, ``signal``, ``say``, ``exit``,
``signals_to``...), so they pin what the supervisor does, not how it is built: they were
written against the single-class supervisor and pass unchanged on the split one.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster import App, Job, exitcodes
from qcluster.channel import Channel, slot_channel_pair
from qcluster.config import MasterSettings, load_settings
from qcluster.master.capacity import HostSample
from qcluster.messages import (
    BatchCounters,
    BatchDone,
    BatchStarted,
    MasterToSlot,
    SlotHello,
    SlotToMaster,
)
from qcluster.procfs import MemorySample

MIB = 1 << 20
WALL_OFFSET = 1_700_000_000.0


def make_app(*queues: str, **policy: Any) -> App:
    app = App("component")
    for name in queues:
        def handler(jobs: list[Job]) -> None:
            pass
        app.queue(name, **policy)(handler)
    return app


class _KeptEnd:
    """The slot end the supervisor closes after fork: the test keeps it open."""

    def __init__(self, channel: Channel[MasterToSlot]) -> None:
        self.channel = channel

    def close(self) -> None:
        pass

    def fileno(self) -> int:
        return self.channel.fileno()


@dataclass
class FakeOS:
    next_pid: int = 1000
    forks: list[int] = field(default_factory=list)
    kills: list[tuple[int, int]] = field(default_factory=list)
    exits: list[tuple[int, int]] = field(default_factory=list)
    """(pid, wait status) the next waitpid calls return, in order."""
    alive: set[int] = field(default_factory=set)

    def fork(self) -> int:
        self.next_pid += 1
        self.forks.append(self.next_pid)
        self.alive.add(self.next_pid)
        return self.next_pid

    def kill(self, pid: int, signum: int) -> None:
        if pid not in self.alive:
            raise ProcessLookupError(pid)
        self.kills.append((pid, signum))
        if signum == signal.SIGKILL:
            self.end(pid, signal.SIGKILL)  # a signal number is its own wait status

    def end(self, pid: int, status: int) -> None:
        if pid in self.alive:
            self.alive.discard(pid)
            self.exits.append((pid, status))

    def waitpid(self, pid: int, options: int) -> tuple[int, int]:
        if self.exits:
            return self.exits.pop(0)
        if not self.alive:
            raise ChildProcessError
        if options & os.WNOHANG:
            return 0, 0
        raise AssertionError("a blocking waitpid with no child ending would hang")


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.wall_offset = WALL_OFFSET
        """The wall clock minus the monotonic one (NTP may step it)."""

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.wall_offset + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Harness:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, app: App, row: dict[str, int],
                 **master: Any) -> None:
        self.os = FakeOS()
        self.clock = FakeTime()
        self.dirty: dict[int, int] = {}
        self.ends: dict[int, Channel[MasterToSlot]] = {}
        self._pending_end: Channel[MasterToSlot] | None = None
        self.returned: int | None = None
        monkeypatch.setattr(os, "fork", self._fork)
        monkeypatch.setattr(os, "kill", self.os.kill)
        monkeypatch.setattr(os, "waitpid", self.os.waitpid)
        _patch_everywhere(monkeypatch, "slot_channel_pair", self._pair)
        _patch_everywhere(monkeypatch, "read_slot_memory", self._read_memory)
        _patch_everywhere(monkeypatch, "sample_host", self._sample_host)
        _patch_everywhere(monkeypatch, "time", self.clock)
        monkeypatch.setattr("qcluster.metrics.mark_slot_dead", lambda slot_no: None)
        from qcluster.master.supervisor import Supervisor

        settings = load_settings(None).model_copy(update={"master": MasterSettings(**master)})
        self.sup = Supervisor(app, settings, host_name="h", fixed_row=row,
                              run_slot=_never_called)
        # A SIGHUP reloads: no real template process here (tests that reload set theirs).
        self.sup.reload.spawn = lambda spec: _SilentTemplate()

    # --- the fakes --------------------------------------------------------------

    def _pair(self) -> tuple[Channel[SlotToMaster], Any]:
        master_end, slot_end = slot_channel_pair()
        self._pending_end = slot_end
        return master_end, _KeptEnd(slot_end)

    def _fork(self) -> int:
        pid = self.os.fork()
        assert self._pending_end is not None
        self.ends[pid] = self._pending_end
        self._pending_end = None
        return pid

    def _read_memory(self, pids: Any) -> dict[int, MemorySample]:
        return {pid: MemorySample(pss_bytes=30 * MIB, private_dirty_bytes=self.dirty.get(pid, 0))
                for pid in pids}

    def _sample_host(self, slot_memory: Any) -> HostSample:
        return HostSample(cpus=4.0, load1=0.0, mem_available_bytes=64 << 30,
                          master_pss_bytes=50 * MIB,
                          slot_pss_bytes=tuple(s.pss_bytes for s in slot_memory))

    # --- driving the loop -------------------------------------------------------

    def step(self, advance_s: float = 0.0) -> int | None:
        """Move the clock, then one pass of the loop (signals, messages, reaping, verdicts,
        reconcile). Returns the master's exit code once it has finished."""
        self.clock.now += advance_s
        self.returned = self.sup.step(self.clock.now, block=False)
        self.sup.publish(self.clock.now)  # what the other threads see, as the old tick did
        return self.returned

    def signal(self, signum: int) -> None:
        """What the signal handler does; the loop acts on it at the next step."""
        self.sup.on_signal(signum, None)

    # --- speaking for the slots -------------------------------------------------

    def say(self, pid: int, message: Any) -> None:
        assert self.ends[pid].send(message)

    def hello(self, *pids: int) -> None:
        for pid in pids or self.live_pids():
            self.say(pid, SlotHello(slot_no=self.slot_of(pid)["slot_no"], pid=pid, queue="x"))

    def exit(self, pid: int, code: int) -> None:
        """The slot exits with ``code`` (waitpid's status for an exit)."""
        self.os.end(pid, code << 8)

    def received(self, pid: int) -> list[str]:
        """Kinds of the messages the master sent this slot so far."""
        return [message.kind for message in self.messages(pid)]

    def messages(self, pid: int) -> list[Any]:
        """The messages the master sent this slot since the last look."""
        from qcluster.messages import MASTER_TO_SLOT

        found: list[Any] = []
        sock = self.ends[pid].sock
        while True:
            try:
                packet = sock.recv(65536)
            except BlockingIOError:
                return found
            found.append(MASTER_TO_SLOT.validate_json(packet))

    # --- what the master shows --------------------------------------------------

    def slots(self) -> list[Any]:
        return list(self.sup.snapshot.slots)

    def slot_of(self, pid: int) -> dict[str, Any]:
        return next(s.model_dump() for s in self.slots() if s.pid == pid)

    def live_pids(self) -> list[int]:
        return [s.pid for s in self.slots()]

    def states(self) -> dict[int, str]:
        return {s.pid: s.state for s in self.slots()}

    def restarts(self) -> dict[tuple[str, str], int]:
        return dict(self.sup.snapshot.restarts)

    def signals_to(self, pid: int) -> list[int]:
        return [sig for p, sig in self.os.kills if p == pid]

    def close(self) -> None:
        for end in self.ends.values():
            end.close()


def _patch_everywhere(monkeypatch: pytest.MonkeyPatch, name: str, value: Any) -> None:
    """Replace ``name`` in every master module that imported it (wherever the code lives)."""
    import qcluster.master.supervisor  # noqa: F401  (loads the modules it uses)

    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("qcluster.master.") and hasattr(module, name):
            monkeypatch.setattr(module, name, value)


def _never_called(*args: Any, **kwargs: Any) -> int:
    raise AssertionError("the fake fork never runs a slot")


def harness(monkeypatch: pytest.MonkeyPatch, app: App, row: dict[str, int],
            **master: Any) -> Iterator[Harness]:
    h = Harness(monkeypatch, app, row, **master)
    try:
        yield h
    finally:
        h.close()


# --- the pinned behaviour ----------------------------------------------------------


Q = "work"


@pytest.fixture
def h(monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    yield from harness(monkeypatch, make_app(Q, private_dirty_limit_mb=40.0), {Q: 2})


def started(h: Harness) -> list[int]:
    """Fork the row and let every slot say hello."""
    h.step()
    pids = h.live_pids()
    h.hello(*pids)
    h.step()
    return pids


def busy(h: Harness, pid: int, deadline_in_s: float = 30.0) -> None:
    h.say(pid, BatchStarted(queue=Q, size=1, deadline_mono=h.clock.now + deadline_in_s))


def done(h: Harness, pid: int) -> None:
    h.say(pid, BatchDone(queue=Q, counters=BatchCounters(done=1, batches=1)))


def test_start_forks_the_row_and_slots_turn_idle_on_hello(h: Harness) -> None:
    h.step()
    assert len(h.os.forks) == 2
    assert set(h.states().values()) == {"starting"}
    assert sorted(s.slot_no for s in h.slots()) == [0, 1]
    h.hello()
    h.step()
    assert set(h.states().values()) == {"idle"}
    h.step(5.0)
    assert len(h.os.forks) == 2 and h.os.kills == []


def test_batch_messages_move_a_slot_between_busy_and_idle(h: Harness) -> None:
    first, _ = started(h)
    busy(h, first)
    h.step()
    assert h.states()[first] == "busy"
    done(h, first)
    h.step()
    assert h.states()[first] == "idle"
    assert h.slot_of(first)["jobs_done"] == 1
    assert h.sup.take_counters()[Q].done == 1


def test_crash_restarts_with_doubling_backoff_reset_by_a_completed_batch(h: Harness) -> None:
    started(h)
    delays = []
    for _ in range(3):
        victim = h.live_pids()[0]
        h.exit(victim, 1)
        h.step()
        forks = len(h.os.forks)
        waited = 0.0
        while len(h.os.forks) == forks:
            h.step(0.25)
            waited += 0.25
            assert waited < 120
        delays.append(waited)
    assert delays == [0.5, 1.0, 2.0]
    assert h.restarts() == {(Q, "crash"): 3}
    newest = h.os.forks[-1]
    h.hello(newest)
    done(h, newest)  # a completed batch: the queue is healthy again
    h.step()
    h.exit(newest, 1)
    h.step()
    forks = len(h.os.forks)
    h.step(0.25)
    assert len(h.os.forks) == forks
    h.step(0.25)
    assert len(h.os.forks) == forks + 1


def test_crash_backoff_is_capped_at_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    h = next(harness(monkeypatch, make_app(Q), {Q: 1}, heartbeat_timeout_s=10_000.0))
    started(h)
    for _ in range(9):
        h.exit(h.live_pids()[0], 1)
        h.step()
        forks = len(h.os.forks)
        h.step(60.0)
        assert len(h.os.forks) == forks + 1
    h.exit(h.live_pids()[0], 1)
    h.step()
    forks = len(h.os.forks)
    h.step(59.0)
    assert len(h.os.forks) == forks


def test_a_slot_killed_from_outside_is_a_crash(h: Harness) -> None:
    victim, _ = started(h)
    h.os.end(victim, signal.SIGKILL)
    h.step()
    assert h.restarts() == {(Q, "crash"): 1}
    assert victim not in h.live_pids()


def test_boot_error_is_restarted_after_a_backoff(h: Harness) -> None:
    h.step()
    victim = h.live_pids()[0]
    h.exit(victim, exitcodes.BOOT_ERROR)
    h.step()
    assert sum(h.restarts().values()) == 1
    forks = len(h.os.forks)
    h.step(0.25)
    assert len(h.os.forks) == forks
    h.step(0.25)
    assert len(h.os.forks) == forks + 1


def test_hung_batch_is_killed_at_its_deadline_and_restarted_at_once(h: Harness) -> None:
    victim, other = started(h)
    busy(h, victim, deadline_in_s=2.0)
    h.step()
    h.step(1.9)
    assert h.signals_to(victim) == []
    h.step(0.2)
    assert h.signals_to(victim) == [signal.SIGKILL]
    h.step()
    h.step()
    assert h.restarts() == {(Q, "hung"): 1}
    assert len(h.os.forks) == 3 and victim not in h.live_pids()
    assert h.signals_to(other) == []


def test_a_silent_slot_is_killed_as_hung(h: Harness) -> None:
    quiet, talker = started(h)
    for _ in range(7):
        h.step(5.0)
        h.say(talker, BatchDone(queue=Q, counters=BatchCounters()))
    assert h.signals_to(quiet) == [signal.SIGKILL]
    assert h.signals_to(talker) == []
    h.step()
    h.step()
    assert h.restarts() == {(Q, "hung"): 1}


def test_a_slot_far_over_its_memory_limit_is_killed(h: Harness) -> None:
    fat, lean = started(h)
    h.dirty[fat] = 81 * MIB  # the limit is 40 MiB, the kill factor 2
    h.dirty[lean] = 79 * MIB
    h.step(2.0)
    h.step(2.0)
    assert h.signals_to(fat) == [signal.SIGKILL]
    assert h.signals_to(lean) == []
    h.step()
    assert h.restarts() == {(Q, "memory"): 1}


def test_a_recycled_slot_is_replaced_at_once(h: Harness) -> None:
    old, _ = started(h)
    h.exit(old, exitcodes.RECYCLE)
    h.step()
    h.step()
    assert h.restarts() == {(Q, "recycle"): 1}
    assert len(h.os.forks) == 3 and old not in h.live_pids()


def test_scale_down_stops_a_busy_slot_gracefully_and_does_not_restart_it(h: Harness) -> None:
    first, second = started(h)
    busy(h, first)
    busy(h, second)
    h.step()
    h.sup.set_row({Q: 1})
    h.step()
    assert h.received(second) == ["stop"]
    assert h.signals_to(second) == [signal.SIGTERM]
    assert h.states()[second] == "stopping"
    assert h.received(first) == [] and h.signals_to(first) == []
    h.exit(second, exitcodes.OK)
    h.step()
    h.step(5.0)
    assert h.live_pids() == [first]
    assert h.restarts() == {} and len(h.os.forks) == 2


def test_scale_down_stops_an_idle_slot_before_a_busy_one(h: Harness) -> None:
    first, second = started(h)
    busy(h, second)
    h.step()
    h.sup.set_row({Q: 1})
    h.step()
    assert h.signals_to(first) == [signal.SIGTERM]
    assert h.signals_to(second) == []


def test_sigterm_drains_every_slot_then_exits_zero(h: Harness) -> None:
    first, second = started(h)
    busy(h, first)
    h.step()
    h.signal(signal.SIGTERM)
    h.step()
    for pid in (first, second):
        assert h.received(pid) == ["stop"]
        assert h.signals_to(pid) == [signal.SIGTERM]
    h.exit(second, exitcodes.OK)
    h.step(1.0)
    assert h.returned is None
    h.exit(first, exitcodes.OK)
    h.step()
    h.step()
    assert h.returned == exitcodes.OK
    assert len(h.os.forks) == 2 and h.restarts() == {}


def test_sigterm_kills_what_is_left_after_the_graceful_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = next(harness(monkeypatch, make_app(Q), {Q: 2}, heartbeat_timeout_s=10_000.0))
    first, second = started(h)
    h.signal(signal.SIGTERM)
    h.step()
    h.step(59.0)
    assert signal.SIGKILL not in h.signals_to(first)
    h.step(2.0)
    h.step()
    h.step()
    assert h.signals_to(first) == [signal.SIGTERM, signal.SIGKILL]
    assert h.signals_to(second) == [signal.SIGTERM, signal.SIGKILL]
    assert h.returned == exitcodes.OK


def test_second_sigint_kills_every_slot_now(h: Harness) -> None:
    first, second = started(h)
    h.signal(signal.SIGINT)
    h.step()
    h.signal(signal.SIGINT)
    h.step()
    h.step()
    assert h.signals_to(first) == [signal.SIGTERM, signal.SIGKILL]
    assert h.signals_to(second) == [signal.SIGTERM, signal.SIGKILL]
    assert h.returned == exitcodes.OK
    assert len(h.os.forks) == 2


def test_sighup_starts_a_reload_and_stops_nothing(h: Harness) -> None:
    """SIGHUP reloads the code (tests/unit/test_master_reload_component.py): the new
    code is imported in a fresh template process while every slot keeps running."""
    spawned: list[Any] = []
    def spawn(spec: Any) -> Any:
        spawned.append(spec)
        return _SilentTemplate()

    h.sup.reload.spawn = spawn
    started(h)
    h.signal(signal.SIGHUP)
    h.step()
    h.step(1.0)
    assert [spec.row for spec in spawned] == [[Q]]
    assert h.sup.snapshot.code.state == "loading"
    assert h.os.kills == [] and h.returned is None
    assert set(h.states().values()) == {"idle"}


class _SilentTemplate:
    """A template that never answers (no process: SIGHUP in these tests only loads)."""

    def __init__(self) -> None:
        import socket

        from qcluster.master.template import Failed, Ready

        self.pid = 99_999
        self.answer: Ready | Failed | None = None
        self.ended = False
        self.reaped = False
        self.sock, self._other = socket.socketpair()

    def poll(self) -> None:
        return None

    def fork_slot(self, queue: str, slot_no: int, channel_fd: int,
                  progress_fd: int | None, *, tend: Any = None) -> int | None:
        raise AssertionError("a template that never answered forks nothing")

    def end(self) -> None:
        self.ended = True
        self.sock.close()
        self._other.close()


# --- added with the split: the fatal state, queued signals, monotonic durations -------


def test_boot_errors_in_a_row_make_the_queue_fatal_and_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from qcluster.master.http import host_json
    from qcluster.master.slots import BOOT_ERROR_LIMIT

    app = make_app(Q, "other")
    h = next(harness(monkeypatch, app, {Q: 1, "other": 1}, heartbeat_timeout_s=10_000.0))
    h.step()
    for _ in range(BOOT_ERROR_LIMIT):
        victim = next(s.pid for s in h.slots() if s.queue == Q)
        h.exit(victim, exitcodes.BOOT_ERROR)
        h.step()
        h.step(60.0)
    assert h.restarts() == {(Q, "boot_error"): BOOT_ERROR_LIMIT}
    assert [s.queue for s in h.slots()] == ["other"]  # the other queue runs on
    forks = len(h.os.forks)
    h.step(600.0)
    assert len(h.os.forks) == forks
    assert "boot errors in a row" in h.sup.snapshot.fatal[Q]
    assert host_json(h.sup.snapshot)["fatal"] == h.sup.snapshot.fatal
    assert f"queue {Q} is fatal" in caplog.text


def test_a_slot_that_boots_between_boot_errors_keeps_its_queue_alive(h: Harness) -> None:
    from qcluster.master.slots import BOOT_ERROR_LIMIT

    h.step()
    for _ in range(2 * BOOT_ERROR_LIMIT):
        victim = h.live_pids()[0]
        h.hello(victim)
        h.step()
        h.exit(victim, exitcodes.BOOT_ERROR)
        h.step()
        h.step(60.0)
        h.hello()
        h.step()
    assert h.sup.snapshot.fatal == {}
    assert len(h.live_pids()) == 2


def test_the_signal_handler_only_queues(h: Harness) -> None:
    """NO LOGGING and no kill in the handler: the loop acts at its next pass."""
    first, _ = started(h)
    h.signal(signal.SIGTERM)
    h.signal(signal.SIGINT)
    assert h.os.kills == [] and h.received(first) == []
    h.step()
    assert h.signals_to(first) == [signal.SIGTERM, signal.SIGKILL]


def test_alive_seconds_come_from_the_monotonic_clock(h: Harness) -> None:
    """A wall clock stepped back (NTP) made alive_s negative: the report failed validation
    and the reporter thread died. Regression: it failed on the reporter before."""
    from qcluster.master.reporter import build_report

    started(h)
    h.step(5.0)
    h.clock.wall_offset -= 3600.0
    report = build_report(h.sup, 2.0, 0)
    assert report.counters[Q].alive_s == 4.0
    h.clock.wall_offset += 7200.0
    assert build_report(h.sup, 2.0, 0).counters[Q].alive_s == 4.0


def test_past_the_graceful_timeout_the_loop_does_not_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slot that outlives its SIGKILL (stuck in the kernel) must not make the loop wake
    at once forever because the stop deadline has passed."""
    h = next(harness(monkeypatch, make_app(Q), {Q: 1}, heartbeat_timeout_s=10_000.0))
    started(h)
    h.signal(signal.SIGTERM)
    h.step()
    monkeypatch.setattr(os, "kill", lambda pid, signum: h.os.kills.append((pid, signum)))
    h.step(61.0)
    h.step()
    assert h.returned is None and h.live_pids()
    assert h.sup._wake_in(h.clock.now) > 0.0


def test_a_pass_with_only_slot_messages_decides_nothing_until_the_tick(h: Harness) -> None:
    """Two messages per batch: deciding (O(slots)) on each one cost the loop a core at a
    high batch rate; the messages are applied, the decision waits for its tick."""
    first, _ = started(h)
    snapshot = h.sup.snapshot
    busy(h, first)
    assert h.sup.step(h.clock.now, block=False) is None
    assert h.sup.snapshot is snapshot
    h.clock.now += 1.0
    h.sup.step(h.clock.now, block=False)
    assert h.states()[first] == "busy"


# --- properties of the whole loop ---------------------------------------------------

EVENTS = st.lists(st.one_of(
    st.tuples(st.just("exit"), st.integers(0, 3),
              st.sampled_from([0, 1, exitcodes.BOOT_ERROR, exitcodes.RECYCLE, -9])),
    st.tuples(st.sampled_from(["hello", "busy", "done"]), st.integers(0, 3)),
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.3, 1.0, 5.0, 61.0])),
    st.tuples(st.just("row"), st.integers(0, 3)),
    st.tuples(st.just("signal"), st.sampled_from([signal.SIGTERM, signal.SIGINT,
                                                  signal.SIGHUP])),
), max_size=40)


@settings(max_examples=60, deadline=None)
@given(EVENTS)
def test_the_loop_never_runs_more_than_the_row_nor_forks_after_a_stop(
    events: list[tuple[Any, ...]]
) -> None:
    from qcluster.master.slots import RESTART_REASONS

    with pytest.MonkeyPatch.context() as monkeypatch:
        h = Harness(monkeypatch, make_app(Q), {Q: 2})
        try:
            row, stopped_at_fork = 2, None
            h.step()
            for event in events:
                pids = h.live_pids()
                pid = pids[event[1] % len(pids)] if pids and event[0] != "advance" else None
                if event[0] == "exit" and pid is not None:
                    h.os.end(pid, signal.SIGKILL if event[2] < 0 else event[2] << 8)
                elif event[0] == "hello" and pid is not None:
                    h.hello(pid)
                elif event[0] == "busy" and pid is not None:
                    busy(h, pid)
                elif event[0] == "done" and pid is not None:
                    done(h, pid)
                elif event[0] == "advance":
                    h.clock.now += event[1]
                elif event[0] == "row":
                    row = event[1]
                    h.sup.set_row({Q: row})
                elif event[0] == "signal":
                    h.signal(event[1])
                    if event[1] != signal.SIGHUP and stopped_at_fork is None:
                        stopped_at_fork = len(h.os.forks)
                h.step()
                active = [s for s in h.slots() if s.state != "stopping"]
                assert len(active) <= row
                if stopped_at_fork is not None:
                    assert len(h.os.forks) == stopped_at_fork  # nothing forked once stopping
                assert {reason for _, reason in h.restarts()} <= set(RESTART_REASONS)
                assert len(set(h.os.forks)) == len(h.os.forks)
                if h.returned is not None:
                    assert h.returned == exitcodes.OK and h.live_pids() == []
                    break
        finally:
            h.close()

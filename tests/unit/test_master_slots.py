"""The master's pure parts: the slot state machine, exit decoding, restart backoff up to
the fatal state, the watch verdicts and the wake-up time. Table tests, then properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster import exitcodes
from qcluster.master.slots import (
    BACKOFF_MAX_S,
    BOOT_ERROR_LIMIT,
    RestartBackoff,
    SlotRecord,
    decode_exit,
    on_message,
)
from qcluster.master.watch import WatchLimits, next_deadline, verdict, wake_in
from qcluster.messages import (
    BatchCounters,
    BatchDone,
    BatchStarted,
    Heartbeat,
    Recycling,
    SlotHello,
)

Q = "q"
LIMITS = WatchLimits(heartbeat_timeout_s=30.0, memory_kill_factor=2.0)
KILL_BYTES = 80.0


def slot(state: str = "idle", **fields: object) -> SlotRecord:
    record = SlotRecord(slot_no=0, pid=10, queue=Q, started_at=1e9, started_mono=0.0,
                        last_seen=0.0)
    record.state = state  # type: ignore[assignment]
    for name, value in fields.items():
        setattr(record, name, value)
    return record


HELLO = SlotHello(slot_no=0, pid=10, queue=Q)
STARTED = BatchStarted(queue=Q, size=1, deadline_mono=5.0)
DONE = BatchDone(queue=Q, counters=BatchCounters(done=2, retried=1, batches=1))
BEAT_IDLE = Heartbeat(queue=Q, idle=True)
BEAT_BUSY = Heartbeat(queue=Q, idle=False)
RECYCLING = Recycling(private_dirty_bytes=7, limit_bytes=5)


# --- transitions ------------------------------------------------------------------


@pytest.mark.parametrize(("state", "message", "after"), [
    ("starting", HELLO, "idle"),
    ("starting", BEAT_IDLE, "idle"),
    ("starting", BEAT_BUSY, "starting"),
    ("idle", STARTED, "busy"),
    ("busy", DONE, "idle"),
    ("busy", BEAT_BUSY, "busy"),
    ("busy", BEAT_IDLE, "idle"),
    ("busy", RECYCLING, "busy"),
    ("stopping", STARTED, "stopping"),
    ("stopping", DONE, "stopping"),
    ("stopping", HELLO, "stopping"),
    ("stopping", BEAT_IDLE, "stopping"),
])
def test_message_moves_the_state(state: str, message: object, after: str) -> None:
    record = slot(state)
    on_message(record, message, now=3.0)  # type: ignore[arg-type]
    assert record.state == after
    assert record.last_seen == 3.0


def test_batch_messages_set_and_clear_the_deadline_and_count_jobs() -> None:
    record = slot("idle")
    on_message(record, STARTED, 1.0)
    assert record.deadline == 5.0
    assert on_message(record, DONE, 2.0) == DONE.counters
    assert record.deadline is None and record.jobs_done == 3
    on_message(record, RECYCLING, 2.0)
    assert record.private_dirty_bytes == 7
    on_message(record, Heartbeat(queue="other", idle=False), 2.0)
    assert record.queue == "other"


# --- exit decoding ----------------------------------------------------------------


@pytest.mark.parametrize(("kill_reason", "state", "code", "master_stopping", "reason"), [
    (None, "idle", exitcodes.OK, False, None),
    (None, "idle", exitcodes.FAILURE, False, "crash"),
    (None, "busy", -9, False, "crash"),  # killed from outside
    (None, "starting", exitcodes.BOOT_ERROR, False, "boot_error"),
    (None, "starting", exitcodes.APP_IMPORT, False, "boot_error"),
    (None, "starting", exitcodes.BROKER_CONNECT, False, "crash"),  # the broker may return
    (None, "busy", exitcodes.RECYCLE, False, "recycle"),
    (None, "busy", exitcodes.RECYCLE, True, "recycle"),
    (None, "stopping", exitcodes.OK, False, None),
    (None, "stopping", -15, False, None),  # SIGTERM while it boots (before its handler)
    (None, "starting", -15, False, "crash"),  # not told to stop: killed from outside
    (None, "stopping", exitcodes.FAILURE, False, "crash"),
    (None, "stopping", exitcodes.FAILURE, True, None),
    (None, "busy", -9, True, None),
    ("hung", "busy", -9, False, "hung"),
    ("hung", "stopping", -9, True, "hung"),
    ("memory", "idle", -9, False, "memory"),
])
def test_exit_decoding(kill_reason: str | None, state: str, code: int,
                       master_stopping: bool, reason: str | None) -> None:
    record = slot(state, kill_reason=kill_reason)
    assert decode_exit(record, code, master_stopping=master_stopping) == reason


# --- restart backoff and the fatal state ------------------------------------------


def test_crash_backoff_doubles_and_is_capped() -> None:
    backoff = RestartBackoff()
    delays = []
    for _ in range(10):
        backoff.on_restart(Q, "crash", now=0.0)
        delays.append(backoff.fork_after[Q])
    assert delays[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert delays[-1] == BACKOFF_MAX_S
    assert Q not in backoff.fatal  # crashes never make a queue fatal


@pytest.mark.parametrize("reason", ["recycle", "memory", "hung"])
def test_planned_restarts_have_no_backoff(reason: str) -> None:
    backoff = RestartBackoff()
    assert backoff.on_restart(Q, reason, now=10.0) is None  # type: ignore[arg-type]
    assert backoff.may_fork(Q, 10.0)
    assert backoff.next_fork_at(10.0) is None


def test_boot_errors_in_a_row_make_the_queue_fatal_once() -> None:
    backoff = RestartBackoff()
    messages = [backoff.on_restart(Q, "boot_error", now=0.0) for _ in range(BOOT_ERROR_LIMIT)]
    assert messages[:-1] == [None] * (BOOT_ERROR_LIMIT - 1)
    assert messages[-1] is not None and "boot errors in a row" in messages[-1]
    assert backoff.fatal == {Q: messages[-1]}
    assert not backoff.may_fork(Q, 1e9)
    assert backoff.next_fork_at(0.0) is None  # nothing to wake for
    assert backoff.on_restart(Q, "boot_error", now=0.0) is None  # reported once


def test_a_slot_that_boots_resets_the_boot_error_count() -> None:
    backoff = RestartBackoff()
    for _ in range(BOOT_ERROR_LIMIT - 1):
        backoff.on_restart(Q, "boot_error", now=0.0)
    backoff.on_booted(Q)
    for _ in range(BOOT_ERROR_LIMIT - 1):
        backoff.on_restart(Q, "boot_error", now=0.0)
    assert backoff.fatal == {}


def test_a_completed_batch_resets_the_backoff() -> None:
    backoff = RestartBackoff()
    for _ in range(4):
        backoff.on_restart(Q, "crash", now=0.0)
    backoff.on_batch_done(Q)
    backoff.on_restart(Q, "crash", now=100.0)
    assert backoff.fork_after[Q] == 100.5
    assert not backoff.may_fork(Q, 100.4) and backoff.may_fork(Q, 100.5)
    assert backoff.next_fork_at(100.0) == 100.5


# --- watch verdicts ---------------------------------------------------------------


@pytest.mark.parametrize(("fields", "now", "expected"), [
    ({}, 29.0, None),
    ({}, 30.5, "hung"),  # silent past heartbeat_timeout_s
    ({"deadline": 40.0}, 35.0, None),  # in a batch: only its deadline counts
    ({"deadline": 40.0}, 40.0, "hung"),
    ({"private_dirty_bytes": 81}, 1.0, "memory"),
    ({"private_dirty_bytes": 80}, 1.0, None),
    ({"deadline": 1.0, "private_dirty_bytes": 81}, 2.0, "hung"),
    ({"deadline": 1.0, "kill_reason": "hung"}, 2.0, None),  # already being killed
])
def test_watch_verdict(fields: dict[str, object], now: float, expected: str | None) -> None:
    assert verdict(slot("busy", **fields), now, LIMITS, KILL_BYTES) == expected


def test_next_deadline_ignores_slots_being_killed() -> None:
    slots = [slot(deadline=5.0, kill_reason="hung"), slot(deadline=7.0), slot()]
    assert next_deadline(slots) == 7.0
    assert next_deadline([slot()]) is None


@pytest.mark.parametrize(("moments", "expected"), [
    ((), 1.0),
    ((None, None), 1.0),
    ((10.25, None), 0.25),
    ((12.0, 10.5), 0.5),
    ((9.0,), 0.0),  # overdue: no sleep
])
def test_wake_in(moments: tuple[float | None, ...], expected: float) -> None:
    assert wake_in(10.0, moments, 1.0) == expected


# --- properties -------------------------------------------------------------------

MESSAGES = st.sampled_from([HELLO, STARTED, DONE, BEAT_IDLE, BEAT_BUSY, RECYCLING])
STATES = st.sampled_from(["starting", "idle", "busy", "stopping"])


@given(STATES, st.lists(MESSAGES, max_size=30))
def test_messages_keep_a_known_state_and_stopping_is_final(
    state: str, messages: list[object]
) -> None:
    record = slot(state)
    jobs = 0
    for message in messages:
        on_message(record, message, 1.0)  # type: ignore[arg-type]
        assert record.state in ("starting", "idle", "busy", "stopping")
        if state == "stopping":
            assert record.state == "stopping"
        if isinstance(message, BatchDone):
            jobs += message.counters.processed
    assert record.jobs_done == jobs


@given(st.sampled_from([None, "hung", "memory"]), STATES, st.integers(-64, 255), st.booleans())
def test_exit_decoding_properties(
    kill_reason: str | None, state: str, code: int, master_stopping: bool
) -> None:
    reason = decode_exit(slot(state, kill_reason=kill_reason), code,
                         master_stopping=master_stopping)
    if kill_reason is not None:
        assert reason == kill_reason  # the master's own kill is counted as such
    elif code == exitcodes.RECYCLE:
        assert reason == "recycle"
    elif master_stopping or code == exitcodes.OK or (state == "stopping" and code == -15):
        assert reason is None  # nothing is restarted while stopping; a clean exit is not
    else:
        assert reason in ("crash", "boot_error")


@given(st.lists(st.sampled_from(["crash", "boot_error", "hung", "booted", "batch"]),
                max_size=40))
def test_backoff_properties(events: list[str]) -> None:
    backoff = RestartBackoff()
    now, boot_run, became_fatal = 0.0, 0, False
    for event in events:
        now += 1.0
        if event == "booted":
            backoff.on_booted(Q)
            boot_run = 0
        elif event == "batch":
            backoff.on_batch_done(Q)
            boot_run = 0
        else:
            message = backoff.on_restart(Q, event, now)  # type: ignore[arg-type]
            boot_run = boot_run + 1 if event == "boot_error" else boot_run
            assert (message is not None) == (boot_run == BOOT_ERROR_LIMIT and not became_fatal)
            became_fatal = became_fatal or message is not None
            if event != "hung" and not became_fatal:
                wait = backoff.fork_after[Q] - now
                assert backoff.base_s <= wait <= BACKOFF_MAX_S
                assert not backoff.may_fork(Q, now)
                assert backoff.may_fork(Q, backoff.fork_after[Q])
        assert (Q in backoff.fatal) == became_fatal  # fatal is reported, and final


@given(st.lists(st.one_of(st.none(), st.floats(-1e6, 1e6)), max_size=6),
       st.floats(-1e6, 1e6), st.floats(0.0, 100.0))
def test_wake_in_is_never_negative_nor_longer_than_asked(
    moments: list[float | None], now: float, longest: float
) -> None:
    assert 0.0 <= wake_in(now, moments, longest) <= longest


def test_a_stopped_slot_ended_by_sigterm_is_clean() -> None:
    import signal

    from qcluster.master.slots import STOPPED_CODES

    assert -signal.SIGTERM in STOPPED_CODES  # (spelt -15 in the pure module)


@pytest.mark.parametrize(("reason", "deadline", "code", "said"), [
    ("hung", 5.0, -9, "killed: its batch ran past the queue's batch_timeout"),
    ("hung", None, -9, "killed: it sent the master nothing for heartbeat_timeout"),
    ("memory", 5.0, -9, "killed: its private memory grew far over the queue's "
                        "private_dirty_limit_mb"),
    ("crash", 5.0, 70, "it exited with 70"),
    ("crash", 5.0, -11, "it was killed by signal 11"),
])
def test_a_slot_that_died_holding_jobs_is_described_for_their_last_error(
        reason: str, deadline: float | None, code: int, said: str) -> None:
    from qcluster.master.slots import death

    assert death(slot("busy", deadline=deadline), reason, code) == said  # type: ignore[arg-type]

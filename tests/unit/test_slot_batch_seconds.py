"""A slot reports each batch's seconds beside its handler's, so what a batch costs beyond
its handler (decoding, the broker's round trip when the slot went straight on) is
measured, not fitted by the simulator's replay; the time a slot waited for jobs is not."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from qcluster import App, Job
from qcluster.job import Delivery, LockToken
from qcluster.messages import BatchCounters, BatchDone
from tests.unit.recording_channel import RecordingChannel

DECODE_S = 0.02
HANDLER_S = 0.03


def _delivery(job_id: str) -> Delivery:
    body = (b'{"v":1,"id":"' + job_id.encode() + b'","queue":"q","payload":null,'
            b'"enqueued_at":1.0}')
    return Delivery(job_id, body, 1, 1.0, 2.0, "application/json", LockToken(9))


class _OneTake:
    """A broker holding one take's jobs: the first take gets them, the next none."""

    settles_for_others = False

    def __init__(self, deliveries: list[Delivery]) -> None:
        self.deliveries = deliveries

    def settle_and_take(self, *args: object, **kwargs: object) -> list[Delivery]:
        taken, self.deliveries = self.deliveries, []
        return taken

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None  # settle, leave, close: nothing to do


def test_a_batch_reports_its_seconds_beyond_the_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two batches of 2 jobs, each decoded in 20 ms and handled in 30 ms: each reports
    its handler's 30 ms as busy_s and at least 50 ms as batch_s (0 before the field)."""
    from qcluster.slot import runtime

    app = App()

    @app.queue("q", batch_size=2)
    def handle(jobs: list[Job]) -> None:
        time.sleep(HANDLER_S)

    real_decode = runtime.decode_batch

    def slow_decode(deliveries: Sequence[Delivery], policy: object) -> object:
        time.sleep(DECODE_S)
        return real_decode(deliveries, policy)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime, "decode_batch", slow_decode)
    channel = RecordingChannel()
    broker = _OneTake([_delivery(f"j{n}") for n in range(4)])
    runner = runtime.SlotRunner(app, "q", broker, channel=channel,  # type: ignore[arg-type]
                                slot_no=1)
    assert runner.step(defer_settle=True)
    done = [m.counters for m in channel.sent if isinstance(m, BatchDone)]
    assert [c.batches for c in done] == [1, 1]
    for counters in done:
        assert HANDLER_S <= counters.busy_s < counters.batch_s
        assert counters.batch_s - counters.busy_s >= DECODE_S
    total = done[0] + done[1]  # the master sums them per queue
    assert total.batch_s == pytest.approx(done[0].batch_s + done[1].batch_s)


class _Takes:
    """A broker whose round trip takes ``ROUND_TRIP_S``, handing out one take a call."""

    settles_for_others = False

    def __init__(self, takes: list[list[Delivery]]) -> None:
        self.takes = takes

    def settle_and_take(self, *args: object, **kwargs: object) -> list[Delivery]:
        time.sleep(ROUND_TRIP_S)
        return self.takes.pop(0) if self.takes else []

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None


ROUND_TRIP_S = 0.04


def _taken(n: int, ready_before_s: float) -> list[Delivery]:
    """``n`` jobs taken now, on the broker's clock, ready ``ready_before_s`` before."""
    now = time.time()
    return [Delivery(f"j{k}", _delivery(f"j{k}").body, 1, now - ready_before_s, now,
                     "application/json", LockToken(9)) for k in range(n)]


def test_a_take_the_slot_went_straight_to_counts_its_round_trip(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second take's jobs were ready long before the first batch ended: the slot did
    not wait for them, and the round trip that settled the first batch and took them
    (40 ms) is the second batch's. The third take's jobs came 1 ms before it returned,
    after the last batch ended: the slot may have waited for them, so its round trip is
    not counted (idle time is no batch's cost)."""
    from qcluster.slot import runtime

    app = App()

    @app.queue("q", batch_size=2)
    def handle(jobs: list[Job]) -> None:
        time.sleep(0.005)

    channel = RecordingChannel()
    broker = _Takes([])
    runner = runtime.SlotRunner(app, "q", broker, channel=channel,  # type: ignore[arg-type]
                                slot_no=1)
    for ready_before_s in (60.0, 60.0, 0.001):
        broker.takes.append(_taken(2, ready_before_s))
        assert runner.step(defer_settle=True)
    first, straight, waited = [m.counters for m in channel.sent if isinstance(m, BatchDone)]
    assert first.batch_s - first.busy_s < ROUND_TRIP_S  # the first: from the take's return
    assert straight.batch_s - straight.busy_s >= ROUND_TRIP_S
    assert waited.batch_s - waited.busy_s < ROUND_TRIP_S


def test_a_report_without_batch_seconds_still_validates() -> None:
    """A slot or master older than the field sends none: 0, not an error."""
    old = BatchCounters.model_validate({"done": 3, "batches": 1, "busy_s": 0.5})
    assert old.batch_s == 0.0
    assert (old + BatchCounters(batches=1, busy_s=0.1, batch_s=0.2)).batch_s == 0.2

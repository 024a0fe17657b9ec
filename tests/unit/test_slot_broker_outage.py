"""What a slot logs while its broker fails: the first failure, a reminder a minute (or a
different error at once), and one line when the broker answers again. Each slot used to
log every attempt, one a second, and nothing at the end of the outage."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.slot.broker_outage import REMIND_EVERY_S, BrokerOutage
from tests.unit.recording_channel import RecordingChannel


@given(st.lists(st.tuples(st.floats(0.0, 30.0), st.sampled_from(["refused", "timeout"])),
                min_size=1, max_size=200))
def test_a_run_of_failures_logs_its_first_each_change_and_a_line_a_minute(
        failures: list[tuple[float, str]]) -> None:
    outage, now, lines, changes = BrokerOutage(), 1000.0, 0, 0
    previous = None
    for gap, error in failures:
        now += gap
        changes += previous is not None and error != previous
        previous = error
        lines += outage.failed(error, now) is not None
    span = max(0.0, now - 1000.0 - failures[0][0])  # from the first failure
    assert 1 <= lines <= 1 + changes + span // REMIND_EVERY_S
    answered = outage.answered(now + 1)
    assert answered is not None and f"after {len(failures)} failed attempts" in answered
    assert outage.answered(now + 2) is None  # once per outage
    assert outage.failed("refused", now + 3) is not None  # a new outage is said again


class _FlakyBroker:
    """Unreachable for its first ``failures`` calls, then empty; stops the slot after."""

    def __init__(self, runner_box: list[object], failures: int) -> None:
        self.runner_box, self.failures, self.calls = runner_box, failures, 0

    def settle_and_take(self, *args: object, **kwargs: object) -> list[object]:
        from qcluster.errors import BrokerUnavailable

        self.calls += 1
        if self.calls <= self.failures:
            raise BrokerUnavailable("Redis at redis://h:6379/0 unreachable: connection refused")
        self.runner_box[0].should_stop = True  # type: ignore[attr-defined]
        return []

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: None  # leave, close, settle: nothing to do


def test_a_slot_logs_an_outage_once_and_its_end(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from qcluster import App, Job
    from qcluster.slot import runtime

    app = App()

    @app.queue("q")
    def handle(jobs: list[Job]) -> None:
        pass

    monkeypatch.setattr(runtime, "BROKER_ERROR_PAUSE_S", 0.0)
    box: list[object] = []
    runner = runtime.SlotRunner(app, "q", _FlakyBroker(box, 20),  # type: ignore[arg-type]
                                channel=RecordingChannel(), slot_no=1)  # type: ignore[arg-type]
    box.append(runner)
    with caplog.at_level(logging.INFO, logger="qcluster.slot.runtime"):
        assert runner._loop() == 0
    said = [r.getMessage() for r in caplog.records if r.name == "qcluster.slot.runtime"]
    assert [line for line in said if "broker" in line] == [
        "slot 1 on q: broker error: Redis at redis://h:6379/0 unreachable: connection refused "
        "(trying again every second; logged once a minute)",
        "slot 1 on q: broker answers again after 20 failed attempts in 0 s"]

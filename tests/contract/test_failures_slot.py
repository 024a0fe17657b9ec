"""A slot's failure path on a real broker: each exception logged with its traceback and
what happens next, the last error handed to the broker with the settlement, the failure
hooks called with every outcome (and never able to lose a job or run it twice), async
batches past their deadline settled as timed out whatever the handler does with the
cancel, and dead-letter reasons in a user's words."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from qcluster import App, Client, Job
from qcluster.broker import Settlement, open_broker
from qcluster.hooks import Failure
from qcluster.messages import Heartbeat
from qcluster.slot.runtime import SlotRunner
from tests.contract.test_async_outcomes import make_runner, run_until, settled

FAST = {"retry_base_delay": 0.05, "retry_max_delay": 0.05}


class Boom(Exception):
    pass


def _settlements(runner: SlotRunner) -> list[Settlement]:
    """Every settlement the runner hands its broker (the broker still does the work)."""
    seen: list[Settlement] = []
    broker = runner.broker
    settle, settle_and_take = broker.settle, broker.settle_and_take

    def spy_settle(queue: str, settlement: Settlement) -> None:
        seen.append(settlement)
        settle(queue, settlement)

    def spy_take(queue: str, settlement: Settlement, **kwargs: object) -> object:
        seen.append(settlement)
        return settle_and_take(queue, settlement, **kwargs)  # type: ignore[arg-type]

    broker.settle = spy_settle  # type: ignore[method-assign]
    broker.settle_and_take = spy_take  # type: ignore[method-assign,assignment]
    return seen


def test_each_exception_is_logged_with_its_traceback_and_next_step_and_kept_with_the_job(
    broker_url: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = App()
    outcomes: list[tuple[str, str, int]] = []

    @app.queue(queue_name, batch_size=1, max_attempts=2, **FAST)
    def handle(jobs: list[Job]) -> None:
        raise Boom(f"no luck with {jobs[0].payload}")

    @app.on_failure
    def hook(failure: Failure) -> None:
        outcomes.append((failure.jobs[0].payload, failure.next, failure.attempt))

    client = Client(broker_url)
    job_id = client.enqueue(queue_name, "x")
    runner = make_runner(app, queue_name, broker_url)
    settlements = _settlements(runner)
    caplog.set_level(logging.WARNING, logger="qcluster.slot.failures")
    run_until(runner, lambda: client.stats(queue_name)["dead"] == 1)
    settled(client, queue_name)
    assert outcomes == [("x", "retry", 1), ("x", "dead", 2)]
    lines = [r.getMessage() for r in caplog.records if r.name == "qcluster.slot.failures"]
    assert len(lines) == 2, lines
    assert f"job {job_id}, attempt 1 of 2, raised" in lines[0]
    assert "Boom: no luck with x; retry at " in lines[0]
    assert "Traceback (most recent call last)" in lines[0] and "in handle" in lines[0]
    assert "dead-lettered: no attempt left (max_attempts 2)" in lines[1]
    errors = [s.errors[job_id] for s in settlements if job_id in s.errors]
    assert [(e.attempt, e.message) for e in errors] == [(1, "no luck with x")] * 1 + [
        (2, "no luck with x")]
    assert errors[0].type.endswith("Boom") and "raise Boom" in errors[0].traceback
    (dead,) = client.dead_jobs(queue_name)
    assert dead.reason == ("attempt 2 of 2 raised and no attempt is left (max_attempts 2): "
                           "last error Boom: no luck with x")


def test_a_poison_queue_logs_a_few_tracebacks_then_a_summary(
    redis_url: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = App()

    @app.job_queue(queue_name, batch_size=50, max_attempts=1)
    def handle(job: Job) -> None:
        raise Boom("poison")

    client = Client(redis_url)
    client.enqueue_many(queue_name, list(range(40)))
    runner = make_runner(app, queue_name, redis_url)
    caplog.set_level(logging.WARNING, logger="qcluster.slot.failures")
    run_until(runner, lambda: client.stats(queue_name)["dead"] == 40)
    runner.failures.flush()
    lines = [r.getMessage() for r in caplog.records if r.name == "qcluster.slot.failures"]
    full = [line for line in lines if "Traceback" in line]
    summaries = [line for line in lines if "more like it in" in line]
    assert len(full) == 3, lines
    assert len(summaries) == 1 and "... and 37 more like it in " in summaries[0], summaries
    assert "Boom raised at " in summaries[0]


def test_a_hook_that_raises_or_hangs_changes_no_outcome(
    broker_url: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = App()
    runs: list[tuple[str, int]] = []
    release = threading.Event()

    @app.queue(queue_name, batch_size=1, max_attempts=3, lock_timeout=30, **FAST)
    def handle(jobs: list[Job]) -> None:
        runs.append((jobs[0].payload, jobs[0].attempts))
        if jobs[0].attempts < 3:
            raise Boom("again")

    @app.on_failure
    def raises(failure: Failure) -> None:
        raise RuntimeError("the hook itself broke")

    @app.on_failure(timeout=0.2)
    def hangs(failure: Failure) -> None:
        release.wait(60)

    client = Client(broker_url)
    client.enqueue(queue_name, "x")
    runner = make_runner(app, queue_name, broker_url)
    started = time.monotonic()
    try:
        run_until(runner, lambda: ("x", 3) in runs and client.stats(queue_name)["locked"] == 0)
    finally:
        release.set()
    settled(client, queue_name)
    assert runs == [("x", 1), ("x", 2), ("x", 3)], "each attempt ran once"
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 0}
    assert time.monotonic() - started < 30, "a hung hook held the slot up to its lock"
    messages = [r.getMessage() for r in caplog.records]
    assert any("failure hook raises raised (ignored)" in m for m in messages)
    assert any("still running after 0.2 s" in m for m in messages)


def test_job_retry_on_the_last_attempt_says_so_in_the_dead_letter(
    broker_url: str, queue_name: str
) -> None:
    app = App()

    @app.queue(queue_name, batch_size=1, max_attempts=3)
    def handle(jobs: list[Job]) -> None:
        jobs[0].retry(0.01)

    client = Client(broker_url)
    client.enqueue(queue_name, "x")
    runner = make_runner(app, queue_name, broker_url)
    run_until(runner, lambda: client.stats(queue_name)["dead"] == 1)
    (dead,) = client.dead_jobs(queue_name)
    assert dead.reason == ("the handler asked for a retry (job.retry()) on attempt 3 of 3 and "
                           "no attempt is left (max_attempts 3: each retry uses an attempt)")


@pytest.mark.parametrize("per_job", [False, True], ids=["batch", "per-job"])
def test_an_async_handler_that_swallows_the_cancel_is_still_settled_as_timed_out(
    redis_url: str, queue_name: str, per_job: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that catches the deadline's CancelledError and returns: every job it did
    not finish is settled as TimeoutError (here dead: max_attempts 1), and it is logged.
    Before, all were acked and nothing was logged."""
    app = App()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return  # swallowed: the handler returns as if it had finished

    if per_job:
        @app.job_queue(queue_name, batch_size=2, batch_timeout=1.0, max_attempts=1)
        async def each(job: Job) -> None:
            await stubborn()
    else:
        @app.queue(queue_name, batch_size=2, batch_timeout=1.0, max_attempts=1)
        async def batch(jobs: list[Job]) -> None:
            await stubborn()

    client = Client(redis_url)
    client.enqueue_many(queue_name, ["a", "b"])
    runner = make_runner(app, queue_name, redis_url)
    caplog.set_level(logging.WARNING)
    run_until(runner, lambda: client.stats(queue_name)["dead"] == 2, timeout_s=20)
    settled(client, queue_name)
    reasons = [d.reason for d in client.dead_jobs(queue_name)]
    assert all("last error TimeoutError: async batch cancelled after 0.8s" in r
               for r in reasons), reasons
    assert any("async batch of 2 jobs cancelled" in r.getMessage() for r in caplog.records)


class _Master:
    """Stands for the master's end of a slot's channel: writes down what the slot says."""

    def __init__(self) -> None:
        self.said: list[object] = []
        self.closed = False

    def send(self, message: object) -> bool:
        self.said.append(message)
        return True

    def receive(self) -> list[object]:
        return []


def test_a_slow_hook_runs_after_the_settle_and_the_slot_keeps_its_heartbeat_meanwhile(
    broker_url: str, queue_name: str
) -> None:
    """The master judges a slot outside a batch by its heartbeat: a hook that outlasts
    heartbeat_timeout_s must not get the slot killed, and the jobs' outcome must not
    wait for it."""
    app = App()
    client = Client(broker_url)
    master = _Master()
    seen: list[tuple[dict[str, int], int]] = []

    @app.queue(queue_name, batch_size=1, max_attempts=1)
    def handle(jobs: list[Job]) -> None:
        raise Boom("never")

    @app.on_failure(timeout=30)
    def slow(failure: Failure) -> None:
        stats = client.stats(queue_name)  # what the broker holds as the hook starts
        said = len(master.said)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
                isinstance(m, Heartbeat) for m in master.said[said:]):
            time.sleep(0.05)
        seen.append((stats, sum(isinstance(m, Heartbeat) for m in master.said[said:])))

    client.enqueue(queue_name, "x")
    runner = SlotRunner(app, queue_name, open_broker(broker_url),
                        channel=master)  # type: ignore[arg-type]
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:
        runner.step(defer_settle=True)  # as the slot's loop does
    [(stats, heartbeats)] = seen
    assert stats["dead"] == 1 and stats["locked"] == 0, "settled before the hook ran"
    assert heartbeats >= 1, "no heartbeat while the hook ran"
    (dead,) = client.dead_jobs(queue_name)
    assert dead.error is not None and dead.error.message == "never"

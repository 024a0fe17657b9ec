"""The slot's failure path in pieces: tracebacks, bounded metric labels, hook budgets."""

from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from qcluster.hooks import Failure, HookRunner, HookSpec
from qcluster.slot.failure_report import (
    MAX_EXCEPTION_LABELS,
    OTHER_EXCEPTION,
    ExceptionLabels,
    format_traceback,
    raise_site,
    type_name,
)


def _inner() -> None:
    raise KeyError("missing")


def _outer() -> None:
    try:
        _inner()
    except KeyError as exc:
        raise RuntimeError("lookup failed") from exc


def test_a_traceback_names_every_frame_and_the_cause_first() -> None:
    try:
        _outer()
    except RuntimeError as caught:
        exc = caught
    text = format_traceback(exc)
    path, line = raise_site(exc)
    assert text.index("KeyError: 'missing'") < text.index("RuntimeError: lookup failed")
    assert "in _inner" in text and "in _outer" in text and "^^^" not in text
    assert path.endswith("test_failure_report.py") and line > 0
    assert type_name(exc) == "RuntimeError"
    assert format_traceback(ValueError("never raised")) == "ValueError: never raised"


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.text(max_size=120)), max_size=300))
def test_exception_labels_stay_bounded_per_queue(names: list[tuple[str, str]]) -> None:
    labels = ExceptionLabels()
    given_out: dict[str, set[str]] = {}
    for queue, name in names:
        label = labels.label(queue, name)
        assert label in (name[:100], OTHER_EXCEPTION)
        given_out.setdefault(queue, set()).add(label)
    for out in given_out.values():
        assert len(out - {OTHER_EXCEPTION}) <= MAX_EXCEPTION_LABELS


def _failure() -> Failure:
    return Failure(queue="q", jobs=(), exception=ValueError("x"), next="retry",
                   retry_at=None, attempt=1, max_attempts=3, host="h", slot="1")


def test_a_hung_hook_is_waited_for_once_then_skipped_until_it_returns() -> None:
    release, calls, threads = threading.Event(), [], []

    def hangs(failure: Failure) -> None:
        calls.append(failure)
        threads.append(threading.current_thread())
        release.wait(30)

    runner = HookRunner((HookSpec(hangs, timeout_s=0.1),))
    started = time.monotonic()
    runner.call([_failure()], budget_s=10.0)
    runner.call([_failure()], budget_s=10.0)  # still hung: skipped at once
    assert time.monotonic() - started < 5 and len(calls) == 1 and runner.skipped == 1
    release.set()
    # "Returned" means its thread ended, which a busy CPU may delay past any fixed sleep.
    threads[0].join(60)
    assert not threads[0].is_alive()
    runner.call([_failure()], budget_s=10.0)
    assert len(calls) == 2


def test_no_time_left_in_the_lock_calls_no_hook() -> None:
    calls: list[Failure] = []
    runner = HookRunner((HookSpec(calls.append),))
    runner.call([_failure()], budget_s=0.0)
    assert calls == [] and runner.skipped == 1


def test_a_queue_a_host_no_longer_forks_shows_on_its_page_with_why(redis_url: str) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from qcluster.admin_ui.router import install
    from qcluster.broker import open_broker
    from tests.browser.fake_source import FakeSource

    broker = open_broker(redis_url)
    try:
        source = FakeSource(broker, "mail")
        why = "the broker refused it: queue 'mail' exists in RabbitMQ as a classic queue"
        source.hosts[0] = source.hosts[0].model_copy(update={"fatal": {"mail": why}})
        app = FastAPI()
        install(app, source)
        page = TestClient(app).get("/hosts/host-a").text
    finally:
        broker.close()
    assert '<p class="queue-fatal" data-queue="mail"><strong>mail failed here:</strong>' in page
    assert "exists in RabbitMQ as a classic queue" in page


def test_the_caller_hears_now_and_then_while_a_hook_runs() -> None:
    """The slot's heartbeat goes on while it waits for a slow hook (its master judges a
    slot outside a batch by its heartbeat); a hook that returns ends the wait."""
    release = threading.Event()
    calls: list[float] = []

    def slow(failure: Failure) -> None:
        release.wait(30)

    def alive() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            release.set()

    runner = HookRunner((HookSpec(slow, timeout_s=30),))
    runner.call([_failure()], budget_s=30, alive=alive)
    assert len(calls) >= 3 and release.is_set()
    assert runner.skipped == 0

"""Property tests of async handler logic (issue 19 item 3): the concurrent per-job runner
and the deadline that cancels a batch. The loops run in a thread of their own, as in the
slot tests (a test elsewhere may leave a loop running in the main thread)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.app import App, _each_concurrently
from qcluster.job import Job
from qcluster.policy import MAX_DURATION_S
from qcluster.slot.aio import CANCEL_LEAD_MAX_S, _within_deadline, cancel_after_s

BEHAVIOURS = ("return", "raise", "retry", "fail", "hang")


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def make_jobs(count: int) -> list[Job]:
    return [Job(str(n), "q", n, 1, 0.0, 0.0) for n in range(count)]


@given(st.floats(min_value=1e-6, max_value=MAX_DURATION_S))
def test_an_async_batch_is_cancelled_before_the_masters_kill_and_not_much_earlier(
    batch_timeout: float,
) -> None:
    cancel = cancel_after_s(batch_timeout)
    assert 0 < cancel < batch_timeout
    assert batch_timeout - cancel <= CANCEL_LEAD_MAX_S + 1e-9
    if batch_timeout >= 5:
        assert abs(batch_timeout - cancel - CANCEL_LEAD_MAX_S) < 1e-6


@settings(max_examples=60, deadline=None)
@given(behaviours=st.lists(st.sampled_from(BEHAVIOURS[:4]), max_size=40),
       concurrency=st.none() | st.integers(1, 50), yields=st.integers(1, 3))
def test_each_job_gets_its_own_outcome_and_concurrency_is_the_exact_peak(
    behaviours: list[str], concurrency: int | None, yields: int
) -> None:
    jobs = make_jobs(len(behaviours))
    in_flight, peak = [0], [0]

    async def handler(job: Job) -> None:
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        try:
            for _ in range(yields):
                await asyncio.sleep(0)
            what = behaviours[job.payload]
            if what == "raise":
                raise ValueError(f"job {job.payload}")
            if what == "retry":
                job.retry(1.0)
            elif what == "fail":
                job.fail("no")
        finally:
            in_flight[0] -= 1

    run(_each_concurrently(handler, concurrency)(jobs))
    expected = {"return": "done", "raise": "error", "retry": "retry", "fail": "fail"}
    assert [job.outcome for job in jobs] == [expected[b] for b in behaviours]
    assert all(job.error == f"ValueError: job {job.payload}" for job in jobs
               if job.outcome == "error")
    assert peak[0] == min(concurrency or len(jobs), len(jobs))


@settings(max_examples=25, deadline=None)
@given(behaviours=st.lists(st.sampled_from(BEHAVIOURS), min_size=1, max_size=20),
       concurrency=st.none() | st.integers(1, 20))
def test_at_the_deadline_every_unfinished_job_is_settled_and_no_finished_one_changes(
    behaviours: list[str], concurrency: int | None
) -> None:
    jobs = make_jobs(len(behaviours))
    started: list[int] = []
    cancelled: list[int] = []

    async def handler(job: Job) -> None:
        started.append(job.payload)
        what = behaviours[job.payload]
        try:
            if what == "hang":
                await asyncio.Event().wait()
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            cancelled.append(job.payload)
            raise
        if what == "raise":
            raise ValueError("boom")
        if what == "retry":
            job.retry(1.0)
        elif what == "fail":
            job.fail("no")

    run(_within_deadline(_each_concurrently(handler, concurrency)(jobs), jobs, 0.05))
    hung = {n for n, what in enumerate(behaviours) if what == "hang"}
    workers = min(concurrency or len(jobs), len(jobs))
    # A worker stuck on a hung job takes no other: exactly that many hung jobs started.
    assert set(cancelled) == hung & set(started)
    assert len(cancelled) == min(workers, len(hung))
    expected = {"return": "done", "raise": "error", "retry": "retry", "fail": "fail"}
    for job in jobs:
        if job.payload in started and job.payload not in hung:
            assert job.outcome == expected[behaviours[job.payload]], "a finished job changed"
        else:  # hung, or never started behind a hung one
            assert job.outcome == "error"
            assert job.error.startswith("TimeoutError: async batch cancelled after 0.05s")


def test_a_handlers_own_timeout_error_is_an_exception_not_the_deadline() -> None:
    jobs = make_jobs(2)

    async def handler(batch: list[Job]) -> None:
        raise TimeoutError("the API was slow")

    try:
        run(_within_deadline(handler(jobs), jobs, 30.0))
    except TimeoutError as exc:
        assert str(exc) == "the API was slow"
    else:
        raise AssertionError("the handler's TimeoutError was swallowed")
    assert [job.outcome for job in jobs] == [None, None], "the slot marks them, as for any error"


def test_async_specs_are_told_apart_and_overrides_rebuild_the_concurrent_runner() -> None:
    app = App()

    @app.queue("batch")
    async def batch(jobs: list[Job]) -> None: ...

    @app.job_queue("each", batch_size=10)
    async def each(job: Job) -> None: ...

    @app.job_queue("sync_each")
    def sync_each(job: Job) -> None: ...

    assert [app.spec(q).is_async for q in ("batch", "each", "sync_each")] == [True, True, False]
    assert [app.spec(q).per_job for q in ("batch", "each", "sync_each")] == [False, True, True]
    assert app.spec("each").job_handler is each and app.spec("batch").handler is batch
    merged = app.with_overrides({"each": {"concurrency": 3}})
    assert merged.spec("each").policy.concurrency == 3
    assert merged.spec("each").handler is not app.spec("each").handler


def test_a_forked_child_makes_its_own_loop_and_never_runs_the_parents() -> None:
    """The master never runs a loop, but if a process that had one forks, the child must
    not reuse it (its selector would be shared with the parent)."""
    import os

    from qcluster.slot import aio

    def parent_side() -> tuple[int, int]:
        runner = aio.event_loop()
        assert runner.run(asyncio.sleep(0, result=1)) == 1
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report whether it got a new runner that works
            try:
                child = aio.event_loop()
                ok = child is not runner and child.run(asyncio.sleep(0, result=2)) == 2
                os.write(write_fd, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write_fd)
        answer = os.read(read_fd, 1)
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
        assert aio.event_loop() is runner, "the parent keeps its own loop"
        return int(answer or b"0"), status

    with ThreadPoolExecutor(1) as pool:
        answer, status = pool.submit(parent_side).result()
    assert (answer, status) == (1, 0)


def test_uvloop_is_used_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop is optional (not installed in this venv): a stand-in module with its one entry
    point shows the slot asks for its loop when it can be imported."""
    import sys
    import types

    from qcluster.slot import aio

    made: list[asyncio.AbstractEventLoop] = []

    def new_event_loop() -> asyncio.AbstractEventLoop:
        made.append(asyncio.new_event_loop())
        return made[-1]

    monkeypatch.setitem(sys.modules, "uvloop", types.SimpleNamespace(new_event_loop=new_event_loop))
    monkeypatch.setattr(aio, "_runner", None)
    assert aio.loop_kind() == "uvloop"

    def in_thread() -> int:
        runner = aio.event_loop()
        try:
            return int(runner.run(asyncio.sleep(0, result=7)))
        finally:
            runner.close()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(in_thread).result() == 7
    assert len(made) == 1

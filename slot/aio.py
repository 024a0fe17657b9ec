"""Async handlers in a slot: one event loop per process, made after the fork.

The slot loop stays synchronous (take, run, settle); only the handler's batch runs on the
loop. The loop is created at the first async batch of the process, never in the master
(a loop does not survive a fork: its selector and thread state would be shared), and it is
kept for the next batches, so connection pools a handler keeps on the loop live on.
uvloop is used when it is installed (``pip install uvloop``); plain asyncio otherwise.

The batch deadline: the master kills a slot whose batch runs past ``batch_timeout``. An
async batch is cancelled a little before that (:func:`cancel_after_s`), so the slot
settles it and goes on instead of dying. Jobs without an outcome at that moment are
settled as if the handler had raised ``TimeoutError`` for them, whatever the handler does
with the cancel (one that swallows ``CancelledError`` and returns too; the queue's
``on_error``: retried with backoff, an attempt counted, or left locked until
``lock_timeout`` as when a hung sync slot is killed); jobs already done, retried or failed
keep their outcome. A handler that blocks the loop with synchronous code cannot be
cancelled: the master's kill at ``batch_timeout`` stays the backstop.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from qcluster.job import Job

if TYPE_CHECKING:
    from qcluster.app import QueueSpec

logger = logging.getLogger(__name__)

#: The cancel comes this share of batch_timeout before the master's kill, at most
#: CANCEL_LEAD_MAX_S: time to unwind the handler and report the batch done.
CANCEL_LEAD_FRACTION = 0.2
CANCEL_LEAD_MAX_S = 1.0

_runner: asyncio.Runner | None = None
_runner_pid = 0


def cancel_after_s(batch_timeout: float) -> float:
    """Seconds after which an async batch is cancelled: before the master's kill at
    ``batch_timeout`` by 20% of it, at most 1 s (a 30 s batch: 29 s; a 1 s batch: 0.8 s)."""
    return batch_timeout - min(CANCEL_LEAD_MAX_S, CANCEL_LEAD_FRACTION * batch_timeout)


def run_async_batch(spec: QueueSpec, jobs: list[Job], work: Awaitable[Any]) -> Any:
    """Await ``work`` (what ``spec``'s async handler returned for ``jobs``: a coroutine) on
    this process's loop, within the deadline; returns what the handler returned (None is
    expected, as from a sync handler).

    The slot calls the handler itself and comes here only with a result that is not None,
    so a sync handler's batch costs nothing more. An exception from the handler
    propagates (the slot marks the jobs without an outcome, as for a sync handler); the
    deadline marks them itself.
    """
    budget_s = cancel_after_s(spec.policy.batch_timeout)
    return event_loop().run(_within_deadline(work, jobs, budget_s))


def event_loop() -> asyncio.Runner:
    """This process's loop runner, created on first use (after any fork)."""
    global _runner, _runner_pid
    if _runner is None or _runner_pid != os.getpid():
        # A runner inherited across a fork is abandoned, not closed: closing it would
        # touch the parent's selector and loop state.
        _runner, _runner_pid = asyncio.Runner(loop_factory=_loop_factory()), os.getpid()
        atexit.register(_close, _runner)
        logger.info("async handlers run on %s in process %d", loop_kind(), _runner_pid)
    return _runner


def loop_kind() -> str:
    """``uvloop`` or ``asyncio``: what :func:`event_loop` runs (shown in logs)."""
    return "uvloop" if _loop_factory() is not None else "asyncio"


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _close(runner: asyncio.Runner) -> None:
    """At interpreter exit (a foreground slot): cancel what handlers left running."""
    if runner is _runner and _runner_pid == os.getpid():
        runner.close()


async def _within_deadline(work: Awaitable[Any], jobs: list[Job], budget_s: float) -> Any:
    deadline = asyncio.timeout(budget_s)
    try:
        async with deadline:
            result = await work
    except TimeoutError:
        if not deadline.expired():
            raise  # the handler's own TimeoutError: an exception like any other
        _settle_cancelled(jobs, budget_s)
        return None
    if deadline.expired():  # the handler swallowed the cancel and returned: still late
        _settle_cancelled(jobs, budget_s)
        return None
    return result


def _settle_cancelled(jobs: list[Job], budget_s: float) -> None:
    timeout = TimeoutError(f"async batch cancelled after {budget_s:g}s (batch_timeout)")
    unfinished = [job for job in jobs if job.outcome is None]
    for job in unfinished:
        job.mark_error(timeout)
    logger.warning("async batch of %d jobs cancelled after %gs: %d without an outcome",
                   len(jobs), budget_s, len(unfinished))

"""Failure hooks: ``@app.on_failure`` functions, called in the slot when a handler raised.

A hook gets one :class:`Failure`: the jobs one exception failed, the exception, and what
happens to those jobs next (``retry`` at ``retry_at``, ``dead``, or ``locked`` until the
lock expires under ``on_error="lock"``). Jobs of one batch that one exception failed are
split by what happens next, so a hook is called once per exception and outcome.

The jobs' fate is decided before any hook runs and does not depend on it: a hook that
raises is logged and ignored; a hook that runs too long is left behind in its thread (the
slot goes on, and calls no hook of the queue again until it returned), so a hook can
neither lose a job nor make it run twice. Its time is bounded by ``timeout`` and by what
is left of the batch's lock. The batch is settled before the hooks are called, and the slot
keeps telling its master it is alive while it waits for them, so a slow hook never gets
the slot killed as hung.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from qcluster.job import Job

logger = logging.getLogger(__name__)

#: The longest the slot waits for its hooks per failure, in seconds (unless set).
DEFAULT_HOOK_TIMEOUT_S = 5.0
#: While waiting for a hook, the caller's ``alive`` is called at least this often (seconds).
ALIVE_INTERVAL_S = 0.5

Next = Literal["retry", "dead", "locked"]


@dataclass(frozen=True, slots=True)
class Failure:
    """One exception of a handler and the jobs it failed, as a hook sees it."""

    queue: str
    jobs: tuple[Job, ...]
    exception: BaseException
    next: Next
    """``retry``: each job runs again at the earliest at ``retry_at``; ``dead``: moved to
    the dead letters (no attempt left); ``locked``: left locked (``on_error="lock"``)."""
    retry_at: float | None
    """Unix seconds of the earliest retry (``next == "retry"``), else None."""
    attempt: int
    """The highest attempt among the jobs (1 = the first run)."""
    max_attempts: int
    host: str
    slot: str
    traceback: str = field(default="", repr=False)
    """The formatted traceback, as logged."""


FailureHook = Callable[[Failure], Any]


@dataclass(frozen=True, slots=True)
class HookSpec:
    hook: FailureHook
    timeout_s: float = DEFAULT_HOOK_TIMEOUT_S


class HookRunner:
    """Runs a slot's hooks, each in a worker thread of its own, waiting at most a budget
    (and each hook's own timeout) for them."""

    def __init__(self, hooks: tuple[HookSpec, ...]) -> None:
        self.hooks = hooks
        self._hung: dict[int, threading.Thread] = {}
        """Hooks still running past their time, by index: not called again until done."""
        self.skipped = 0
        """Failures a hook did not see: it was still running, or no time was left."""

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def call(self, failures: list[Failure], budget_s: float,
             alive: Callable[[], None] | None = None) -> None:
        """Call every hook for each of ``failures``; returns within ``budget_s`` seconds
        (and each hook within its own timeout) whatever the hooks do. ``alive`` is called
        every ALIVE_INTERVAL_S or so while waiting (the slot's heartbeat)."""
        if not self.hooks or not failures:
            return
        queue = failures[0].queue
        started = time.monotonic()
        workers: list[tuple[int, HookSpec, threading.Thread]] = []
        for index, spec in enumerate(self.hooks):
            hung = self._hung.get(index)
            if hung is not None and hung.is_alive():
                self._skip(spec, failures, "is still running from an earlier failure")
                continue
            self._hung.pop(index, None)
            if budget_s <= 0:
                self._skip(spec, failures, "has no time left in the batch's lock")
                continue
            worker = threading.Thread(target=_run, args=(spec, failures),
                                      name="qcluster-failure-hook", daemon=True)
            worker.start()
            workers.append((index, spec, worker))
        for index, spec, worker in workers:
            limit = min(budget_s, spec.timeout_s)
            _join(worker, started + limit, alive)
            if worker.is_alive():
                self._hung[index] = worker
                logger.error("failure hook %s of %s still running after %.3g s: the slot "
                             "goes on without it (the jobs' outcome does not wait for it)",
                             _name(spec), queue, limit)

    def _skip(self, spec: HookSpec, failures: list[Failure], why: str) -> None:
        self.skipped += len(failures)
        logger.error("failure hook %s %s: %d failures of %s not passed to it", _name(spec),
                     why, len(failures), failures[0].queue)


def _join(worker: threading.Thread, until: float, alive: Callable[[], None] | None) -> None:
    """Wait for ``worker`` until the monotonic time ``until``, calling ``alive`` between
    slices of the wait."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return
        worker.join(left if alive is None else min(left, ALIVE_INTERVAL_S))
        if not worker.is_alive():
            return
        if alive is not None:
            alive()


def _name(spec: HookSpec) -> str:
    return str(getattr(spec.hook, "__name__", spec.hook))


def _run(spec: HookSpec, failures: list[Failure]) -> None:
    for failure in failures:
        try:
            spec.hook(failure)
        except Exception:  # a hook's failure changes nothing for the jobs
            logger.exception("failure hook %s raised (ignored) for %s", _name(spec),
                             failure.queue)

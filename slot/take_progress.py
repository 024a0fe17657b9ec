"""How far a slot got through its take, in the TakeProgress it shares with its master.

At each take the slot writes what the take holds; then one state byte per job as it runs
them (stores into shared pages: no syscall, nothing sent). The master reads it only when
the slot died, to have each held job given back by its state (see channel.TakeProgress).

A take is followed or it is not: :meth:`TakeFollower.begin` returns a
:class:`FollowedTake`, or None when there is no shared memory (no master) or the take does
not fit. Where the broker's locks can be settled by the taking process only (RabbitMQ gives
a dead consumer's messages back itself), the take is followed for lookups only: its master
finds which slot holds a job in it, and never settles it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from qcluster.app import QueueSpec
from qcluster.channel import TakeProgress
from qcluster.job import Delivery, Job, LockToken
from qcluster.messages import Progress

_RUNNING = bytes([Progress.RUNNING]) * 4096
_DONE = bytes([Progress.DONE]) * 4096


class FollowedTake:
    """The take followed now: job n of the take is ``states[n]``."""

    def __init__(self, states: memoryview, per_job: bool) -> None:
        self.states = states
        self.per_job = per_job
        """A sync per-job handler: each job is marked as the handler reaches it."""

    def running(self, jobs: list[Job], deliveries: Sequence[Delivery], first: int) -> list[Job]:
        """Before the handler: a batch handler gets every job at once (all RUNNING); a
        per-job one (``app.job_queue``) marks each job as it reaches it. ``first``: the
        index of the batch's first delivery in the take."""
        states, size = self.states, len(deliveries)
        if size == 1:  # the common small batch: one store
            states[first] = Progress.RUNNING
        elif self.per_job and len(jobs) == size:  # job n is delivery first + n
            return _MarksEachJob(jobs, states, first)
        else:
            states[first : first + size] = _RUNNING[:size]
        return jobs

    def outcomes(self, jobs: list[Job], deliveries: Sequence[Delivery], first: int,
                 acked: int) -> None:
        """After the handler: DONE for the acked jobs (all of them, the common case: one
        slice), RAN or FAILED for the others; jobs refused before the handler stay
        UNSTARTED (given back, they are refused again)."""
        states = self.states
        if acked == len(deliveries):
            if acked == 1:
                states[first] = Progress.DONE
            else:
                states[first : first + acked] = _DONE[:acked]
            return
        where = {id(delivery): first + n for n, delivery in enumerate(deliveries)}
        for job in jobs:
            states[where[id(job.delivery)]] = _state_of(job)


class TakeFollower:
    """Starts following each take in the shared TakeProgress (None: nothing is followed:
    no master)."""

    def __init__(self, progress: TakeProgress | None, *, settleable: bool = True) -> None:
        self._progress = progress
        self._settleable = settleable
        """The broker settles for others: every receipt of a take is its lock token."""
        self._count = 0
        """Takes followed so far (each gets the next number; 0 means none in the area)."""

    def begin(self, queue: str, deliveries: list[Delivery], *,
              per_job: bool) -> FollowedTake | None:
        """Follow a new take; None when it is not followed: it holds something a master
        could not settle (a malformed delivery) or does not fit."""
        progress = self._progress
        if progress is None:
            return None
        token: LockToken = deliveries[0].receipt if self._settleable else LockToken(0)
        if (any(delivery.malformed for delivery in deliveries)
                or not progress.begin(self._count + 1, queue, token, deliveries,
                                      settleable=self._settleable)):
            progress.clear()
            return None
        self._count += 1
        return FollowedTake(progress.states, per_job)

    def clear(self) -> None:
        """The last take is settled: nothing is held."""
        if self._progress is not None:
            self._progress.clear()


def runs_each_job(spec: QueueSpec) -> bool:
    """A sync per-job handler (``app.job_queue``): it runs the batch's jobs one by one
    with ``for job in jobs``, so the slot can mark each as it starts. Not an async one:
    its workers share one iterator and run several jobs at once, so taking the next job
    says nothing about the last one (the whole batch counts as running)."""
    return spec.per_job and not spec.is_async


def _state_of(job: Job) -> int:
    if job.outcome in (None, "done"):
        return Progress.DONE
    return Progress.FAILED if job.outcome == "fail" else Progress.RAN


class _MarksEachJob(list[Job]):
    """A batch for a per-job handler: iterating it marks each job RUNNING as the handler
    reaches it, and the one before DONE/RAN/FAILED by its outcome (a store in shared
    memory per job, no syscall). Only ``for`` is followed: a job reached another way
    stays UNSTARTED until the batch ends (given back uncharged if the slot dies)."""

    def __init__(self, jobs: list[Job], states: memoryview, first: int) -> None:
        super().__init__(jobs)
        self._states, self._first = states, first
        """Job n's state is states[first + n]."""

    def __iter__(self) -> Iterator[Job]:
        states, first = self._states, self._first
        running, done = Progress.RUNNING, Progress.DONE
        index = first
        for job in list.__iter__(self):
            states[index] = running
            yield job
            # The handler came back for the next one (inline: this runs once per job).
            outcome = job.outcome
            states[index] = done if outcome is None or outcome == "done" else _state_of(job)
            index += 1

"""Which slot holds a job now, asked of the masters: the lookup's answer where the broker
cannot give one (RabbitMQ cannot search its queues, nor say who holds an unacked message).

A lookup names the job; every reply to a report carries the ids asked for
(``Assignment.find_jobs``); a master looks for them in its slots' shared take progress and
reports again at once (``HostReport.searched`` and ``held``). The lookup waits until a
host names the job, or every host that reported when it asked has answered since, or its
deadline. Lookups of the same id at once share the asking; each takes only the answers
given after it began. Pure bookkeeping under one condition variable: no I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from qcluster.messages import MAX_FIND_JOBS, HeldJob

#: How long an id stays asked for after its newest lookup began (a lookup waits less).
ASK_TTL_S = 30.0
#: Lookups waiting for the masters at once; one more is refused (the API answers 429).
MAX_WAITING = 8


class LookupsBusy(Exception):
    """As many lookups as allowed wait for the masters' answers: try again shortly."""


@dataclass
class _Ask:
    at: float
    """When the newest lookup of the id began."""
    answers: dict[str, tuple[float, HeldJob | None]] = field(default_factory=dict)
    """Host -> when it answered, and the job as its slot holds it (None: no slot does)."""


@dataclass(frozen=True)
class Found:
    """A lookup's outcome: the host holding the job (None: none said so), and how many of
    the hosts asked answered in time."""

    host: str | None
    job: HeldJob | None
    answered: int
    asked: int


class HeldLookup:
    """The ids asked for and the masters' answers."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._asks: dict[str, _Ask] = {}
        self._changed = threading.Condition()
        self._waiting = 0

    def wanted(self) -> list[str]:
        """The ids every report's reply asks about now (the newest ``MAX_FIND_JOBS``)."""
        with self._changed:
            self._expire()
            return list(self._asks)[-MAX_FIND_JOBS:]

    def answered(self, host: str, searched: Collection[str], held: Collection[HeldJob]) -> None:
        """A report: ``host`` looked for ``searched`` and holds ``held``."""
        if not searched:
            return
        by_id = {job.id: job for job in held}
        now = self._clock()
        with self._changed:
            for job_id in searched:
                ask = self._asks.get(job_id)
                if ask is not None:
                    ask.answers[host] = (now, by_id.get(job_id))
            self._changed.notify_all()

    def find(self, job_id: str, hosts: Collection[str], timeout_s: float) -> Found:
        """Which of ``hosts`` holds ``job_id``, from their answers given after this call
        began; waits until one holds it, each answered, or ``timeout_s`` passed.

        Raises:
            LookupsBusy: ``MAX_WAITING`` lookups wait already.
        """
        asked = set(hosts)
        with self._changed:
            if self._waiting >= MAX_WAITING:
                raise LookupsBusy(f"{MAX_WAITING} job lookups already wait for the masters")
            self._waiting += 1
            try:
                return self._wait(job_id, asked, timeout_s)
            finally:
                self._waiting -= 1

    def _wait(self, job_id: str, asked: set[str], timeout_s: float) -> Found:
        began = self._clock()
        ask = self._asks.pop(job_id, None) or _Ask(at=began)
        ask.at = began
        self._asks[job_id] = ask  # the newest last: kept first when too many are asked
        deadline = began + timeout_s
        while True:
            fresh = {host: job for host, (at, job) in ask.answers.items()
                     if at >= began and host in asked}
            holder = next(((host, job) for host, job in fresh.items() if job is not None),
                          None)
            left = deadline - self._clock()
            if holder is not None or len(fresh) == len(asked) or left <= 0:
                host, job = holder if holder is not None else (None, None)
                return Found(host=host, job=job, answered=len(fresh), asked=len(asked))
            self._changed.wait(left)

    def _expire(self) -> None:
        now = self._clock()
        for job_id in [i for i, ask in self._asks.items() if now - ask.at > ASK_TTL_S]:
            del self._asks[job_id]

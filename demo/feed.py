"""The demo's load generator's arithmetic: how many jobs each queue is due at each tick.

Pure (no clock, no I/O) so that its promise is testable: over any span the jobs enqueued
are the integral of the claimed arrival rates, whatever each tick's real length.
"""

from __future__ import annotations

import math
from collections.abc import Callable

#: Step of the numeric integral: shorter than any edge of the demo's waves matters for.
STEP_S = 0.05

Rates = Callable[[float], dict[str, float]]


class Feed:
    """Jobs due per queue since the previous tick: the rates integrated over the span the
    tick really covered, fractions carried to the next tick.

    A tick enqueues, then sleeps; on a loaded machine a tick lasts longer than its sleep.
    Counting ``rate x nominal tick`` per tick then delivers less than the rate the demo
    claims (in CI, ~1,420 of 1,500 jobs/s, which put the resize queue's need at the edge
    of its plan's band and made the plan creep one slot 20 s after an edge)."""

    def __init__(self, rates: Rates) -> None:
        self.rates = rates
        self.last: float | None = None
        self.carry: dict[str, float] = {}

    def due(self, t: float) -> dict[str, int]:
        """Jobs to enqueue now, ``t`` seconds into the demo (the first call covers [0, t])."""
        start, self.last = (0.0 if self.last is None else self.last), t
        owed = {queue: self.carry.get(queue, 0.0) for queue in self.rates(t)}
        steps = max(1, math.ceil((t - start) / STEP_S))
        width = (t - start) / steps
        for i in range(steps):
            for queue, rate in self.rates(start + (i + 0.5) * width).items():
                owed[queue] = owed.get(queue, 0.0) + rate * width
        whole = {queue: math.floor(jobs + 1e-9) for queue, jobs in owed.items()}
        self.carry = {queue: jobs - whole[queue] for queue, jobs in owed.items()}
        return {queue: n for queue, n in whole.items() if n > 0}

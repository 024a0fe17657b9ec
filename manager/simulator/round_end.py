"""What a simulated queue keeps at each planning round's end: the window the policy reads
and the points of its charts."""

from __future__ import annotations

from qcluster.manager.simulator.model import QueueSim


def close_round(q: QueueSim, index: int, now: float, window_rounds: int, chunk: int,
                last: int) -> None:
    """A round's end for one queue: its window of the last ``window_rounds`` rounds (what
    the policy reads) and its chart series, one point per ``chunk`` rounds and at the
    ``last``."""
    processed, busy, alive = q.round_processed, q.round_busy, q.round_alive
    window = q.window
    window.append((processed, busy, alive))
    if len(window) > window_rounds:
        old = window.popleft()
        q.win_processed += processed - old[0]
        q.win_busy = q.win_busy + busy - old[1]
        q.win_alive = q.win_alive + alive - old[2]
    else:
        q.win_processed += processed
        q.win_busy += busy
        q.win_alive += alive
    q.round_processed, q.round_busy, q.round_alive = 0, 0.0, 0.0
    c = q.chunk
    # Each 'if' is max() as it keeps the first of equals, without the call (every
    # queue, every round).
    backlog = q.backlog
    if backlog > c[0]:
        c[0] = backlog
    c[1] += q.existing
    if q.planned > c[2]:
        c[2] = q.planned
    buckets = q.buckets
    if buckets:  # q.oldest_wait(now)
        wait = now - buckets[0][0]
        if wait > c[3]:
            c[3] = wait
    c[4] += 1
    if c[4] == chunk or index == last:
        s = q.series
        s.t.append(round(now, 3))
        s.backlog.append(int(c[0]))
        s.slots.append(round(c[1] / c[4], 2))
        s.planned.append(int(c[2]))
        s.wait.append(round(c[3], 3))
        q.chunk = [0.0, 0.0, 0.0, 0.0, 0]

"""Retry delays: exponential backoff with full jitter (randomness injected)."""

from __future__ import annotations

from collections.abc import Callable


def compute_backoff(
    attempt: int,
    *,
    base_s: float = 1.0,
    cap_s: float = 300.0,
    rand: Callable[[], float],
) -> float:
    """Delay before retry number ``attempt`` (1-based), in seconds.

    ``base_s * 2**(attempt-1)`` capped at ``cap_s``, then scaled into
    ``[0.5, 1.0]`` of itself by ``rand()`` (a float in [0, 1)) so that a batch of
    failed jobs does not come back in lock-step, while never coming back
    immediately.
    """
    exponent = max(0, min(attempt - 1, 30))
    ceiling = min(cap_s, base_s * (2**exponent))
    return ceiling * (0.5 + 0.5 * rand())

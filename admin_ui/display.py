"""How figures read on the admin pages and in the demo's console: one place, so both agree."""

from __future__ import annotations

import math

#: From this load up, a multiple reads better than a percentage ("25x", not "2500%").
MULTIPLE_FROM = 10.0
UNDEFINED = "—"


def load_text(load: float | None) -> str:
    """'69%', '320%', '25x', '1,200x'; '—' when the load is undefined (work waits, no slot ran).

    Never clipped: a queue far over its slots shows how far.
    """
    if load is None or not math.isfinite(load):
        return UNDEFINED
    if load < MULTIPLE_FROM:
        return f"{load:.0%}"
    return f"{load:,.0f}x"


def load_bar_percent(load: float | None) -> float:
    """Width of the load bar: the load in percent, full at 100% (and when undefined: work
    waits with no slot to measure it, which is the fullest a queue gets)."""
    if load is None or not math.isfinite(load):
        return 100.0
    return round(min(max(load, 0.0) * 100.0, 100.0), 1)

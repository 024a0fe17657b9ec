"""What the job browser shows, as values: a payload as pretty JSON, the pages of a listing,
what a job's state says in words. Pure (no request, no clock, no I/O)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: The states a queue's jobs are listed in, in the tabs' order.
STATES = ("running", "delayed", "retrying", "dead")
#: Jobs per page of a listing.
PAGE_SIZE = 50
#: A payload longer than this (as pretty JSON) is cut, saying how much was left out.
PAYLOAD_MAX_CHARS = 20_000
#: The one-line preview of a payload in a listing's row.
PREVIEW_CHARS = 100
#: What each state means, for the job page's heading.
STATE_TEXT = {
    "ready": "waiting in its queue to be taken",
    "delayed": "waiting until its run time",
    "running": "taken by a slot, running",
    "retrying": "failed, waiting for its next attempt",
    "dead": "dead-lettered: it will not run again unless requeued",
    "finished": "finished",
    "unknown": "its state cannot be known here",
}


def pretty_json(value: Any, limit: int = PAYLOAD_MAX_CHARS) -> str:
    """``value`` as indented JSON (non-ASCII kept), cut at ``limit`` characters with a
    note; a value JSON cannot write is shown as its repr (never an error on the page)."""
    try:
        text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > limit:
        return f"{text[:limit]}\n… ({len(text) - limit:,} more characters)"
    return text


def preview(value: Any, limit: int = PREVIEW_CHARS) -> str:
    """The payload on one line (compact JSON), cut at ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def duration(seconds: float | None) -> str:
    """'350 ms', '12.5 s', '4m 10s', '3h 5m'; '—' when unknown."""
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60}s"
    return f"{whole // 3600}h {whole % 3600 // 60}m"


@dataclass(frozen=True)
class Pages:
    """Where a page of a listing is: its offset, the previous and next offsets (None:
    none), and which jobs it shows ("51 to 100 of 1,000,000")."""

    offset: int
    shown: int
    total: int | None
    size: int = PAGE_SIZE

    @property
    def previous(self) -> int | None:
        return max(0, self.offset - self.size) if self.offset > 0 else None

    @property
    def next(self) -> int | None:
        more = self.shown == self.size if self.total is None else (
            self.offset + self.shown < self.total)
        return self.offset + self.size if more else None

    @property
    def last(self) -> int | None:
        """The last page's offset (None: not counted, or this is it)."""
        if self.total is None or self.total <= self.size:
            return None
        last = (self.total - 1) // self.size * self.size
        return last if last != self.offset else None

    def text(self) -> str:
        if not self.shown:
            return "none" if not self.offset else f"none from {self.offset + 1:,}"
        span = f"{self.offset + 1:,} to {self.offset + self.shown:,}"
        return f"{span} of {self.total:,}" if self.total is not None else span


def page_offset(offset: int, total: int | None, size: int = PAGE_SIZE) -> int:
    """An offset from a link, aligned to a page and kept within the listing (a page asked
    past the end shows the last one)."""
    offset = max(0, offset) // size * size
    if total is not None and offset >= total > 0:
        offset = (total - 1) // size * size
    return offset

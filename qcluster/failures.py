"""A job's last error: what the slot saw when a handler raised, kept with the job.

The slot builds one :class:`JobError` per failed job and hands it to the broker with the
batch's :class:`~qcluster.broker.base.Settlement` (``errors``, by job id); every backend
stores it beside the retried or dead-lettered job, so that ``qcluster dead``,
``qcluster job ID`` and the admin page can show it. JSON only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

#: The longest traceback kept with a job, in characters: its tail (the innermost frames
#: and the exception line) is kept when it is longer.
MAX_TRACEBACK_CHARS = 4000
#: The longest message kept, in characters.
MAX_MESSAGE_CHARS = 1000


@dataclass(frozen=True, slots=True)
class JobError:
    """The last error of one job."""

    type: str
    """The exception's qualified name, e.g. ``smtplib.SMTPServerDisconnected``."""
    message: str
    traceback: str
    """Bounded to :data:`MAX_TRACEBACK_CHARS` (its tail)."""
    host: str
    slot: str
    """The slot's name on its host, e.g. ``emails-3`` (or its pid)."""
    attempt: int
    at: float
    """Unix seconds (the slot's clock)."""

    @classmethod
    def bounded(cls, *, type: str, message: str, traceback: str, host: str, slot: str,
                attempt: int, at: float) -> JobError:
        """A record with the message and traceback cut to their bounds."""
        if len(traceback) > MAX_TRACEBACK_CHARS:
            traceback = "...\n" + traceback[-(MAX_TRACEBACK_CHARS - 4):]
        return cls(type=type, message=message[:MAX_MESSAGE_CHARS], traceback=traceback,
                   host=host, slot=slot, attempt=attempt, at=at)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes | None) -> JobError | None:
        """The stored record, or None when there is none or it cannot be read (a
        record is shown to operators; a damaged one never stops a job)."""
        if not text:
            return None
        try:
            data: Any = json.loads(text)
            return cls(type=str(data["type"]), message=str(data["message"]),
                       traceback=str(data["traceback"]), host=str(data["host"]),
                       slot=str(data["slot"]), attempt=int(data["attempt"]),
                       at=float(data["at"]))
        except (ValueError, TypeError, KeyError):
            return None

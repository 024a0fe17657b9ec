"""Operator controls: a paused queue, a drained host, with who set them and when.

The manager keeps each control in the broker (``Broker.write_control``, one small entry
per control), so that a restarted manager, or a second one, reads them back. This module
is the value both sides agree on: the manager stores it, the API and the admin page show
it, ``qcluster pause|resume|drain|undrain`` change it through the manager's API.
"""

from __future__ import annotations

import datetime
import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: pause: the queue gets no slot; drain: the host gets no slot (its slots move elsewhere).
ControlKind = Literal["pause", "drain"]
KINDS: tuple[ControlKind, ...] = ("pause", "drain")
#: Shown as "by" for the unnamed ``token`` (named ones show their name, never the secret).
UNNAMED_TOKEN = "token"
#: The latest ``at`` a control may carry (year 2096): the broker's data is not trusted, and
#: a larger or non-finite value cannot be shown as a date.
MAX_AT = 4e9
#: Unix seconds as a stored control's ``at``: finite, in [0, MAX_AT].
Timestamp = Annotated[float, Field(ge=0, le=MAX_AT, allow_inf_nan=False)]


class Control(BaseModel):
    """One control in force: ``kind`` on ``name`` (a queue for pause, a host for drain)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    kind: ControlKind
    name: str
    by: str
    """The name of the token that set it (never its value)."""
    at: Timestamp
    """Wall-clock unix seconds, the manager's clock when it was set (an entry in the
    broker outside [0, MAX_AT], or not finite, is not a control: skipped)."""

    @property
    def key(self) -> str:
        return control_key(self.kind, self.name)

    def stored(self) -> bytes:
        """What the broker keeps under :attr:`key`: ``{"by": ..., "at": ...}``."""
        return json.dumps({"by": self.by, "at": self.at}).encode()


def control_key(kind: ControlKind, name: str) -> str:
    return f"{kind}:{name}"


def utc_text(at: float, fmt: str = "%Y-%m-%d %H:%M:%S UTC") -> str:
    """``at`` (unix seconds) as UTC text; a value no date can show (NaN, far future: data
    from elsewhere) is shown as the number, never an error."""
    try:
        return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime(fmt)
    except (ValueError, OverflowError, OSError, TypeError):
        return repr(at)


def parse_stored(key: str, value: bytes) -> Control | None:
    """The control stored under ``key`` (``KIND:NAME``); None when the entry is not one
    (another program's data, a torn value): it is skipped, never a crash."""
    kind, _, name = key.partition(":")
    if kind not in KINDS or not name:
        return None
    try:
        data = json.loads(value)
        return Control.model_validate({**data, "kind": kind, "name": name})
    except (ValueError, TypeError, ValidationError):
        return None

"""Periodic jobs: their declaration and their tick arithmetic, pure (no clock, no I/O).

A periodic job enqueues ``payload`` to ``queue`` at each of its ticks. Ticks come from a
cron expression (five fields, or six with seconds first; UTC) parsed by ``croniter``, or
from an interval ``every`` seconds, aligned on the Unix epoch so that every manager computes
the same ticks. Ticks are whole milliseconds since the epoch: a tick is also the job's id
suffix and the value the brokers compare, so it must be exact.

Which ticks a manager enqueues (:func:`due_ticks`): those after the job's last enqueued
tick and not after now (never early). A tick older than the job's ``missed_after`` (default
:data:`MISSED_AFTER_S`) when a manager first could enqueue it is *missed* (no manager
ran): ``catch_up`` decides what happens to the missed ticks, ``"skip"`` (none is
enqueued; the default), ``"latest"`` (only the newest) or a number N (the newest N).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Literal

from croniter import CroniterError, croniter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qcluster.errors import ConfigError, InvalidQueueName, field_reasons
from qcluster.names import check_queue_name

#: A tick not enqueued within this many seconds of its time was missed (no manager ran);
#: the job's ``catch_up`` decides what happens to it. Within it a tick is merely late.
#: The default of a job's ``missed_after``.
MISSED_AFTER_S = 60.0
MAX_MISSED_AFTER_S = 24 * 3600.0
#: The most missed ticks ``catch_up = N`` may ask for.
MAX_CATCH_UP = 1000
#: Shortest interval: ticks are enqueued by the manager's ticker, not by a hot loop.
MIN_EVERY_S = 1.0
MAX_EVERY_S = 366 * 24 * 3600.0
#: croniter's random (R) and hashed (H) fields differ between processes or need a seed:
#: two managers would not agree on the ticks.
_NON_DETERMINISTIC = re.compile(r"(^|[\s,/(-])[RH]($|[\s,/()-])", re.IGNORECASE)

CatchUp = Literal["skip", "latest"] | int


class PeriodicSpec(BaseModel):
    """``@app.periodic(...)`` or ``[periodic.NAME]``: what to enqueue, where and when."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """Names the job in the broker's record, the job ids and the admin page."""
    queue: str
    payload: Any = Field(default_factory=dict)
    """JSON, the same for every tick (the tick itself is in the job's headers)."""
    cron: str | None = None
    """Five fields (minute first) or six (seconds first), UTC; ``@hourly`` and the like."""
    every: float | None = None
    """Seconds between ticks, aligned on the Unix epoch (``every=60`` ticks on each minute)."""
    catch_up: CatchUp = "skip"
    """Missed ticks (older than ``missed_after``): "skip", "latest" or the newest N."""
    missed_after: float = MISSED_AFTER_S
    """Seconds after which a tick not yet enqueued is missed rather than late."""

    @field_validator("name", "queue")
    @classmethod
    def _name_rule(cls, value: str) -> str:
        try:
            check_queue_name(value)
        except InvalidQueueName as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("payload")
    @classmethod
    def _json_payload(cls, value: Any) -> Any:
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        return value

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str | None) -> str | None:
        if value is None:
            return None
        expression = " ".join(value.split())
        fields = expression.split(" ")
        if not expression.startswith("@") and len(fields) not in (5, 6):
            raise ValueError(f"{value!r}: want 5 fields (minute hour day month weekday) "
                             "or 6 (seconds first)")
        if _NON_DETERMINISTIC.search(expression):
            raise ValueError(f"{value!r}: random (R) and hashed (H) fields are not "
                             "supported: every manager must compute the same ticks")
        try:
            croniter(expression, datetime(2000, 1, 1, tzinfo=UTC),
                     second_at_beginning=len(fields) == 6).get_next(float)
        except (CroniterError, ValueError, KeyError) as exc:
            raise ValueError(f"{value!r} is not a valid cron expression: {exc}") from None
        return expression

    @field_validator("every")
    @classmethod
    def _sane_every(cls, value: float | None) -> float | None:
        if value is None:
            return None
        if not math.isfinite(value) or not MIN_EVERY_S <= value <= MAX_EVERY_S:
            raise ValueError(f"{value!r}: want seconds from {MIN_EVERY_S:g} to "
                             f"{MAX_EVERY_S:g} (366 days)")
        return value

    @field_validator("missed_after")
    @classmethod
    def _sane_missed_after(cls, value: float) -> float:
        if not math.isfinite(value) or not 1.0 <= value <= MAX_MISSED_AFTER_S:
            raise ValueError(f"{value!r}: want seconds from 1 to {MAX_MISSED_AFTER_S:g} (a day)")
        return value

    @field_validator("catch_up", mode="before")
    @classmethod
    def _bounded_catch_up(cls, value: Any) -> Any:
        if value in ("skip", "latest") and isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_CATCH_UP:
            return value
        raise ValueError(f"{value!r}: want \"skip\", \"latest\" or a whole number of ticks "
                         f"from 1 to {MAX_CATCH_UP}")

    @model_validator(mode="after")
    def _one_schedule(self) -> PeriodicSpec:
        if (self.cron is None) == (self.every is None):
            raise ValueError("give exactly one of cron (a cron expression) and every (seconds)")
        return self

    @property
    def schedule(self) -> str:
        """The schedule as the admin page shows it."""
        return self.cron if self.cron is not None else f"every {self.every:g} s"

    @property
    def missed_budget(self) -> int:
        """How many missed ticks ``catch_up`` enqueues."""
        if self.catch_up == "skip":
            return 0
        if self.catch_up == "latest":
            return 1
        return int(self.catch_up)

    @property
    def missed_after_ms(self) -> int:
        return round(self.missed_after * 1000)

    # --- tick arithmetic (milliseconds since the epoch) -------------------------------

    def next_tick(self, after_ms: int) -> int:
        """The first tick strictly after ``after_ms``."""
        if self.every is not None:
            step = _every_ms(self.every)
            return (after_ms // step + 1) * step
        return _cron_step(self._cron(after_ms), forward=True)

    def prev_tick(self, before_ms: int) -> int:
        """The last tick strictly before ``before_ms``."""
        if self.every is not None:
            step = _every_ms(self.every)
            return ((before_ms - 1) // step) * step
        return _cron_step(self._cron(before_ms), forward=False)

    def ticks(self, after_ms: int, until_ms: int) -> Iterator[int]:
        """Every tick in ``(after_ms, until_ms]``, ascending."""
        tick = self.next_tick(after_ms)
        while tick <= until_ms:
            yield tick
            tick = self.next_tick(tick)

    def newest_ticks(self, after_ms: int, until_ms: int, count: int) -> list[int]:
        """The newest ``count`` ticks in ``(after_ms, until_ms]``, ascending."""
        found: list[int] = []
        tick = self.prev_tick(until_ms + 1)
        while len(found) < count and tick > after_ms:
            found.append(tick)
            tick = self.prev_tick(tick)
        return found[::-1]

    def _cron(self, at_ms: int) -> croniter:
        assert self.cron is not None
        start = datetime.fromtimestamp(at_ms / 1000, tz=UTC)
        return croniter(self.cron, start, second_at_beginning=len(self.cron.split()) == 6)


def _every_ms(every_s: float) -> int:
    return max(1, round(every_s * 1000))


def _cron_step(schedule: croniter, *, forward: bool) -> int:
    at = schedule.get_next(float) if forward else schedule.get_prev(float)
    return round(at * 1000)


def due_ticks(spec: PeriodicSpec, last_ms: int, now_ms: int) -> list[int]:
    """The ticks to enqueue at ``now_ms`` when ``last_ms`` is the job's last enqueued tick
    (or where a new job starts), ascending: every tick of ``(last_ms, now_ms]`` not older
    than ``missed_after``, after the newest missed ones ``catch_up`` asks for."""
    edge = now_ms - spec.missed_after_ms
    on_time = list(spec.ticks(max(last_ms, edge), now_ms))
    budget = spec.missed_budget
    missed = spec.newest_ticks(last_ms, edge, budget) if budget and edge > last_ms else []
    return missed + on_time


def periodic_spec(name: str, fields: dict[str, Any], *, where: str) -> PeriodicSpec:
    """A validated spec, or a one-line :class:`ConfigError` naming the job and the field
    (``where``: ``"[periodic.NAME]"`` or ``"@app.periodic"``)."""
    try:
        return PeriodicSpec.model_validate({**fields, "name": name})
    except ValidationError as exc:
        raise ConfigError(f"periodic job {name!r} ({where}): "
                          f"{field_reasons(exc.errors(), whole='schedule')}") from None


class PeriodicJobView(BaseModel):
    """A periodic job as the admin page shows it."""

    model_config = ConfigDict(frozen=True)

    name: str
    queue: str
    schedule: str
    catch_up: str
    last_run: float | None
    """Unix seconds of the last tick enqueued (by any manager); None: never."""
    next_run: float
    """Unix seconds of the next tick."""


def job_id(name: str, tick_ms: int) -> str:
    """The id of the job one tick enqueues: the same in every manager and every try, so
    that a tick published again is the same job (``Broker.publish_tick``)."""
    return f"periodic.{name}.{tick_ms}"

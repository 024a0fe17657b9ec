"""``qcluster manager --record FILE``: what the manager observed, one JSON line per round.

The file is a trace ``qcluster simulate --trace FILE`` replays, so a real day can be run
again against changed policies. Format (JSON Lines, version 1):

* a header: ``{"type": "header", "version": 1, "started_at": unix s, "interval_s": s,
  "target_utilization": share, "queues": {NAME: QueuePolicy fields}, "hosts": {NAME:
  {"slots": capacity}}}`` (``target_utilization`` optional: 0.8 when absent);
* then one line per planning round: ``{"type": "round", "t_s": s since started_at,
  "hosts": {NAME: {"slots": capacity, "alive": bool}}, "queues": {NAME: {"arrived",
  "done", "backlog", "mean_job_s", "slots", "batches", "batch_s"}}}``, plus
  ``"policies": {NAME: ...}`` for a queue whose policy the file has not carried yet
  (first seen, or changed). ``batches`` and ``batch_s`` are optional (0: not measured,
  as in a recording written before them).

Every header starts a self-contained recording: a restarted manager appends a new
header to the same file, and so does the recorder after it rotates a full file to
``FILE.1``; rounds before any host reported are not written. A round's ``arrived`` is
counted by the planner's rule (``manager/planning/arrivals.py``, :class:`ArrivalLedger`):
``done + backlog change``, on the jobs in the broker (ready + locked: a job taken between
two rounds was still enqueued) and never below 0: a fall the jobs done do not explain yet
(done jobs reach the manager with the next report) is carried to the next rounds instead
of being lost, so over a recording the arrivals add up to the jobs done plus the jobs left.
The ledger starts at 0 with the recording, not at the planner's first round: in a
recording's first round the jobs found count as arrived, so a replay starts with them.
Each line is flushed as written: a crash loses at most the round being written, and a
reader skips a torn last line. A reader ignores keys it does not know (in a line, a host, a
queue or a policy): a newer version's recording replays here.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, TextIO

from pydantic import BaseModel, ConfigDict, Field

from qcluster.config import ManagerSettings
from qcluster.errors import ConfigError
from qcluster.manager.planning.arrivals import ArrivalLedger
from qcluster.manager.state import ClusterState, QueueObservation, RoundObservation
from qcluster.policy import QueuePolicy

logger = logging.getLogger(__name__)

class _Line(BaseModel):
    # Closed: the writer cannot build a line with a key the format does not have. Readers
    # parse with extra="ignore" instead (parse_record_line): a newer version's key is
    # skipped, not refused, in every model of a line down to its policies (QueuePolicy
    # forbids unknown keys too, and must: in qcluster.toml one is a typo).
    model_config = ConfigDict(frozen=True, extra="forbid")


class HeaderHost(_Line):
    slots: int = Field(ge=0)
    """Capacity in slots."""


class RoundHost(_Line):
    slots: int = Field(ge=0)
    """Capacity in slots."""
    alive: bool


class RoundQueue(_Line):
    arrived: int = Field(ge=0)
    """Jobs enqueued since the previous round, estimated as done + backlog change."""
    done: int = Field(ge=0)
    """Jobs processed since the previous round (done, retried or failed)."""
    backlog: int = Field(ge=0)
    """Ready jobs at this round."""
    mean_job_s: float | None = Field(ge=0)
    """Mean handler seconds of the jobs done since the previous round; None when none."""
    slots: int = Field(ge=0)
    """Slots running for the queue."""
    batches: int = Field(default=0, ge=0)
    """Batches those jobs ran in (0 in a recording older than the field)."""
    batch_s: float = Field(default=0.0, ge=0)
    """Seconds the slots spent in those batches, idle time left out
    (``BatchCounters.batch_s``): less the handler's seconds (``mean_job_s`` times
    ``done``), what the batches cost beyond their handler. 0 when no slot measured it (a
    recording or a slot older than the field)."""


class RecordHeader(_Line):
    type: Literal["header"] = "header"
    version: Literal[1] = 1
    started_at: float
    """Unix seconds; every round's t_s counts from here."""
    interval_s: float = Field(gt=0)
    """The manager's planning interval."""
    target_utilization: float = Field(default=0.8, gt=0, le=1)
    """The manager's ``target_utilization`` (a recording written before the field: the
    default's)."""
    queues: dict[str, QueuePolicy]
    hosts: dict[str, HeaderHost]


class RecordRound(_Line):
    type: Literal["round"] = "round"
    t_s: float = Field(ge=0)
    hosts: dict[str, RoundHost]
    queues: dict[str, RoundQueue]
    policies: dict[str, QueuePolicy] = Field(default_factory=dict)
    """Policies of queues the file has not described yet (written only when not empty)."""


RecordLine = RecordHeader | RecordRound


def parse_record_line(data: Any) -> RecordLine:
    """One line of a recording (its JSON decoded) as a reader takes it: keys this version
    does not know are ignored. The line's ``type`` picks the model (anything but a header is
    read as a round), so an error names the field, not a branch of a union.
    Raises ValidationError."""
    model = (RecordHeader if isinstance(data, dict) and data.get("type") == "header"
             else RecordRound)
    return model.model_validate(data, extra="ignore")


def dump_record_line(line: RecordLine) -> str:
    """One line as the recorder writes it (no newline): a round's ``policies`` only when
    it has some."""
    exclude: Any = {"policies"} if isinstance(line, RecordRound) and not line.policies else None
    return line.model_dump_json(exclude=exclude)


def read_recording(path: Path) -> Iterator[RecordLine]:
    """The lines of a recording, validated (:func:`parse_record_line`); a torn last line (a
    crash mid-write) is skipped. Raises ValueError (not JSON, or not a valid line)."""
    content = path.read_text(encoding="utf-8")
    lines = content.split("\n")  # not splitlines(): JSON may hold U+2028 unescaped
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            line = parse_record_line(json.loads(text))
        except ValueError:  # json.JSONDecodeError, ValidationError
            if number == len(lines):
                return  # no newline after it: written up to a crash, the round is lost
            raise
        yield line


class Recorder:
    """Appends a round line per planning round to ``path``; not thread-safe (one loop)."""

    def __init__(self, path: Path, interval_s: float, started_at: float,
                 max_bytes: int = 1 << 30, target_utilization: float = 0.8) -> None:
        self.path = path
        self.interval_s = interval_s
        self.target_utilization = target_utilization
        self.max_bytes = max_bytes
        self._file = self._open()
        self.last_round_at = -float("inf")  # a new manager: every sample it holds is new
        """The previous round's time: the next round writes the reports received since."""
        self._restart(started_at)

    def _open(self) -> TextIO:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _drop_torn_tail(self.path)
            return self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot record to {str(self.path)!r}: {exc}") from exc

    def _restart(self, started_at: float) -> None:
        """Begin a self-contained recording: the next round writes a header first."""
        self.started_at = started_at
        self._done_total: dict[str, int] = {}
        self._ledgers: dict[str, ArrivalLedger] = {}
        self._described: dict[str, QueuePolicy] = {}
        self._header_written = False

    def record(self, state: ClusterState, now: float) -> None:
        """Write this round as ``state`` saw it (the caller holds the state's lock)."""
        self.write(state.observation(self.last_round_at, now), now)

    def write(self, observation: RoundObservation, now: float) -> None:
        """Write a round observed at ``now`` (since :attr:`last_round_at`); a failing disk
        is logged, never a reason to stop planning."""
        self.last_round_at = now
        try:
            self._write_round(observation, now)
        except OSError as exc:
            logger.warning("recording to %s failed: %s", self.path, exc)

    def close(self) -> None:
        self._file.close()

    def _write_round(self, observation: RoundObservation, now: float) -> None:
        if not self._header_written and not observation.hosts:
            return  # nothing reported yet: the header waits for the policies masters send
        if not self._header_written:
            self._write(self._header(observation))
            self._header_written = True
        self._write(self._round(observation, now))
        if os.fstat(self._file.fileno()).st_size >= self.max_bytes:
            self._rotate(now)

    def _header(self, observation: RoundObservation) -> RecordHeader:
        self._described = dict(observation.policies)
        return RecordHeader(
            started_at=self.started_at, interval_s=self.interval_s,
            target_utilization=self.target_utilization, queues=observation.policies,
            hosts={name: HeaderHost(slots=capacity)
                   for name, (capacity, alive) in observation.hosts.items() if alive},
        )

    def _round(self, observation: RoundObservation, now: float) -> RecordRound:
        queues = {}
        for name, seen in observation.queues.items():
            queues[name] = RoundQueue(
                arrived=self._arrivals(name, seen), done=seen.processed,
                backlog=seen.backlog, slots=seen.running,
                mean_job_s=_short(seen.busy_s / seen.processed) if seen.processed else None,
                batches=seen.batches, batch_s=_precise(seen.batch_s),
            )
        new_policies = {name: policy for name, policy in observation.policies.items()
                        if self._described.get(name) != policy}
        self._described.update(new_policies)
        return RecordRound(
            # a wall clock stepped back past the start: the round is at the start
            t_s=max(0.0, now - self.started_at), queues=queues, policies=new_policies,
            hosts={name: RoundHost(slots=capacity, alive=alive)
                   for name, (capacity, alive) in observation.hosts.items()},
        )

    def _arrivals(self, name: str, seen: QueueObservation) -> int:
        """Jobs enqueued since the last round: every job done in the recording plus every job
        in the broker now, less the arrivals already written (a shortfall is carried)."""
        done = self._done_total[name] = self._done_total.get(name, 0) + seen.processed
        # A ledger at 0, not None: the recording's first round counts the jobs found.
        ledger = self._ledgers.setdefault(name, ArrivalLedger(ledger=0))
        count = ledger.count(seen.backlog + seen.locked, done, missing=0.0)
        return count.jobs if count is not None else 0  # never None: the ledger has a start

    def _write(self, line: RecordLine) -> None:
        self._file.write(dump_record_line(line) + "\n")
        self._file.flush()  # a crash loses at most the line being written

    def _rotate(self, now: float) -> None:
        """Keep the file bounded: it becomes FILE.1 (replacing an older one), a new one starts."""
        self._file.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._file = self._open()
        self._restart(now)
        logger.info("recording %s passed %d bytes: moved to %s.1", self.path, self.max_bytes,
                    self.path.name)


def _drop_torn_tail(path: Path, chunk: int = 1 << 16) -> None:
    """Cut a line a crash left half-written, so the next header starts on a line of its own."""
    if not path.exists():
        return
    with path.open("rb+") as file:
        end = file.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - chunk)
            file.seek(start)
            block = file.read(position - start)
            if position == end and block.endswith(b"\n"):
                return  # whole lines only
            newline = block.rfind(b"\n")
            if newline >= 0:
                file.truncate(start + newline + 1)
                return
            position = start
        file.truncate(0)


def _short(seconds: float) -> float:
    """Four significant digits: plenty for a mean, a shorter line, and never rounded to 0."""
    return float(f"{seconds:.4g}")


def _precise(seconds: float) -> float:
    """Seven significant digits: a replay subtracts the handler's seconds from it, and the
    difference is a few percent of it."""
    return float(f"{seconds:.7g}")


def recorder_for(settings: ManagerSettings, started_at: float) -> Recorder | None:
    """The recorder ``[manager] record`` / ``--record`` asks for, or None."""
    if settings.record is None:
        return None
    logger.info("recording each planning round to %s", settings.record)
    return Recorder(settings.record, settings.interval_s, started_at,
                    max_bytes=int(settings.record_max_mb * (1 << 20)),
                    target_utilization=settings.target_utilization)

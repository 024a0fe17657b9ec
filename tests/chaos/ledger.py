"""A Jepsen-style ledger: who asked for which job, who ran it, and what that adds up to.

Every job of a chaos row carries a unique ``job_id`` in its payload (``s{seed}-{n}``).
The producer records each *attempted* enqueue before the call and each *acknowledged*
one after the call returned (:class:`Producer`). Handlers, in many forked slot processes,
record a ``start`` line before the work and a ``finish`` line after it (:func:`record`),
plus an ``abort`` line just before a deliberate failure (a poison job raising, exiting or
segfaulting), so that a deliberate failed attempt is not mistaken for a duplicate.

Every line is one JSON object appended with ``O_APPEND`` in a single ``write`` to a file
of the writing process (``<role>-<pid>.jsonl``) in the directory named by
``QC_CHAOS_LEDGER``: no locks, and a process killed mid-batch leaves whole lines (a torn
last line, should one ever appear, is skipped and counted in ``torn_lines``).

Line fields: ``e`` event (attempt, ack, error, start, finish, abort), ``id`` job id,
``q`` queue, ``m`` time.monotonic() (system-wide on Linux), ``t`` time.time(),
``a`` the job's attempt number (handlers), ``pid``, ``d`` delay in seconds (attempt),
``k`` kind (abort: raise, exit, segv, ...; error: the exception's type).

:meth:`Ledger.report` adds it up:

- ``attempted`` / ``acknowledged``: ids the producer tried / whose enqueue returned;
- ``completed``: ids with at least one ``finish``;
- ``lost`` = acknowledged - (completed | dead-lettered): the number every row wants 0;
- ``unexpected``: ids that ran (start or finish) but were never attempted;
- ``dup_exec``: executions (starts) beyond one per id, not counting attempts that ended in
  a recorded deliberate failure (``abort``): what faults cost in re-runs;
- ``dup_finished``: finishes beyond one per id (the work ran to its end twice);
- ``recovered``: ids with an execution that never finished nor aborted (its process died
  or was killed) and a later execution that finished; ``recovery_s`` per such id is the
  time from the interrupted start to the start of the run that finished;
- ``early``: ids whose first start came before their enqueue time plus delay (the time is
  taken before the enqueue call: a start earlier than that is certainly early);
- latency (first finish - max(ack, activation)), throughput (finishes per second).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEDGER_ENV = "QC_CHAOS_LEDGER"
#: Payload key carrying the ledger's job id.
JOB_ID = "job_id"
#: Handler events that describe one execution of a job.
RUN_EVENTS = ("start", "finish", "abort")
#: Brokers keep activation times in whole milliseconds: a start within this of the
#: requested time is not early.
EARLY_TOLERANCE_S = 0.001


def now() -> tuple[float, float]:
    return time.monotonic(), time.time()


def append_lines(directory: str | Path, role: str, lines: Iterable[dict[str, Any]]) -> None:
    """Append ``lines`` to this process's ledger file in one ``write`` (atomic append)."""
    data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
    if not data:
        return
    path = os.path.join(directory, f"{role}-{os.getpid()}.jsonl")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def record(event: str, jobs: Sequence[Any], *, kind: str = "",
           directory: str | None = None) -> None:
    """Handler side: one ``event`` line per job (``qcluster.Job`` objects), one write.

    The directory is ``QC_CHAOS_LEDGER`` unless given; without either, nothing is written
    (the app imported outside a chaos row).
    """
    directory = directory or os.environ.get(LEDGER_ENV)
    if not directory:
        return
    mono, wall = now()
    pid = os.getpid()
    lines = []
    for job in jobs:
        payload = job.payload if isinstance(job.payload, dict) else {}
        line: dict[str, Any] = {"e": event, "id": str(payload.get(JOB_ID, job.id)),
                                "q": job.queue, "a": job.attempts, "pid": pid,
                                "m": mono, "t": wall}
        if kind:
            line["k"] = kind
        lines.append(line)
    append_lines(directory, "h", lines)


class Producer:
    """Enqueues jobs with unique ids through a :class:`qcluster.Client`, recording each
    attempted and each acknowledged enqueue in the ledger directory.

    Ids are ``s{seed}-{tag}{n}``; give each producer of one row its own ``tag``.
    """

    def __init__(self, client: Any, directory: str | Path, *, seed: int, tag: str = "",
                 chunk: int = 200) -> None:
        self.client = client
        self.directory = Path(directory)
        self.prefix = f"s{seed}-{tag}"
        self.chunk = chunk
        self.next_n = 0
        self.errors: list[str] = []

    def new_ids(self, count: int) -> list[str]:
        ids = [f"{self.prefix}{n}" for n in range(self.next_n, self.next_n + count)]
        self.next_n += count
        return ids

    def enqueue(self, queue: str, count: int = 1, *, delay: float = 0.0,
                fields: dict[str, Any] | None = None, raise_errors: bool = True) -> list[str]:
        """Enqueue ``count`` jobs (payload ``{job_id, **fields}``) in chunks; returns the
        acknowledged ids. An enqueue error is recorded (``error`` lines), then raised
        unless ``raise_errors`` is false (a producer that keeps going through a fault)."""
        acked: list[str] = []
        ids = self.new_ids(count)
        for start in range(0, len(ids), self.chunk):
            acked += self.enqueue_ids(queue, ids[start:start + self.chunk], delay=delay,
                                      fields=fields, raise_errors=raise_errors)
        return acked

    def enqueue_ids(self, queue: str, ids: Sequence[str], *, delay: float = 0.0,
                    fields: dict[str, Any] | None = None,
                    raise_errors: bool = True) -> list[str]:
        """One ``enqueue_many`` call for ``ids`` (already unique), recorded."""
        extra = fields or {}
        mono, wall = now()
        append_lines(self.directory, "p", ({"e": "attempt", "id": job_id, "q": queue, "m": mono,
                                            "t": wall, "d": delay} for job_id in ids))
        try:
            self.client.enqueue_many(queue, [{JOB_ID: job_id, **extra} for job_id in ids],
                                     delay=delay)
        except Exception as exc:
            mono, wall = now()
            append_lines(self.directory, "p", ({"e": "error", "id": job_id, "q": queue,
                                                "m": mono, "t": wall, "k": type(exc).__name__}
                                               for job_id in ids))
            self.errors.append(f"{type(exc).__name__}: {exc}")
            if raise_errors:
                raise
            return []
        mono, wall = now()
        append_lines(self.directory, "p", ({"e": "ack", "id": job_id, "q": queue, "m": mono,
                                            "t": wall} for job_id in ids))
        return list(ids)


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile (``fraction`` 0.99 for p99); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Run:
    """One execution of a job: its start, and how it ended (finish, abort, or neither)."""

    pid: int
    attempt: int
    start_m: float
    end: str = ""  # "finish", "abort" or "" (interrupted)
    end_m: float | None = None


@dataclass
class LedgerReport:
    attempted: int
    acknowledged: int
    completed: int
    dead: int
    lost: int
    unexpected: int
    dup_exec: int
    dup_finished: int
    recovered: int
    early: int
    errors: int
    torn_lines: int
    recovery_p99_s: float | None
    p99_latency_s: float | None
    throughput_jobs_s: float | None
    lost_ids: list[str] = field(default_factory=list)
    unexpected_ids: list[str] = field(default_factory=list)
    early_ids: list[str] = field(default_factory=list)
    dup_ids: list[str] = field(default_factory=list)

    def summary(self) -> str:
        def sample(ids: list[str]) -> str:
            return f" e.g. {ids[:5]}" if ids else ""

        return (f"attempted {self.attempted}, acknowledged {self.acknowledged}, completed "
                f"{self.completed}, dead {self.dead}, lost {self.lost}{sample(self.lost_ids)}, "
                f"unexpected {self.unexpected}{sample(self.unexpected_ids)}, dup_exec "
                f"{self.dup_exec}{sample(self.dup_ids)}, early {self.early}"
                f"{sample(self.early_ids)}, recovered {self.recovered}")


class Ledger:
    """Reads every ledger file of a directory (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.torn_lines = 0
        self.attempts: dict[str, dict[str, Any]] = {}  # id -> first attempt line
        self.acks: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, list[Run]] = defaultdict(list)
        self.finishes: dict[str, list[float]] = defaultdict(list)
        self.finish_walls: dict[str, list[float]] = defaultdict(list)
        self.lines: list[dict[str, Any]] = []
        self.reload()

    def reload(self) -> Ledger:
        self.torn_lines = 0
        self.lines = []
        for path in sorted(self.directory.glob("*.jsonl")):
            for raw in path.read_bytes().splitlines():
                try:
                    line = json.loads(raw)
                except ValueError:
                    self.torn_lines += 1
                    continue
                if isinstance(line, dict) and "e" in line and "id" in line:
                    self.lines.append(line)
                else:
                    self.torn_lines += 1
        self._index()
        return self

    def _index(self) -> None:
        self.attempts, self.acks, self.errors = {}, {}, {}
        self.runs = defaultdict(list)
        self.finishes = defaultdict(list)
        self.finish_walls = defaultdict(list)
        handler_lines = []
        for line in self.lines:
            event, job_id = line["e"], str(line["id"])
            if event == "attempt":
                self.attempts.setdefault(job_id, line)
            elif event == "ack":
                self.acks.setdefault(job_id, line)
            elif event == "error":
                self.errors.setdefault(job_id, line)
            elif event in RUN_EVENTS:
                handler_lines.append(line)
        # A run is a start and the next finish/abort of the same id, attempt and pid.
        handler_lines.sort(key=lambda line: line["m"])
        open_runs: dict[tuple[str, int, int], Run] = {}
        for line in handler_lines:
            job_id = str(line["id"])
            key = (job_id, int(line.get("a", 0)), int(line.get("pid", 0)))
            if line["e"] == "start":
                run = Run(pid=key[2], attempt=key[1], start_m=float(line["m"]))
                self.runs[job_id].append(run)
                open_runs[key] = run
                continue
            if line["e"] == "finish":
                self.finishes[job_id].append(float(line["m"]))
                self.finish_walls[job_id].append(float(line.get("t", 0.0)))
            ended = open_runs.pop(key, None)
            if ended is not None:
                ended.end, ended.end_m = line["e"], float(line["m"])

    # --- questions a row asks ---------------------------------------------------------

    def completed_ids(self) -> set[str]:
        return {job_id for job_id, times in self.finishes.items() if times}

    def started_ids(self) -> set[str]:
        return {job_id for job_id, runs in self.runs.items() if runs}

    def executions(self, job_id: str) -> int:
        return len(self.runs.get(job_id, []))

    def finished_count(self) -> int:
        return sum(len(times) for times in self.finishes.values())

    def throughput(self, since_m: float | None = None, until_m: float | None = None) -> float:
        """Finishes per second between two monotonic times (default: the first start to the
        last finish); first finishes only, so a duplicate does not count as work."""
        firsts = [min(times) for times in self.finishes.values() if times]
        starts = [run.start_m for runs in self.runs.values() for run in runs]
        if not firsts:
            return 0.0
        begin = since_m if since_m is not None else min(starts or firsts)
        end = until_m if until_m is not None else max(firsts)
        if end <= begin:
            return 0.0
        return sum(1 for t in firsts if begin <= t <= end) / (end - begin)

    def report(self, dead_ids: Iterable[str] = ()) -> LedgerReport:
        """The row's arithmetic; ``dead_ids``: ledger ids found dead-lettered on the broker
        (see :func:`tests.chaos.rows.dead_ledger_ids`)."""
        dead = set(dead_ids)
        attempted, acked = set(self.attempts), set(self.acks)
        completed = self.completed_ids()
        ran = completed | self.started_ids()
        lost = sorted(acked - (completed | dead))
        unexpected = sorted(ran - attempted)
        dup_exec, dup_ids, recovery, early = 0, [], [], []
        for job_id, runs in self.runs.items():
            counted = sum(1 for run in runs if run.end != "abort")
            if counted > 1:
                dup_exec += counted - 1
                dup_ids.append(job_id)
            interrupted = [run for run in runs if not run.end]
            finished = [run for run in runs if run.end == "finish"]
            if interrupted and finished:
                first_cut = min(run.start_m for run in interrupted)
                later = [run.start_m for run in finished if run.start_m > first_cut]
                if later:
                    recovery.append(min(later) - first_cut)
            attempt = self.attempts.get(job_id)
            if attempt is not None and runs:
                not_before = (float(attempt["m"]) + float(attempt.get("d", 0.0))
                              - EARLY_TOLERANCE_S)
                if min(run.start_m for run in runs) < not_before:
                    early.append(job_id)
        dup_finished = sum(max(0, len(times) - 1) for times in self.finishes.values())
        latencies = []
        for job_id in completed & acked:
            attempt, ack = self.attempts.get(job_id), self.acks[job_id]
            ready_m = float(ack["m"])
            if attempt is not None:
                ready_m = max(ready_m, float(attempt["m"]) + float(attempt.get("d", 0.0)))
            latencies.append(max(0.0, min(self.finishes[job_id]) - ready_m))
        return LedgerReport(
            attempted=len(attempted), acknowledged=len(acked), completed=len(completed),
            dead=len(dead), lost=len(lost), unexpected=len(unexpected), dup_exec=dup_exec,
            dup_finished=dup_finished, recovered=len(recovery), early=len(early),
            errors=len(self.errors), torn_lines=self.torn_lines,
            recovery_p99_s=_rounded(percentile(recovery, 0.99)),
            p99_latency_s=_rounded(percentile(latencies, 0.99)),
            throughput_jobs_s=_rounded(self.throughput()) if completed else None,
            lost_ids=lost, unexpected_ids=unexpected, early_ids=sorted(early),
            dup_ids=sorted(dup_ids),
        )


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


# --- the broker's side: dead letters and residue -----------------------------------------


def ledger_id_of(body: str) -> str | None:
    """The ledger id inside a stored message (an envelope whose payload has ``job_id``)."""
    try:
        envelope = json.loads(body)
    except (ValueError, RecursionError):  # malformed, or nested deeper than json can parse
        return None
    payload = envelope.get("payload") if isinstance(envelope, dict) else None
    if isinstance(payload, dict) and JOB_ID in payload:
        return str(payload[JOB_ID])
    return None


def dead_letters(broker: Any, queues: Iterable[str], limit: int = 100_000) -> dict[str, Any]:
    """Ledger id -> :class:`qcluster.broker.DeadJob` for every dead letter of ``queues``
    that carries a ledger id (a dead letter without one is keyed by its broker id,
    prefixed ``broker:``)."""
    found: dict[str, Any] = {}
    for queue in queues:
        for dead in broker.dead_jobs(queue, limit=limit):
            found[ledger_id_of(dead.body) or f"broker:{dead.id}"] = dead
    return found


def residue(broker: Any, queues: Iterable[str], *,
            allowed_dead: Iterable[str] = ()) -> dict[str, int]:
    """What is left on the broker after a drain; every value must be 0.

    ``ready``, ``locked``, ``delayed``: the queues' counts (on RabbitMQ ``locked`` only
    sees this process's deliveries: stop the slots first, their unacked jobs come back as
    ready). ``dead``: dead letters whose ledger id is not in ``allowed_dead``. ``keys``
    (Redis): job bodies, attempt counts and reasons kept for jobs that are neither
    ready, locked, delayed nor dead, and keys of the queue that the broker does not know
    (finished-job records, kept for ``keep_finished_s`` and expiring by themselves, are
    not residue).
    """
    allowed = set(allowed_dead)
    totals = {"ready": 0, "locked": 0, "delayed": 0, "dead": 0, "keys": 0}
    queues = list(queues)
    for queue in queues:
        stats = broker.stats(queue)
        totals["ready"] += stats.ready
        totals["locked"] += stats.locked
        totals["delayed"] += stats.delayed
    totals["dead"] = sum(1 for job_id in dead_letters(broker, queues) if job_id not in allowed)
    redis_client = getattr(broker, "client", None)
    if redis_client is not None and hasattr(redis_client, "zcard"):
        for queue in queues:
            totals["keys"] += _redis_leftovers(redis_client, queue)
    return totals


def _redis_leftovers(client: Any, queue: str) -> int:
    from qcluster.broker.redis_broker import _keys

    keys = _keys(queue)
    live = set(client.zrange(keys["ready"], 0, -1)) | set(client.zrange(keys["locked"], 0, -1))
    dead = set(client.zrange(keys["dead"], 0, -1))
    leftover = 0
    for name in ("jobs", "attempts"):
        leftover += sum(1 for job_id in client.hkeys(keys[name])
                        if job_id not in live and job_id not in dead)
    leftover += sum(1 for job_id in client.hkeys(keys["reasons"]) if job_id not in dead)
    known = {key.encode() for key in keys.values()}
    # Finished-job records (keep_finished_s) are kept on purpose and expire by themselves;
    # so do take records (take.lua: one per broker, for a retry whose reply was lost).
    expiring = (f"{keys['finished']}:".encode(), f"qc:{{{queue}}}:taken:".encode())
    leftover += sum(1 for key in client.scan_iter(match=f"qc:{{{queue}}}:*", count=1000)
                    if key not in known and not key.startswith(expiring))
    return leftover

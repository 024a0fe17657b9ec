"""Job lookup, job listings and dead letters by id on Redis (the embedded broker too).

A queue's keys say where each job is: the lock set (running: its score is the lock's
expiry), the ready set (its score is when it becomes ready: later than now is delayed, or
retrying when an earlier take failed), the dead set (with its reason), and a finished
record in the queue's time buckets (see settle.lua). The last error of a retried or
dead-lettered job sits in the queue's ``errors`` hash. Each lookup is one script per queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from qcluster.broker.base import DeadJob
from qcluster.failures import JobError
from qcluster.jobs import (
    MAX_PAGE,
    JobInfo,
    JobPage,
    JobState,
    enqueued_at_of,
    payload_of,
)

if TYPE_CHECKING:
    from qcluster.broker.redis_broker import RedisBroker

#: Delayed and retrying jobs share the ready set: a listing of one of them reads at most
#: this many of the set's future entries to fill its page.
SCAN_LIMIT = 10_000
#: Finished records read per round trip when a lookup searches them.
FINISHED_CHUNK = 2_000
#: The lock set's marker member (take.lua) has this score; it is never a job.
_MARKER_SCORE = "(+inf"


def lookup(broker: RedisBroker, keys_of: Any, job_id: str,
           queues: Sequence[str] | None = None) -> JobInfo | None:
    """Where ``job_id`` is: in ``queues``, else in every queue the broker knows."""
    for name in broker.queues() if queues is None else queues:
        k = keys_of(name)
        reply = broker._run("job", [k["ready"], k["locked"], k["jobs"], k["attempts"],
                                    k["dead"], k["reasons"], k["errors"]], [job_id])
        found = _info(name, job_id, reply)
        if found is None and not decoded(reply[1]):
            found = _finished(broker, k["finished"], name, job_id)
        if found is not None:
            return found
    return None


def _finished(broker: RedisBroker, index: str, queue: str, job_id: str) -> JobInfo | None:
    """The job's finished record: the live buckets' lists searched newest first, a chunk
    per round trip (a lookup never holds the server for long)."""
    needle = f",{job_id},".encode("utf-8", "surrogateescape")
    with broker._errors():
        names = cast(list[bytes], broker.client.hkeys(index))
        buckets = sorted(names, key=_bucket_order, reverse=True)
        for bucket in buckets:
            end = -1
            while True:
                chunk = cast(list[bytes], broker.client.lrange(
                    bucket, end - FINISHED_CHUNK + 1, end))
                for entry in reversed(chunk):
                    if needle in entry:
                        return _finished_info(queue, job_id, entry)
                if len(chunk) < FINISHED_CHUNK:
                    break
                end -= FINISHED_CHUNK
    return None


def _bucket_order(bucket: bytes) -> int:
    """A bucket's start (ms): ``...:finished:WIDTH:INDEX``."""
    width, index = bucket.rsplit(b":", 2)[-2:]
    return int_or_zero(width) * int_or_zero(index)


def _finished_info(queue: str, job_id: str, entry: bytes) -> JobInfo:
    head = entry.split(b":", 1)[0].split(b" ")
    done, taken = float(head[0]) / 1000, float(head[1]) / 1000
    return JobInfo(id=job_id, queue=queue, state="finished", since=done, finished_at=done,
                   started_at=taken, duration_s=max(0.0, done - taken),
                   attempts=int_or_zero(head[2]) or None)


def _info(queue: str, job_id: str, reply: list[Any]) -> JobInfo | None:
    now_ms, where, score, body, tries, reason, error = reply
    now_s = int(now_ms) / 1000
    past = abs(int_or_zero(tries))
    last_error = JobError.from_json(error)
    common: dict[str, Any] = {"id": job_id, "queue": queue, "payload": payload_of(body),
                              "last_error": last_error}
    where = decoded(where)
    if where == "locked":
        if float(score) <= now_ms:
            return JobInfo(state="ready", since=float(score) / 1000, attempts=past + 1,
                           note="its last take's lock expired (its slot died or hung): it "
                                "is ready again and counted as an attempt", **common)
        return JobInfo(state="running", attempts=past + 1, lock_token=int(float(score)),
                       **common)
    if where == "dead":
        return JobInfo(state="dead", since=float(score) / 1000, attempts=past,
                       reason=decoded(reason), **common)
    if where == "ready":
        at = float(score) / 1000
        if at <= now_s:
            return JobInfo(state="ready", since=enqueued_at_of(body) if not past else None,
                           attempts=past, **common)
        state: JobState = "retrying" if past or last_error else "delayed"
        return JobInfo(state=state, next_run_at=at, attempts=past,
                       since=enqueued_at_of(body) if state == "delayed" else None, **common)
    if body:  # stored but in no set: a publish or settle between two of its steps
        return JobInfo(state="ready", attempts=past, **common)
    return None


def dead_page(broker: RedisBroker, keys_of: Any, queue: str, *, offset: int,
              limit: int) -> tuple[int, list[DeadJob]]:
    """ZCARD and a ZREVRANGE slice: O(log n + limit) whatever the store's size."""
    k = keys_of(queue)
    offset, limit = max(0, offset), max(0, min(limit, 100_000))
    with broker._errors():
        pipe = broker.client.pipeline(transaction=False)
        pipe.zcard(k["dead"])
        pipe.zrevrange(k["dead"], offset, offset + limit - 1, withscores=True)
        total, entries = pipe.execute() if limit else (broker.client.zcard(k["dead"]), [])
        if not entries:
            return int(total), []
        ids = [job_id for job_id, _ in entries]
        pipe = broker.client.pipeline(transaction=False)
        for name in ("jobs", "reasons", "attempts", "errors"):
            pipe.hmget(k[name], ids)
        bodies, reasons, attempts, errors = pipe.execute()
    return int(total), [
        DeadJob(id=decoded(job_id), queue=queue, body=decoded(body or b""),
                reason=decoded(reason or b""), attempts=abs(int_or_zero(tries)),
                dead_at=score / 1000, error=JobError.from_json(error))
        for (job_id, score), body, reason, tries, error in zip(
            entries, bodies, reasons, attempts, errors, strict=True)
    ]


def dead_by_ids(broker: RedisBroker, keys_of: Any, queue: str, action: str,
                ids: Sequence[str]) -> int:
    """Requeue or delete the dead letters ``ids``, in chunks of one script each."""
    k = keys_of(queue)
    keys = [k["ready"], k["jobs"], k["attempts"], k["dead"], k["reasons"], k["errors"],
            k["wake"]]
    moved = 0
    for start in range(0, len(ids), 1000):
        moved += int(broker._run("dead_ids", keys, [action, *ids[start:start + 1000]]))
    return moved


def job_page(broker: RedisBroker, keys_of: Any, queue: str, state: str, *, offset: int,
             limit: int) -> JobPage:
    """A page of the queue's running, delayed, retrying or dead jobs."""
    offset, limit = max(0, offset), max(0, min(limit, MAX_PAGE))
    if state == "dead":
        total, dead = dead_page(broker, keys_of, queue, offset=offset, limit=limit)
        return JobPage(queue=queue, state=state, total=total, offset=offset, limit=limit,
                       jobs=[JobInfo.of_dead(one) for one in dead])
    if state == "running":
        return _running(broker, keys_of(queue), queue, offset, limit)
    return _waiting(broker, keys_of(queue), queue, state, offset, limit)


def _running(broker: RedisBroker, k: dict[str, str], queue: str, offset: int,
             limit: int) -> JobPage:
    with broker._errors():
        now_ms = _now_ms(broker)
        pipe = broker.client.pipeline(transaction=False)
        pipe.zcount(k["locked"], f"({now_ms}", _MARKER_SCORE)
        pipe.zrangebyscore(k["locked"], f"({now_ms}", _MARKER_SCORE, start=offset, num=limit,
                           withscores=True)
        total, entries = pipe.execute()
        details = _details(broker, k, [job_id for job_id, _ in entries])
    jobs = [JobInfo(id=decoded(job_id), queue=queue, state="running",
                    attempts=abs(int_or_zero(tries)) + 1,
                    payload=payload_of(body), last_error=JobError.from_json(err),
                    lock_token=int(score))
            for (job_id, score), (body, tries, err) in zip(entries, details, strict=True)]
    return JobPage(queue=queue, state="running", total=int(total), offset=offset, limit=limit,
                   jobs=jobs)


def _waiting(broker: RedisBroker, k: dict[str, str], queue: str, state: str, offset: int,
             limit: int) -> JobPage:
    """Delayed (never failed) or retrying jobs: the ready set's future part, filtered."""
    found: list[JobInfo] = []
    skipped, scanned = 0, 0
    with broker._errors():
        now_ms = _now_ms(broker)
        while scanned < SCAN_LIMIT and len(found) < limit:
            chunk = cast(list[tuple[bytes, float]], broker.client.zrangebyscore(
                k["ready"], f"({now_ms}", "+inf", start=scanned, num=1000, withscores=True))
            if not chunk:
                break
            scanned += len(chunk)
            details = _details(broker, k, [job_id for job_id, _ in chunk])
            for (job_id, score), (body, tries, err) in zip(chunk, details, strict=True):
                error = JobError.from_json(err)
                past = abs(int_or_zero(tries))
                kind: JobState = "retrying" if past or error else "delayed"
                if kind != state:
                    continue
                if skipped < offset:
                    skipped += 1
                    continue
                if len(found) < limit:
                    found.append(JobInfo(id=decoded(job_id), queue=queue, state=kind,
                                         next_run_at=score / 1000, attempts=past,
                                         payload=payload_of(body), last_error=error))
    note = (f"only the first {SCAN_LIMIT:,} waiting jobs were read"
            if scanned >= SCAN_LIMIT else None)
    return JobPage(queue=queue, state=state, total=None, offset=offset, limit=limit,
                   jobs=found, note=note)


def _details(broker: RedisBroker, k: dict[str, str], ids: list[Any]) -> list[tuple[Any, ...]]:
    if not ids:
        return []
    pipe = broker.client.pipeline(transaction=False)
    for name in ("jobs", "attempts", "errors"):
        pipe.hmget(k[name], ids)
    bodies, attempts, errors = pipe.execute()
    return list(zip(bodies, attempts, errors, strict=True))


def _now_ms(broker: RedisBroker) -> int:
    seconds, micros = broker.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def int_or_zero(value: Any) -> int:
    """A stored count (bytes, text or None) as a number; 0 when it is not one."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def decoded(value: Any) -> str:
    """A stored value as text (a damaged byte is replaced, never raised on)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

"""The Redis Lua scripts (``qcluster/broker/lua/``): loading them, the arguments the
broker sends them and the replies it reads back.

Every script is a file of ``lua/``; a script that calls others gets them as local
functions (:func:`compose`): ``settle_take`` calls settle.lua and take.lua, ``tick``
calls publish.lua.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Sequence
from importlib import resources
from typing import Any

from qcluster.broker.base import DeadRetention, Settlement
from qcluster.broker.redis_jobs import int_or_zero
from qcluster.job import JSON_CONTENT_TYPE, MAX_DELAY_S, Delivery
from qcluster.policy import FINISHED_MAX_COUNT

#: Each script and the scripts it calls as functions (see compose).
SCRIPTS: dict[str, tuple[str, ...]] = {
    "take": (), "settle": (), "publish": (), "stats": (), "requeue_dead": (), "purge": (),
    "job": (), "dead_ids": (), "raise_tick": (),
    "settle_take": ("settle", "take"), "tick": ("publish",),
}


def load(name: str) -> str:
    """The source of ``lua/NAME.lua``."""
    return resources.files("qcluster.broker").joinpath("lua", f"{name}.lua").read_text()


@functools.cache  # made once per process: a slot gets its master's (see slot/prefork.py)
def compose(name: str) -> str:
    """The script ``name`` with each script it calls defined before it as a local
    function ``CALLED(KEYS, ARGV)``."""
    functions = "".join(f"local function {called}(KEYS, ARGV)\n{load(called)}\nend\n"
                        for called in SCRIPTS[name])
    return functions + load(name)


# --- take tokens --------------------------------------------------------------------

#: Take tokens: this process's random prefix, then a count (see take_token).
_token_prefix = ""
_token_count = itertools.count()


def _new_token_prefix() -> None:
    global _token_prefix
    _token_prefix = os.urandom(8).hex() + ":"


_new_token_prefix()
# A child of fork() counts from where its parent stood: its own prefix keeps its tokens
# apart from the parent's, which may present the same counts.
os.register_at_fork(after_in_child=_new_token_prefix)


def take_token() -> str:
    """A token no other take presents: take.lua hands a retry with it the jobs that take
    locked (its reply was lost) instead of new ones."""
    return f"{_token_prefix}{next(_token_count)}"


# --- settle.lua's arguments ------------------------------------------------------------


def settle_args(settlement: Settlement, retention: DeadRetention) -> list[Any]:
    """settle.lua's ARGV: every section's count first, then the sections in that order."""
    errors = settlement.errors
    finished = finished_args(settlement.ack, retention)
    args: list[Any] = [
        len(settlement.ack), len(settlement.postpone), len(settlement.dead),
        len(settlement.release), len(settlement.crashed), len(settlement.refused),
        len(settlement.ack_held), len(errors), retention.max_count, retention.max_age_ms,
        *(finished[:3] if finished else (0, 0, 0)),
    ]
    args += [d.id for d in settlement.ack]
    for delivery, delay_s in settlement.postpone:
        args += (wire_id(delivery.id), delivery.receipt, delay_ms(delay_s))
    for delivery, reason in settlement.dead:
        args += (wire_id(delivery.id), delivery.receipt, str(reason))
    for delivery in settlement.release:
        args += (wire_id(delivery.id), delivery.receipt, _activate_ms(delivery.activate_at))
    for delivery in settlement.crashed:
        args += (wire_id(delivery.id), delivery.receipt)
    for delivery, reason in settlement.refused:
        args += (wire_id(delivery.id), delivery.receipt, str(reason))
    for delivery in settlement.ack_held:
        args += (wire_id(delivery.id), delivery.receipt)
    if errors:
        texts: dict[int, str] = {}  # a batch that failed as one shares one error: encoded once
        for job_id, error in errors.items():
            text = texts.get(id(error))
            if text is None:
                text = texts[id(error)] = error.to_json()
            args += (wire_id(job_id), text)
    return args + finished[3:]


def finished_args(acks: Sequence[Delivery], retention: DeadRetention) -> list[Any]:
    """settle.lua's finished section: keep_finished_ms, finished_cap, n_runs, then the
    acks' takes and attempts, run-length encoded (one run for a batch of one take whose
    jobs never failed); empty when the queue keeps no finished records."""
    keep = retention.keep_finished_s
    if keep <= 0 or not acks:
        return []
    runs: list[Any] = []
    last: tuple[float, int] | None = None
    count = 0
    for delivery in acks:
        key = (delivery.taken_at, delivery.attempts)
        if key != last:
            if last is not None:
                runs += (round(last[0] * 1000), last[1], count)
            last, count = key, 0
        count += 1
    assert last is not None
    runs += (round(last[0] * 1000), last[1], count)
    return [round(keep * 1000), FINISHED_MAX_COUNT // 8, len(runs) // 3, *runs]


def wire_id(job_id: str) -> bytes:
    """The id's stored bytes: an id that was not UTF-8 was read with surrogateescape
    (see _careful_deliveries) and goes back as the same bytes. Acks skip this (the hot
    path): a malformed job is never acked."""
    return job_id.encode("utf-8", "surrogateescape")


def delay_ms(delay_s: float) -> int:
    """Milliseconds for a delay, never raising: NaN is 0, the rest clamped to [0, 1 year].

    Producers and ``job.retry`` refuse bad delays with a clear error; this is the last
    line, so that one bad value can never make a settle (and the batch's acks) fail.
    """
    if delay_s != delay_s:  # NaN
        return 0
    return round(min(max(delay_s, 0.0), MAX_DELAY_S) * 1000)


def _activate_ms(activate_at: float) -> int:
    return round(activate_at * 1000) if activate_at == activate_at and activate_at < 1e15 else 0


# --- take.lua's reply -------------------------------------------------------------------


def deliveries(reply: list[Any]) -> list[Delivery]:
    """The take script's reply: now, lock_until, n_suspect, then (id, body, attempts,
    activate_ms) per job; a negative attempts marks a suspect job (see take.lua)."""
    now_s = int(reply[0]) / 1000
    lock_until = reply[1]
    try:
        # Positional arguments and one zip over the four columns: this runs once per job.
        taken = [
            Delivery(job_id.decode(), body, int(attempts), float(activate_ms) / 1000, now_s,
                     JSON_CONTENT_TYPE, lock_until)
            for job_id, body, attempts, activate_ms in zip(
                reply[3::4], reply[4::4], reply[5::4], reply[6::4], strict=True)
        ]
    except (UnicodeDecodeError, ValueError):
        taken = _careful_deliveries(reply)
    if reply[2]:
        for delivery in taken:
            if delivery.attempts < 0:
                delivery.attempts, delivery.suspect = -delivery.attempts, True
    return taken


def _careful_deliveries(reply: list[Any]) -> list[Delivery]:
    """The slow path for a take with a job that cannot be read: each such job becomes a
    delivery marked ``malformed`` (the slot dead-letters it) instead of failing the take
    and leaving every job of it locked, to fail again at the next take."""
    now_s = int(reply[0]) / 1000
    taken = []
    for job_id, body, attempts, activate_ms in zip(
            reply[3::4], reply[4::4], reply[5::4], reply[6::4], strict=True):
        problem = ""
        try:
            text_id = job_id.decode()
        except UnicodeDecodeError:
            # surrogateescape: wire_id turns it back into the same bytes when settling.
            text_id, problem = job_id.decode("utf-8", "surrogateescape"), "job id is not UTF-8"
        try:
            activate_s = float(activate_ms) / 1000
        except ValueError:
            activate_s, problem = now_s, problem or f"activation time {activate_ms!r}"
        taken.append(Delivery(
            text_id, body, int_or_zero(attempts), activate_s, now_s, JSON_CONTENT_TYPE,
            reply[1], malformed=f"malformed: {problem}" if problem else "",
        ))
    return taken

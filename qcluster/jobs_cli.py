"""``qcluster job ID``, ``qcluster dead QUEUE``, ``qcluster purge QUEUE`` and
``qcluster stats``: jobs and queues as the broker holds them.

Read-only commands never start the embedded broker (``open_existing_broker``). Exit codes:
0 done; 2 bad input (a queue name outside the rule, ``--delete`` without ids, ``purge``
without ``--yes`` off a terminal); 5 the broker does not answer; 15 ``job``: no queue holds
the job (nor a record of it); 1 ``purge`` declined at the prompt.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Column, Table

from qcluster import exitcodes
from qcluster.cli_support import (
    BrokerOpt,
    ConfigOpt,
    err,
    open_existing_broker,
    out,
    settings_for,
    user_errors,
)
from qcluster.cluster_identity import IDENTITY_KEY
from qcluster.config import DEFAULT_MANAGER_URL
from qcluster.controls import parse_stored, utc_text
from qcluster.jobs import JobInfo, payload_of
from qcluster.messages import ClusterClaim
from qcluster.names import check_job_id, check_queue_name, closest

#: ``qcluster job``: no queue holds the job, nor a record of it.
JOB_NOT_FOUND = 15
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output")]
QueueArg = Annotated[str, typer.Argument(help="Queue name")]


ManagerOpt = Annotated[str | None, typer.Option(
    "--manager", help="The manager's URL, for the host and slot of a running job (default: "
                      "$QCLUSTER_MANAGER_URL, config manager_url, http://127.0.0.1:7300)")]


def job(
    job_id: Annotated[str, typer.Argument(help="The job's id (as enqueue returned it)")],
    queue: Annotated[list[str] | None, typer.Option(
        "--queue", help="Look in this queue (repeatable; default: every queue the broker "
                        "and the config name)")] = None,
    as_json: JsonOpt = False, config: ConfigOpt = None, broker: BrokerOpt = None,
    manager: ManagerOpt = None,
) -> None:
    """Where a job is and since when: ready, delayed, running (on which host and slot, as
    the manager knows from its masters), retrying (with its last error), dead (with the
    reason and traceback) or finished (kept keep_finished_s)."""
    with user_errors():
        check_job_id(job_id)
    settings = settings_for(config, broker_url=broker, manager_url=manager)
    queue_broker = open_existing_broker(settings)
    with user_errors():
        try:
            names = [check_queue_name(name) for name in queue] if queue else sorted(
                set(queue_broker.queues()) | set(settings.queues))
            found = queue_broker.job(job_id, queues=names)
        finally:
            queue_broker.close()
    if found is None or found.state in ("running", "unknown"):
        found = _where_it_runs(job_id, found, settings.manager_url)
    if found is None:
        if as_json:
            unknown = JobInfo(id=job_id, state="unknown", note="no queue holds it")
            out.print_json(unknown.model_dump_json())
        if names:
            where = (f"in {', '.join(names)} (finished jobs are remembered for their queue's "
                     "keep_finished_s only)")
        else:  # nothing was searched: say why rather than "no such job"
            where = ("in any queue: no queue to look in (the broker lists none, RabbitMQ "
                     "cannot, and the configuration names none): name it with --queue QUEUE")
        err.print(escape(f"no job {job_id} {where}"), highlight=False)
        raise typer.Exit(JOB_NOT_FOUND)
    if as_json:
        out.print_json(found.model_dump_json())
        return
    for line in describe(found):
        out.print(escape(line), highlight=False, soft_wrap=True)


def _where_it_runs(job_id: str, found: JobInfo | None, manager_url: str | None) -> JobInfo | None:
    """The manager's answer, which adds the host and slot of a running job (its masters
    report them; RabbitMQ cannot say from the broker), else the broker's with why not."""
    from urllib.parse import quote

    import httpx

    url = (manager_url or DEFAULT_MANAGER_URL).rstrip("/")
    try:
        reply = httpx.get(f"{url}/api/v1/jobs/{quote(job_id, safe='')}", timeout=15.0)
        if reply.status_code == 404:
            return found
        reply.raise_for_status()
        return JobInfo.model_validate(reply.json())
    except (httpx.HTTPError, ValueError) as exc:
        if found is None:
            return None
        why = f"the manager at {url} did not answer ({type(exc).__name__}): no host or slot"
        return found.model_copy(update={"note": f"{found.note}; {why}" if found.note else why})


def describe(info: JobInfo) -> list[str]:
    """The lines ``qcluster job`` prints for one job."""
    lines = [f"job {info.id}", f"queue: {info.queue or '?'}", f"state: {info.state}"]
    facts = [("since", info.since), ("next run", info.next_run_at),
             ("started", info.started_at), ("finished", info.finished_at)]
    lines += [f"{name}: {utc_text(at)}" for name, at in facts if at is not None]
    if info.duration_s is not None:
        lines.append(f"ran for: {info.duration_s:.3f} s")
    if info.attempts is not None:
        lines.append(f"attempts: {info.attempts}")
    if info.host or info.slot:
        lines.append(f"on: {info.host or '?'} slot {info.slot or '?'}")
    if info.reason:
        lines.append(f"reason: {info.reason}")
    if info.payload is not None:
        lines.append(f"payload: {json.dumps(info.payload)[:400]}")
    error = info.last_error
    if error is not None:
        lines.append(f"last error: {error.type}: {error.message} (attempt {error.attempt} on "
                     f"{error.host} slot {error.slot}, {utc_text(error.at)})")
        lines += ["  " + line for line in error.traceback.rstrip().splitlines()]
    if info.note:
        lines.append(f"note: {info.note}")
    return lines


def dead(
    queue: QueueArg,
    ids: Annotated[list[str] | None, typer.Argument(
        help="With --requeue or --delete: the dead jobs to act on")] = None,
    requeue: Annotated[bool, typer.Option(
        "--requeue", help="Move the dead jobs IDS (none given: every one) back to ready")] = False,
    delete: Annotated[bool, typer.Option("--delete", help="Delete the dead jobs IDS")] = False,
    limit: Annotated[int, typer.Option(min=0, max=100_000, help="Show at most this many")] = 20,
    offset: Annotated[int, typer.Option(
        min=0, help="Skip this many (newest first; RabbitMQ: oldest first)")] = 0,
    as_json: JsonOpt = False, config: ConfigOpt = None, broker: BrokerOpt = None,
) -> None:
    """Show a queue's dead letters (newest first; RabbitMQ: oldest first) with each one's
    reason and last error, or requeue or delete them by id. (Any name is read as given:
    a queue whose name breaks today's rule still shows its dead letters.)"""
    if (requeue and delete) or (ids and not (requeue or delete)) or (delete and not ids):
        err.print("error: give IDS with --delete (and optionally with --requeue), and "
                  "--requeue or --delete with IDS", highlight=False)
        raise typer.Exit(exitcodes.USAGE)
    settings = settings_for(config, broker_url=broker)
    queue_broker = open_existing_broker(settings)
    with user_errors():
        try:
            if requeue or delete:
                _act(queue_broker, queue, ids or None, delete, as_json)
                return
            total, jobs = queue_broker.dead_page(queue, offset=offset, limit=limit)
            if not total:
                _warn_unknown(queue_broker, queue)
        finally:
            queue_broker.close()
    if as_json:
        body = {"queue": queue, "total": total, "offset": offset,
                "jobs": [{**job.model_dump(mode="json"), "payload": payload_of(job.body)}
                         for job in jobs]}
        out.print_json(json.dumps(body))
        return
    # The id whole, whatever the terminal's width: it is what --requeue, --delete and
    # `qcluster job` take; the other columns wrap around it.
    id_width = max((len(one.id) for one in jobs), default=2)
    table = Table(Column("id", no_wrap=True, min_width=id_width), "dead at", "attempts",
                  "reason", "last error", "payload",
                  title=escape(f"{queue}: {total} dead letter(s)"))
    for one in jobs:
        error = f"{one.error.type}: {one.error.message}" if one.error else ""
        table.add_row(escape(one.id), utc_text(one.dead_at, "%Y-%m-%d %H:%M:%S"),
                      str(one.attempts), escape(one.reason), escape(error[:120]),
                      escape(json.dumps(payload_of(one.body))[:80]))
    out.print(table)


def _act(queue_broker: Any, queue: str, ids: list[str] | None, delete: bool,
         as_json: bool) -> None:
    if delete:
        count, what = queue_broker.delete_dead(queue, ids or []), "deleted"
    else:
        count, what = queue_broker.requeue_dead(queue, ids), "requeued"
    if as_json:
        out.print_json(json.dumps({what: count}))
    else:
        asked = f" of {len(ids)} named" if ids is not None else ""
        out.print(escape(f"{what} {count}{asked} dead job(s) of {queue!r}"), highlight=False)


def purge(
    queue: QueueArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    config: ConfigOpt = None, broker: BrokerOpt = None,
) -> None:
    """Delete every ready and delayed job of QUEUE (running and dead jobs are kept)."""
    with user_errors():
        check_queue_name(queue)
    settings = settings_for(config, broker_url=broker)
    queue_broker = open_existing_broker(settings)
    with user_errors():
        try:
            counts = queue_broker.stats(queue)
            waiting = counts.ready + counts.delayed
            if not yes:
                if not sys.stdin.isatty():
                    err.print("error: purge asks for confirmation: run it from a terminal "
                              "or pass --yes", highlight=False)
                    raise typer.Exit(exitcodes.USAGE)
                if not typer.confirm(f"Delete the {waiting} ready and delayed job(s) of "
                                     f"{queue!r}? This cannot be undone"):
                    err.print("not purged", highlight=False)
                    raise typer.Exit(exitcodes.FAILURE)
            removed = queue_broker.purge(queue)
        finally:
            queue_broker.close()
    out.print(escape(f"purged {removed} job(s) of {queue!r}"), highlight=False)


def stats(
    queue: Annotated[str | None, typer.Argument(help="One queue (default: all known)")] = None,
    as_json: JsonOpt = False, config: ConfigOpt = None, broker: BrokerOpt = None,
    manager: Annotated[str | None, typer.Option(
        "--manager", help="The manager's URL, for in/out rates (default: "
                          "$QCLUSTER_MANAGER_URL, config manager_url, http://127.0.0.1:7300)")
    ] = None,
) -> None:
    """Ready, locked, delayed and dead counts per queue, whether it is paused, its in/out
    rates (jobs/s, from the manager when it answers) and the drained hosts."""
    settings = settings_for(config, broker_url=broker, manager_url=manager)
    rates, rates_note, managers_cluster = _rates(settings.manager_url)
    queue_broker = open_existing_broker(settings)
    with user_errors():
        try:
            paused, drained, cluster = _controls(queue_broker)
            if (managers_cluster is not None and cluster is not None
                    and managers_cluster.id != cluster):
                # another cluster's manager (the default URL, a second cluster on this
                # machine): its queues and rates are not this broker's
                rates, rates_note = {}, (
                    f"no in/out rates: the manager at {_manager_url(settings.manager_url)} "
                    f"works on another broker ({managers_cluster.broker}, cluster "
                    f"{managers_cluster.id[:8]}; this one is "
                    f"{cluster[:8] or 'none: no manager or master ever used it'})")
            # AMQP cannot list a broker's queues: the manager's and the configuration's
            # are added, so that RabbitMQ shows its queues too, not an empty table.
            names = [queue] if queue else sorted(
                set(queue_broker.queues()) | set(rates) | set(settings.queues))
            rows = {name: queue_broker.stats(name).model_dump() for name in names}
            if queue and not any(rows[queue].values()):
                _warn_unknown(queue_broker, queue)
            notes = queue_broker.durability()
        finally:
            queue_broker.close()
    if not rows:
        err.print("note: no queue known: the broker lists none (RabbitMQ cannot), the manager "
                  "did not answer and the configuration names none; name one: "
                  "qcluster stats QUEUE", highlight=False, soft_wrap=True)
    for name, row in rows.items():
        row["paused"] = name in paused
        row["rate_in"], row["rate_out"] = rates.get(name, (None, None))
    if as_json:
        out.print_json(json.dumps(rows))
        if drained:
            err.print(escape(f"drained hosts: {', '.join(sorted(drained))}"), highlight=False)
        for note in notes:
            err.print(f"[yellow]durability:[/yellow] {escape(note)}", highlight=False)
        return
    table = Table("queue", "ready", "locked", "delayed", "dead", "paused", "in/s", "out/s")
    for name, row in rows.items():
        table.add_row(escape(name), *(str(row[k]) for k in ("ready", "locked", "delayed", "dead")),
                      "paused" if row["paused"] else "", _rate(row["rate_in"]),
                      _rate(row["rate_out"]))
    out.print(table)
    if drained:
        out.print(escape(f"drained hosts: {', '.join(sorted(drained))}"), highlight=False)
    if rates_note:
        out.print(f"[yellow]rates:[/yellow] {escape(rates_note)}", highlight=False,
                  soft_wrap=True)
    for note in notes:
        out.print(f"[yellow]durability:[/yellow] {escape(note)}", highlight=False)


def _warn_unknown(queue_broker: Any, queue: str) -> None:
    """An empty answer for a name the broker never saw is a typo more often than not:
    say so, with the closest name it knows, rather than show a reassuring zero."""
    known = sorted(queue_broker.queues())
    if queue in known:
        return
    close = closest(queue, known)
    hint = f" (did you mean {close}?)" if close else ""
    err.print(escape(f"warning: the broker knows no queue named {queue!r}{hint}"),
              highlight=False, soft_wrap=True)


def _controls(queue_broker: Any) -> tuple[set[str], set[str], str | None]:
    """Paused queues and drained hosts, as the broker keeps them (none: cannot be read), and
    the broker's cluster identity ('' when it has none, None when it cannot be read)."""
    try:
        read = queue_broker.read_controls()
    except NotImplementedError:
        return set(), set(), None
    if read is None:  # RabbitMQ: another process holds the store for a moment
        return set(), set(), None
    stored = read
    found = [parse_stored(key, value) for key, value in stored.items()]
    controls = [c for c in found if c is not None]
    identity = stored.get(IDENTITY_KEY, b"").decode("ascii", "replace").strip()
    return ({c.name for c in controls if c.kind == "pause"},
            {c.name for c in controls if c.kind == "drain"}, identity)


def _manager_url(manager_url: str | None) -> str:
    return (manager_url or DEFAULT_MANAGER_URL).rstrip("/")


def _rates(manager_url: str | None
           ) -> tuple[dict[str, tuple[float, float]], str, ClusterClaim | None]:
    """Each queue's (in, out) jobs/s from the manager's view, or a note why there are none;
    and the broker the manager works on (None: not known)."""
    import httpx

    url = _manager_url(manager_url)
    try:
        reply = httpx.get(f"{url}/api/v1/cluster", timeout=2.0)
        reply.raise_for_status()
        queues = reply.json().get("queues", [])
        rates = {q["name"]: (float(q["rate_in"]), float(q["rate_out"])) for q in queues}
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return {}, (f"no in/out rates: the manager at {url} did not answer "
                    f"({type(exc).__name__})"), None
    try:
        reply = httpx.get(f"{url}/api/v1/identity", timeout=2.0)
        reply.raise_for_status()
        theirs = reply.json().get("cluster")
        return rates, "", None if theirs is None else ClusterClaim.model_validate(theirs)
    except (httpx.HTTPError, ValueError, AttributeError):
        return rates, "", None  # an older manager: its rates, unchecked


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"

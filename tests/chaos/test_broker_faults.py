"""Chaos rows F6-F11 (issue 16): the broker dies, is down, is cut off, runs out of disk or
memory, under a real master and its slots, counted by the ledger.

Every row runs on a broker of its own (tests/chaos/broker_servers.py), never the session's
shared one: it is killed, stopped, proxied or starved here. Core rows (F6, F8) run in make
test in their short profile; the others carry the ``chaos`` marker (make chaos).

What the rows do not cover: F6 SIGKILLs the server process, whose AOF writes are already
in the kernel's page cache; a host crash or power loss can still lose what the last second
did not fsync (``appendfsync everysec``), which no process-level fault can show. F10's disk
is a real full filesystem (a tmpfs mounted in a mount namespace of the server's own: the
writes fail with ENOSPC), not a quota Redis was told about.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from qcluster import Client, exitcodes
from qcluster.broker.embedded import ensure_server, redis_server_binary, stop_embedded
from qcluster.errors import BrokerUnavailable
from tests.chaos.broker_servers import (
    Feeder,
    RedisServer,
    RestartableRabbitMQ,
    backlog,
    chaos_run,
    close_run,
    completed,
    kill_embedded,
    wait_progress,
)
from tests.chaos.conftest import ChaosRun
from tests.chaos.ledger import Producer
from tests.chaos.rows import by_profile, full
from tests.conftest import QCLUSTER, free_port, qcluster_env, wait_until
from tests.e2e.cluster import try_json
from tests.tcp_proxy import TcpProxy

#: Each job's work (ms): 2 slots x 20 per batch drain ~200 jobs/s, below the feed's 300/s,
#: so acknowledged jobs wait in the broker when it is killed.
WORK_MS = "10"
FEED_PER_S = 300.0
#: Ready jobs that must be waiting in the broker when it is killed (the row's precondition:
#: without a backlog, "nothing lost" would prove nothing).
MIN_BACKLOG = 20


def _backlog_of_at_least(run: ChaosRun, queue: str, least: int, seen: list[int]) -> bool:
    seen.append(backlog(run, queue))
    return seen[-1] >= least


def _kill_under_load(run: ChaosRun, queue: str, kill: Callable[[], object],
                     restart: Callable[[], object], kills: int) -> list[int]:
    """``kills`` times: wait for a backlog, ``kill()``, stay down for a seeded while,
    ``restart()``, wait until jobs complete again. Returns the backlog seen at each kill."""
    backlogs = []
    done = wait_progress(run, 0, "the first jobs to complete")
    for number in range(kills):
        time.sleep(run.rng.uniform(0.0, 0.5))
        seen: list[int] = []
        wait_until(partial(_backlog_of_at_least, run, queue, MIN_BACKLOG, seen),
                   interval_s=0.05,
                   message=f"a backlog of {MIN_BACKLOG} before kill {number + 1}")
        backlogs.append(seen[-1])  # read just before the kill
        kill()
        time.sleep(run.rng.uniform(0.2, 1.5))  # the outage: part of the schedule, not a verdict
        restart()
        done = wait_progress(run, done, f"jobs completing after restart {number + 1}")
    return backlogs


def test_f6_broker_sigkill_restart_with_aof_loses_nothing(
    chaos_seed: int, tmp_path: Path
) -> None:
    """The embedded broker (AOF on, ``appendfsync everysec``, as qcluster starts it) is
    SIGKILLed under load and started again by the same code: 0 acknowledged jobs lost."""
    state_dir = tmp_path / "embedded"
    ensure_server(state_dir)
    run = chaos_run("embedded", f"embedded://{state_dir}", chaos_seed, tmp_path / "aof")
    run.procs.env["QC_CHAOS_WORK_MS"] = WORK_MS
    queue = run.q("flow")
    kills = by_profile(2, 10)
    feeder: Feeder | None = None
    try:
        run.start_master(f"{queue}=2")
        feeder = Feeder(run, queue, f"embedded://{state_dir}", per_s=FEED_PER_S).start()
        backlogs = _kill_under_load(run, queue, lambda: kill_embedded(state_dir),
                                    lambda: ensure_server(state_dir), kills)
        feeder.stop()
        run.wait_drained([queue])
        result = run.finish("F6", [queue], faults=kills, appendfsync="everysec",
                            backlog_at_kill=backlogs)
    finally:
        if feeder is not None:
            feeder.halt()
        close_run(run)
        stop_embedded(state_dir)
    assert min(backlogs) >= 1, "no acknowledged job waited in the broker at a kill"
    assert result.lost == 0, f"{result.lost} acknowledged jobs lost with AOF on"
    assert result.unexpected == 0
    assert result.residue_total == 0, result.residue


def test_f6_control_without_aof_loses_jobs(chaos_seed: int, tmp_path: Path) -> None:
    """The control run: the same server binary and arguments as the embedded broker's but
    ``appendonly no`` (snapshots every 300 s only), the same kill: acknowledged jobs are
    lost. This proves that the row above passes because of the AOF, not by luck."""
    server = RedisServer(tmp_path / "redis", aof=False, save="300 1",
                         binary=redis_server_binary(), unix_socket=True)
    server.start()
    run = chaos_run("embedded-noaof", server.url, chaos_seed, tmp_path / "control")
    run.procs.env["QC_CHAOS_WORK_MS"] = WORK_MS
    queue = run.q("flow")
    feeder: Feeder | None = None
    try:
        run.start_master(f"{queue}=2")
        feeder = Feeder(run, queue, server.url, per_s=FEED_PER_S).start()
        backlogs = _kill_under_load(run, queue, server.kill, server.start, 1)
        feeder.stop()
        wait_until(lambda: run.settled([queue], with_dead=False) or _empty(run, queue),
                   interval_s=0.2, message="the control run's queue to empty")
        result = run.finish("F6-control", [queue], faults=1, appendonly="no",
                            backlog_at_kill=backlogs)
    finally:
        if feeder is not None:
            feeder.halt()
        close_run(run)
        server.stop()
    assert result.lost > 0, (
        f"the control run without AOF lost nothing (backlog at the kill: {backlogs}): "
        "the AOF row proves nothing")


def _empty(run: ChaosRun, queue: str) -> bool:
    stats = run.client.stats(queue)
    return bool(stats["ready"] == stats["locked"] == stats["delayed"] == 0)


# --- F8: the broker is down when the cluster starts -----------------------------------------


def _slots_running(run: ChaosRun, port: int, count: int) -> bool:
    try:
        return len(run.slot_pids(port)) == count
    except OSError:
        return False


def _health(port: int) -> str:
    body = try_json(port, "/healthz")
    return str(body.get("status", "?")) if isinstance(body, dict) else "no answer"


@pytest.mark.chaos
def test_f8_broker_down_at_start(chaos_seed: int, tmp_path: Path) -> None:
    """Manager and master start while the broker is down (short profile 10 s, full 60 s):
    no crash loop, health "degraded", enqueue errors loud (CLI exit code and message,
    Client raises); once the broker comes up, everything works without a restart."""
    outage_s = by_profile(10.0, 60.0)
    server = RedisServer(tmp_path / "redis", port=free_port())
    run = chaos_run("redis", server.url, chaos_seed, tmp_path / "row")
    queue = run.q("flow")
    began = time.monotonic()
    try:
        # Everything at once: master, manager, the CLI and the Client each wait for the
        # broker in their own way.
        master_port = run.start_master(f"{queue}=2", wait=False)
        master = run.procs.started[-1]
        # The CLI: a non-zero exit and a message naming the broker, within seconds.
        cli_started = time.monotonic()
        cli_proc = subprocess.Popen(
            [*QCLUSTER, "enqueue", queue, json.dumps({"job_id": "cli-1"}), "--broker",
             server.url], env=qcluster_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        cli_output: list[tuple[str, str, float]] = []
        cli_waiter = threading.Thread(target=lambda: cli_output.append(
            (*cli_proc.communicate(timeout=120), time.monotonic())), daemon=True)
        cli_waiter.start()
        manager_port = run.start_manager("--interval", "1")
        manager = run.procs.started[-1]
        # The Client: raises, does not return as if the job were stored.
        client_error = ""
        client_started = time.monotonic()
        with Client(server.url) as client:
            try:
                client.enqueue(queue, {"job_id": "client-1"})
            except BrokerUnavailable as error:
                client_error = str(error)
        client_s = time.monotonic() - client_started
        cli_waiter.join(timeout=180)
        assert cli_output, "qcluster enqueue hangs with the broker down"
        out, err, cli_ended = cli_output[0]
        cli = subprocess.CompletedProcess(cli_proc.args, cli_proc.returncode, out, err)
        cli_s = cli_ended - cli_started
        wait_until(partial(_slots_running, run, master_port, 2), message="the master's slots")
        slot_pids: set[int] = set()
        # Each process says so once it has tried the broker (the manager at its first
        # planning round): wait for that, then it must keep saying so.
        wait_until(lambda: _health(master_port) == _health(manager_port) == "degraded",
                   interval_s=0.2, message="/healthz 'degraded' on master and manager")
        health: dict[str, set[str]] = {"master": set(), "manager": set()}
        samples = 0
        while time.monotonic() - began < outage_s or samples < 3:
            samples += 1
            assert master.poll() is None, f"the master exited: {run.procs.log('master')[-2000:]}"
            assert manager.poll() is None, f"the manager exited: {run.procs.log('manager')[-2000:]}"
            slot_pids.update(run.slot_pids(master_port))
            health["master"].add(_health(master_port))
            health["manager"].add(_health(manager_port))
            time.sleep(0.5)
        server.start()
        up_m = time.monotonic()
        acked = run.producer.enqueue(queue, 500)
        run.wait_drained([queue])
        recovered_s = time.monotonic() - up_m
        health_after: dict[str, str] = {}

        def healthy() -> bool:
            health_after.update(master=_health(master_port), manager=_health(manager_port))
            return set(health_after.values()) == {"ok"}

        with contextlib.suppress(AssertionError):  # asserted below, with what it said
            wait_until(healthy, interval_s=0.2, message="health 'ok' again")
        slot_pids.update(run.slot_pids(master_port))
        restarts = len(slot_pids) - 2
        result = run.finish("F8", [queue], faults=1, outage_s=outage_s,
                            slot_restarts=restarts, cli_exit=cli.returncode,
                            cli_s=round(cli_s, 2), client_s=round(client_s, 2),
                            recovered_s=round(recovered_s, 2),
                            health_during={k: sorted(v) for k, v in health.items()},
                            health_after=health_after)
    finally:
        close_run(run)
        server.stop()
    assert cli.returncode != 0 and "unreachable" in (cli.stdout + cli.stderr), (
        f"qcluster enqueue with the broker down: exit {cli.returncode}, {cli.stderr!r}")
    assert client_error, "Client.enqueue returned while the broker was down"
    assert restarts == 0, f"slots restarted {restarts} times while the broker was down"
    assert len(acked) == 500 and result.lost == 0 and result.unexpected == 0
    assert result.residue_total == 0, result.residue
    assert health_after == {"master": "ok", "manager": "ok"}, health_after
    assert completed(run) >= 500
    assert health == {"master": {"degraded"}, "manager": {"degraded"}}, (
        f"/healthz during the outage: {health}")


# --- F9: the link between the slots and the broker fails -----------------------------------


def test_tcp_proxy_delays_and_resets() -> None:
    """The proxy's own faults, on an echo server: latency holds each chunk back, in order;
    ``reset()`` aborts the open link with an RST; new links are forwarded again."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def echo() -> None:
            with contextlib.suppress(OSError):  # the listener closed: the test is over
                while True:
                    conn, _ = server.accept()
                    with conn, contextlib.suppress(OSError):  # this link was reset
                        while data := conn.recv(65536):
                            conn.sendall(data)

        threading.Thread(target=echo, daemon=True).start()
        with TcpProxy(server.getsockname()) as proxy:
            link = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            link.sendall(b"a")
            assert link.recv(10) == b"a"
            proxy.set_latency(0.2)
            started = time.monotonic()
            link.sendall(b"b")
            assert link.recv(10) == b"b"
            assert time.monotonic() - started >= 0.4  # both ways held back
            proxy.set_latency(0)
            proxy.reset()
            with pytest.raises(ConnectionResetError):
                link.sendall(b"c")
                link.recv(10)
            link.close()
            again = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            again.sendall(b"d")
            assert again.recv(10) == b"d"
            again.close()


def _broker_errors(run: ChaosRun) -> int:
    """Warnings the slots logged about the broker: the slot loop's "broker error" and, on
    RabbitMQ, the connection's own ("the link is dead", "Connection reset", retries)."""
    return sum(1 for line in run.procs.log("master").splitlines()
               if ("WARNING qcluster.slot.runtime" in line and "broker error" in line)
               or "WARNING qcluster.broker." in line)


def _more_errors(run: ChaosRun, than: int) -> bool:
    return _broker_errors(run) > than


@pytest.mark.chaos
@pytest.mark.timeout(1800)  # full profile on RabbitMQ: 3 blackholes of 45-60 s, ~6 min
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_f9_network_faults_between_slots_and_broker(
    broker: str, chaos_seed: int, tmp_path: Path
) -> None:
    """Slots reach the broker (a Redis or a RabbitMQ node of the row's own) through
    tests/tcp_proxy.py; the producer reaches it directly. The link is blackholed, reset and
    slowed in a seeded order: a dead link is an error within seconds (no hang), the slots
    come back by themselves (none killed as hung), 0 acknowledged jobs lost. The full
    profile's blackholes (45 s) outlast the master's heartbeat timeout (30 s)."""
    server: RedisServer | RestartableRabbitMQ
    if broker == "redis":
        server = RedisServer(tmp_path / "redis")
        server.start()
        direct = server.url
        proxy = TcpProxy(("127.0.0.1", server.port))
        proxied = f"redis://127.0.0.1:{proxy.port}/0"
    else:
        server = RestartableRabbitMQ(tmp_path / "rabbitmq")
        try:
            server.start()
        except BrokerUnavailable as error:
            pytest.fail(str(error), pytrace=False)
        direct = server.url
        proxy = TcpProxy(("127.0.0.1", server.port))
        proxied = f"amqp://guest:guest@127.0.0.1:{proxy.port}//"
    run = chaos_run(broker, proxied, chaos_seed, tmp_path / "row", client_url=direct)
    queue = run.q("flow")
    blackhole_s = by_profile(8.0, 45.0)
    schedule = ["blackhole", "reset", "latency"] * by_profile(1, 3)
    run.rng.shuffle(schedule)
    figures: dict[str, list[float]] = {"error_after_s": [], "client_error_s": [],
                                       "recovered_after_s": []}
    feeder: Feeder | None = None
    try:
        run.start_master(f"{queue}=2")
        slots_before = set(run.slot_pids(run.ports["master"]))
        feeder = Feeder(run, queue, direct, per_s=200.0).start()
        done = wait_progress(run, 0, "the first jobs to complete")
        for fault in schedule:
            errors = _broker_errors(run)
            began = time.monotonic()
            if fault == "blackhole":
                proxy.blackhole()
                # The slots' calls end in an error: no slot waits on the dead socket.
                wait_until(partial(_more_errors, run, errors), interval_s=0.1,
                           message="a slot to report the dead link")
                figures["error_after_s"].append(round(time.monotonic() - began, 2))
                # A producer behind the dead link is told so, within seconds.
                probe = Producer(Client(proxied), run.ledger_dir, seed=chaos_seed, tag="px")
                probe_started = time.monotonic()
                with pytest.raises(BrokerUnavailable):
                    probe.enqueue(queue, 1)
                figures["client_error_s"].append(round(time.monotonic() - probe_started, 2))
                probe.client.close()
                time.sleep(max(0.0, blackhole_s - (time.monotonic() - began)))
                proxy.restore()
            elif fault == "reset":
                for _ in range(run.rng.randint(2, 5)):
                    proxy.reset()
                    time.sleep(run.rng.uniform(0.1, 0.6))
            else:
                proxy.set_latency(run.rng.uniform(0.05, 0.3))
                time.sleep(by_profile(3.0, 15.0))
                proxy.set_latency(0)
            restored = time.monotonic()
            done = wait_progress(run, done, f"jobs completing after the {fault}")
            figures["recovered_after_s"].append(round(time.monotonic() - restored, 2))
        feeder.stop()
        run.wait_drained([queue])
        restarted = set(run.slot_pids(run.ports["master"])) != slots_before
        result = run.finish("F9", [queue], faults=len(schedule), schedule=schedule,
                            slots_restarted=restarted, blackhole_s=blackhole_s,
                            resets=proxy.resets, error_after_s=figures["error_after_s"],
                            client_error_s=figures["client_error_s"],
                            recovered_after_s=figures["recovered_after_s"])
    finally:
        if feeder is not None:
            feeder.halt()
        close_run(run)
        proxy.close()
        server.stop()
    assert result.lost == 0, f"{result.lost} acknowledged jobs lost"
    assert result.unexpected == 0
    assert result.residue_total == 0, result.residue
    # "Within seconds": Redis, a socket timeout (5 s) plus the reconnect's retries; RabbitMQ,
    # up to 6 connects of connect_timeout (5 s) each. A hang never gets here (wait_until
    # fails first).
    assert max(figures["client_error_s"]) < (30 if broker == "redis" else 60), figures
    assert not restarted, f"a slot was restarted: {run.procs.log('master')[-3000:]}"


# --- F10: the broker's disk fills up --------------------------------------------------------


def _fill(directory: Path) -> int:
    """Write a file in ``directory`` until the filesystem is full; its size in bytes."""
    written = 0
    with (directory / "filler").open("wb") as out:
        block = b"\0" * (1 << 16)
        with contextlib.suppress(OSError):
            while True:
                written += out.write(block)
                out.flush()
    return written


@pytest.mark.chaos
def test_f10_disk_full_on_the_broker_data_dir(chaos_seed: int, tmp_path: Path) -> None:
    """The embedded broker's server and arguments (AOF on, everysec) with its data
    directory on a 16 MiB tmpfs of its own (a mount namespace: nothing else is touched),
    filled to the last byte under load: enqueues fail with a clear error, nothing dies,
    and once space is freed the cluster carries on by itself: 0 acknowledged jobs lost."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.fail("row F10 needs unshare and nsenter (util-linux) to mount a tmpfs of "
                    "its own")
    server = RedisServer(tmp_path / "redis", binary=redis_server_binary(), unix_socket=True,
                         tmpfs_mb=16)
    server.start()
    run = chaos_run("embedded", server.url, chaos_seed, tmp_path / "row")
    queue = run.q("flow")
    full_s = by_profile(5.0, 30.0)
    feeder: Feeder | None = None
    try:
        run.start_master(f"{queue}=2")
        master = run.procs.started[-1]
        feeder = Feeder(run, queue, server.url, per_s=200.0).start()
        done = wait_progress(run, 0, "the first jobs to complete")
        slots_before = set(run.slot_pids(run.ports["master"]))
        filled = _fill(server.visible_data_dir())
        errors = len(feeder.producer.errors)
        wait_until(lambda: len(feeder.producer.errors) > errors, interval_s=0.1,
                   message="an enqueue to fail on the full disk")
        time.sleep(full_s)
        refusal = feeder.producer.errors[-1]
        assert master.poll() is None and server.proc is not None and server.proc.poll() is None
        (server.visible_data_dir() / "filler").unlink()
        acked = len(run.ledger().acks)
        wait_until(lambda: len(run.ledger().acks) > acked, interval_s=0.1,
                   message="an enqueue to succeed once space was freed")
        done = wait_progress(run, done, "jobs completing after space was freed")
        feeder.stop()
        run.wait_drained([queue])
        slots_after = set(run.slot_pids(run.ports["master"]))
        result = run.finish("F10", [queue], faults=1, tmpfs_mb=16, filler_bytes=filled,
                            enqueue_error=refusal[:400], full_s=full_s,
                            distinct_errors=sorted(set(feeder.producer.errors))[:5])
    finally:
        if feeder is not None:
            feeder.halt()
        close_run(run)
        server.stop()
    assert "No space left on device" in refusal or "MISCONF" in refusal, refusal
    assert slots_after == slots_before, "slots restarted while the disk was full"
    assert result.lost == 0, f"{result.lost} acknowledged jobs lost"
    assert result.unexpected == 0
    assert result.residue_total == 0, result.residue


@pytest.mark.chaos
def test_f10_disk_full_then_the_broker_crashes(chaos_seed: int, tmp_path: Path) -> None:
    """A double fault: the disk fills up, then the server is SIGKILLed before space comes
    back (then freed, server restarted). Every job acknowledged before the disk filled
    survives; jobs acknowledged after it may not: with ``appendfsync everysec`` Redis
    answers a write before its AOF write fails, and refuses writes (MISCONF) only from
    then on. The row measures that window (``acked_after_full``, ``lost``)."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.fail("row F10 needs unshare and nsenter (util-linux) to mount a tmpfs of "
                    "its own")
    server = RedisServer(tmp_path / "redis", binary=redis_server_binary(), unix_socket=True,
                         tmpfs_mb=16)
    server.start()
    run = chaos_run("embedded", server.url, chaos_seed, tmp_path / "row")
    queue = run.q("flow")
    try:
        before = run.producer.enqueue(queue, 400)
        _fill(server.visible_data_dir())
        after: list[str] = []
        while not run.producer.errors:
            after += run.producer.enqueue(queue, 20, raise_errors=False)
        refusal = run.producer.errors[-1]
        server.kill()
        (server.visible_data_dir() / "filler").unlink()
        server.start()
        run.start_master(f"{queue}=2")
        wait_until(partial(_empty, run, queue), interval_s=0.2, message="the queue to drain")
        result = run.finish("F10-crash", [queue], faults=2, acked_before_full=len(before),
                            acked_after_full=len(after), enqueue_error=refusal[:300])
        report = run.ledger().report()
    finally:
        close_run(run)
        server.stop()
    lost = set(report.lost_ids)
    assert not lost & set(before), f"{len(lost & set(before))} jobs acknowledged before the " \
                                   "disk filled were lost"
    assert lost <= set(after)
    assert result.unexpected == 0


# --- F11: the broker's memory runs out ------------------------------------------------------


@pytest.mark.chaos
def test_f11_maxmemory_noeviction(chaos_seed: int, tmp_path: Path) -> None:
    """Redis with ``maxmemory 4mb`` and ``noeviction``: enqueues beyond it fail with a clear
    error (Client raises, the CLI exits non-zero) and store nothing; the slots still drain
    what was acknowledged (0 lost), after which enqueues succeed again."""
    server = RedisServer(tmp_path / "redis",
                         extra=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"))
    server.start()
    run = chaos_run("redis", server.url, chaos_seed, tmp_path / "row")
    queue = run.q("flow")
    try:
        while not run.producer.errors:  # fill it up: no slot yet
            run.producer.enqueue(queue, 200, raise_errors=False)
        refusal = run.producer.errors[-1]
        cli = subprocess.run(
            [*QCLUSTER, "enqueue", queue, json.dumps({"job_id": "cli-oom"}), "--broker",
             server.url], env=qcluster_env(), capture_output=True, text=True, timeout=120)
        full = run.client.stats(queue)["ready"]
        run.start_master(f"{queue}=2")
        run.wait_drained([queue])
        after = run.producer.enqueue(queue, 200)  # memory freed: accepted again
        run.wait_drained([queue])
        result = run.finish("F11", [queue], faults=1, maxmemory="4mb", ready_when_full=full,
                            enqueue_error=refusal[:200], cli_exit=cli.returncode)
    finally:
        close_run(run)
        server.stop()
    assert "OOM" in refusal or "maxmemory" in refusal, refusal
    assert cli.returncode != 0 and ("OOM" in cli.stderr or "maxmemory" in cli.stderr), cli
    assert len(after) == 200
    assert result.lost == 0, f"{result.lost} acknowledged jobs lost"
    assert result.unexpected == 0
    assert result.residue_total == 0, result.residue


def _refusal(args: list[str], log: Path) -> tuple[int | None, str]:
    """Run ``qcluster ARGS``: its exit code and output, or None if it is still running
    when its log says it gave up on the broker another way (a master marking the queue
    fatal) or after a generous while; it is stopped then."""
    with log.open("wb") as out:
        proc = subprocess.Popen([*QCLUSTER, *args], env=qcluster_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with contextlib.suppress(AssertionError):
            wait_until(lambda: proc.poll() is not None or "is fatal on this host" in
                       log.read_text(errors="replace"), interval_s=0.1,
                       message=f"qcluster {args[0]} to exit")
        code = proc.poll()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return code, log.read_text(errors="replace").strip()


@pytest.mark.chaos
@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_f11_evicting_policy_refused_at_start(policy: str, tmp_path: Path) -> None:
    """An evicting ``maxmemory-policy`` deletes jobs: manager, master, slot and enqueue
    refuse it at start with one line and the configuration exit code; nothing is started
    and nothing is written."""
    server = RedisServer(tmp_path / "redis",
                         extra=("--maxmemory", "64mb", "--maxmemory-policy", policy))
    server.start()
    try:
        outcomes: dict[str, tuple[int | None, str]] = {}
        for command in (
            ["manager", "--listen", f"127.0.0.1:{free_port()}"],
            ["master", "--app", "tests.chaos.apps", "--slots", "chaos-flow=1",
             "--listen", f"127.0.0.1:{free_port()}"],
            ["slot", "--app", "tests.chaos.apps", "--queue", "chaos-flow"],
            ["enqueue", "chaos-flow", "{}"],
        ):
            outcomes[command[0]] = _refusal([*command, "--broker", server.url],
                                            tmp_path / f"{command[0]}.log")
        with server.client() as client:
            keys = client.dbsize()
    finally:
        server.stop()
    print(json.dumps({role: code for role, (code, _output) in outcomes.items()}))
    refused_badly = []
    for role, (code, output) in outcomes.items():
        if not (code == exitcodes.CONFIG and policy in output and "noeviction" in output
                and len(output.splitlines()) == 1 and "Traceback" not in output):
            refused_badly.append(f"{role}: exit {code}, {output[-600:]!r}")
    assert keys == 0, "something was written to the evicting Redis"
    assert not refused_badly, refused_badly


# --- F7 R: RabbitMQ stops and starts --------------------------------------------------------


@pytest.mark.chaos
@pytest.mark.timeout(900)  # three node restarts, each up to START_TIMEOUT_S on a busy CPU
def test_f7_rabbitmq_stop_start(chaos_seed: int, tmp_path: Path) -> None:
    """A private RabbitMQ node is stopped and started again on the same port with the same
    data, under load, with confirmed jobs waiting in its queue: every confirmed job runs
    (0 lost). Short profile: one orderly stop (SIGTERM); full: three, each an orderly stop
    or a SIGKILL of the node (seeded)."""
    node = RestartableRabbitMQ(tmp_path / "rabbitmq")
    feeder: Feeder | None = None
    try:
        node.start()
    except BrokerUnavailable as error:
        pytest.fail(str(error), pytrace=False)
    run = chaos_run("rabbitmq", node.url, chaos_seed, tmp_path / "row")
    run.procs.env["QC_CHAOS_WORK_MS"] = WORK_MS
    queue = run.q("flow")
    modes = [run.rng.choice(["stop", "kill"]) for _ in range(3)] if full() else ["stop"]
    chosen = iter(modes)

    def stop() -> None:
        if next(chosen) == "kill":
            node.kill()
        else:
            node.stop()

    try:
        run.start_master(f"{queue}=2")
        feeder = Feeder(run, queue, node.url, per_s=FEED_PER_S).start()
        backlogs = _kill_under_load(run, queue, stop, node.restart, len(modes))
        feeder.stop()
        run.wait_drained([queue])
        run.stop_all()  # RabbitMQ counts only this process's unacked jobs: stop the slots
        result = run.finish("F7", [queue], faults=len(modes), modes=modes,
                            backlog_at_stop=backlogs)
    finally:
        if feeder is not None:
            feeder.halt()
        close_run(run)
        node.stop()
    assert min(backlogs) >= 1, "no confirmed job waited in the queue at a stop"
    assert result.lost == 0, f"{result.lost} confirmed jobs lost"
    assert result.unexpected == 0
    assert result.residue_total == 0, result.residue

"""Where a slot's time goes: one ``qcluster slot --burst`` loop, in this process, draining a
queue filled beforehand, with the slot's CPU and the broker server's CPU per job.

    python -m bench.slot_profile redis --jobs 100000 --batch 100 [--profile FILE] [--rounds 3]
    python -m bench.slot_profile rabbitmq --jobs 20000 --batch 100
    python -m bench.slot_profile redis --parts     # the split by part (see below)

The loop is the one the consume suite times (``SlotRunner`` in burst mode, no master, no
metrics); here it runs in the measuring process so that ``--profile`` can wrap it in
cProfile (``python -m pstats FILE``, or ``--top N`` to print the top functions). Per round:
jobs/s from the first take to the queue empty, the slot's CPU per job (this process's
``time.process_time``) and the broker server's (every thread of the ``redis-server`` or
``beam.smp`` that listens on the URL's port, ``/proc/PID/task/*/schedstat``), in µs.
Brokers: ``QB_REDIS_URL`` / ``QB_RABBITMQ_URL``, else private ones (bench/common.py).

``--parts``: after the timed rounds, one more round under cProfile, its own time grouped
by part of the slot's path (:data:`PARTS`) and each part's share applied to the CPU per
job of the timed rounds (cProfile slows Python calls more than C, so the split is
approximate; the total is the measured one). On Redis, also the server's time per job by
command inside the scripts (``INFO commandstats`` of that round; the scripts' own Lua
work is EVALSHA's time less the commands it ran).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import psutil

#: The slot path's parts, by where a function lives (first match wins): cProfile's own
#: time of each function is counted in its part.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (WAIT := "socket calls (wall time: mostly waiting for the broker)",
     ("_socket.socket", "select.select", "recv", "sendall")),
    ("take reply: AMQP frames and properties (py-amqp)", ("/amqp/",)),
    ("take reply: kombu message wrap", ("/kombu/",)),
    ("take reply: Redis client and reply parsing (redis-py, hiredis)", ("/redis/", "hiredis")),
    ("take reply: read-ahead frame reader", ("amqp_readahead.py", "amqp_link.py")),
    ("take: deliveries from the reply", ("redis_scripts.py(deliveries", "redis_scripts.py:15",
                                        "amqp_consume.py", "amqp_messages.py")),
    ("settle: arguments, acks", ("settle.py", "redis_scripts.py", "kombu_broker.py",
                                 "redis_broker.py", "base.py")),
    ("decode: envelope validation (pydantic-core)", ("validate_json",)),
    ("decode: envelope checks and Job objects", ("decode.py", "job.py", "<string>")),
    ("slot loop and handler dispatch", ("runtime.py", "take_progress.py", "apps.py")),
)


def part_of(where: str) -> str:
    for name, needles in PARTS:
        if any(needle in where for needle in needles):
            return name
    return "other (builtins, containers)"


def parts_split(profiler: cProfile.Profile, cpu_us_per_job: float) -> dict[str, float]:
    """µs per job by part: each part's share of the profiled own time outside the socket
    calls (whose wall time is mostly the wait for the broker), of ``cpu_us_per_job``; the
    socket calls' own CPU (system calls) is inside the parts' total, not split out."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    own: dict[str, float] = {}
    for (path, line, name), (_, _, tottime, _, _) in stats.items():
        key = part_of(f"{path}:{line}({name}")
        own[key] = own.get(key, 0.0) + tottime
    own.pop(WAIT, None)
    total = sum(own.values()) or 1.0
    return dict(sorted(((k, round(v / total * cpu_us_per_job, 2)) for k, v in own.items()),
                       key=lambda item: -item[1]))


def redis_parts(url: str, batch: int, cpu_us_per_job: float) -> dict[str, float]:
    """µs per job of each step of a Redis slot's batch, timed alone (best of 5) on a real
    take's reply; what is left of ``cpu_us_per_job`` is the client call itself (redis-py,
    the socket's system calls, hiredis parsing the reply)."""
    import timeit

    from bench.common import enqueue_noops, unique
    from qcluster.broker import open_broker
    from qcluster.broker.redis_broker import RedisBroker, _keys, _settle_keys
    from qcluster.broker.redis_scripts import deliveries, settle_args, take_token
    from qcluster.client import Client
    from qcluster.policy import QueuePolicy
    from qcluster.slot.decode import decode_batch
    from qcluster.slot.runtime import SlotRunner
    from qcluster.slot.settle import dead_retention, settle_batch

    queue, policy = unique("parts"), QueuePolicy.model_validate({"batch_size": batch})
    broker = open_broker(url, state_dir=Path("/tmp"))
    assert isinstance(broker, RedisBroker)
    with Client(url) as client:
        enqueue_noops(client, queue, batch)
        keys = _keys(queue)
        reply = broker._scripts["take"](keys=[keys["ready"], keys["locked"], keys["jobs"],
                                              keys["attempts"], broker._take_record(queue)],
                                        args=[batch, 60_000, take_token()])
        client.purge(queue)
    taken = deliveries(reply)
    jobs, _ = decode_batch(taken, policy)
    settlement, _ = settle_batch(jobs, policy, rand=lambda: 0.5)
    retention = settlement.retention = dead_retention(policy)
    arguments = settle_args(settlement, retention)
    connection = broker.client.connection_pool.get_connection()
    runner = SimpleNamespace(spec=SimpleNamespace(handler=lambda jobs: None, is_async=False))
    runner._run_handler = SlotRunner._run_handler.__get__(runner)
    steps = {
        "take: deliveries from the reply": lambda: deliveries(reply),
        "decode: envelopes, checks, Job objects": lambda: decode_batch(taken, policy),
        "handler dispatch (one call per batch)": lambda: runner._run_handler(jobs),
        "settle: outcomes to a Settlement": lambda: settle_batch(jobs, policy,
                                                               rand=lambda: 0.5),
        "settle: the script's arguments": lambda: settle_args(settlement, retention),
        "settle + take: packing the command": lambda: connection.pack_command(
            "EVALSHA", "0" * 40, 10, *_settle_keys(queue), "record", len(arguments),
            *arguments, batch, 60_000, "token"),
    }
    broker.client.connection_pool.release(connection)
    broker.close()
    split = {name: min(timeit.repeat(step, number=200, repeat=5)) / 200 / batch * 1e6
             for name, step in steps.items()}
    split["the call: redis-py, socket system calls, hiredis reply parsing (the rest)"] = (
        cpu_us_per_job - sum(split.values()))
    return {name: round(value, 2) for name, value in split.items()}


def redis_commandstats(url: str, jobs: int, reset: bool) -> dict[str, float]:
    """µs per job the Redis server spent in each command since the last reset."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        if reset:
            client.config_resetstat()
            return {}
        found = client.info("commandstats")
    finally:
        client.close()
    per_job = {name.removeprefix("cmdstat_"): value["usec"] / jobs
               for name, value in found.items() if value["usec"] / jobs >= 0.005}
    inside = sum(v for k, v in per_job.items() if k not in ("evalsha", "info"))
    if "evalsha" in per_job:
        per_job["evalsha: Lua itself (less the commands it ran)"] = per_job["evalsha"] - inside
    return {k: round(v, 2) for k, v in sorted(per_job.items(), key=lambda kv: -kv[1])}


def broker_pid(url: str) -> int | None:
    """The process listening on the URL's port (its server), if this user can see it."""
    port = urlsplit(url.split(";")[0]).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return conn.pid
    return None


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds of every thread of ``pid`` (0 when unknown)."""
    if pid is None:
        return 0.0
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1e9


def one_round(backend: str, jobs: int, batch: int, profiler: cProfile.Profile | None
              ) -> dict[str, Any]:
    from bench.common import BROKERS, enqueue_noops, unique

    queue = unique(f"profile{batch}")
    os.environ["QB_QUEUE"], os.environ["QB_BATCH"] = queue, str(batch)
    import importlib

    import bench.apps
    from qcluster.broker import open_broker
    from qcluster.client import Client
    from qcluster.slot.runtime import SlotRunner

    apps = importlib.reload(bench.apps)
    url = BROKERS[backend]
    server = broker_pid(url)
    with Client(url) as client:
        enqueue_noops(client, queue, jobs)
        if backend == "rabbitmq":
            time.sleep(1.0)  # the publishes' own work at the broker ends before the clock
        broker = open_broker(url, state_dir=Path("/tmp"))
        runner = SlotRunner(apps.app, queue, broker, burst=True)
        # The first take (connecting, declaring) is outside the clock, as in the suite.
        runner.step(defer_settle=True)
        left = client.stats(queue)["ready"] + len(runner._pending.ack)
        cpu0, server0, wall0 = time.process_time(), process_cpu_s(server), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        if backend == "redis":
            redis_commandstats(url, left, reset=True)
        code = runner._loop()
        runner._flush()
        if profiler is not None:
            profiler.disable()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        server_cpu = process_cpu_s(server) - server0
        commands = redis_commandstats(url, left, reset=False) if backend == "redis" else {}
        runner._leave(queue)
        broker.close()
        ready = client.stats(queue)["ready"]
        client.purge(queue)
    assert code == 0 and ready == 0, (code, ready)
    return {"jobs_per_s": left / wall, "slot_us_per_job": cpu / left * 1e6,
            "broker_us_per_job": server_cpu / left * 1e6, "jobs": left,
            "server_commands_us_per_job": commands}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend", choices=("redis", "rabbitmq", "embedded"))
    parser.add_argument("--jobs", type=int, default=0,
                        help="jobs per round (default 100,000 on Redis, 20,000 on RabbitMQ)")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=Path, help="write cProfile stats of every round here")
    parser.add_argument("--top", type=int, default=0, help="print the top N by own time")
    parser.add_argument("--parts", action="store_true",
                        help="then one profiled round: the slot's CPU per job by part")
    args = parser.parse_args()
    jobs = args.jobs or (20_000 if args.backend == "rabbitmq" else 100_000)
    profiler = cProfile.Profile() if args.profile or args.top else None
    results = []
    for round_no in range(args.rounds):
        result = one_round(args.backend, jobs, args.batch, profiler)
        results.append(result)
        print(json.dumps({"round": round_no, **{k: round(v, 2) if isinstance(v, float) else v
                                                 for k, v in result.items()}}), flush=True)
    medians = {key: round(statistics.median(r[key] for r in results), 2)
               for key in ("jobs_per_s", "slot_us_per_job", "broker_us_per_job")}
    print(json.dumps({"backend": args.backend, "batch": args.batch, "median": medians,
                      "loadavg": os.getloadavg()}), flush=True)
    if args.parts and args.backend == "redis":
        from bench.common import BROKERS

        print(json.dumps({"slot_us_per_job_by_part": redis_parts(
            BROKERS["redis"], args.batch, medians["slot_us_per_job"])}, indent=1), flush=True)
    elif args.parts:
        parts_profiler = cProfile.Profile()
        one_round(args.backend, jobs, args.batch, parts_profiler)
        print(json.dumps({"slot_us_per_job_by_part": parts_split(
            parts_profiler, medians["slot_us_per_job"])}, indent=1), flush=True)
    if profiler is not None:
        if args.profile:
            profiler.dump_stats(args.profile)
        if args.top:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()

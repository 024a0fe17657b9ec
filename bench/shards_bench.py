"""Shards (issue 17 item 6): whole-host throughput on a 3-shard local Redis Cluster with 6
queues, beside one Redis, in the same run, alternating (Redis, cluster, Redis, cluster...).

One ``qcluster master --slots`` runs a slot per queue (6 slots, batch 100, no-op handler,
``bench/shards_app.py``) on queues filled before it starts (no producer during the window,
so only the master, its slots and the brokers use the CPU; the fill's broker CPU gives the
publish cost). Measured over the window: jobs/s (from the queues' counts), the lowest depth
(0 would mean a queue ran dry), and each process group's CPU (``/proc/PID/task/*/schedstat``,
as the host suite): every ``redis-server`` of the broker, the slots, the master. From those,
CPU per job of the broker and of the slots, which feed the model in docs/benchmarks.md::

    jobs/s(N shards) = min(N / broker_cpu_per_job,      each shard on a core of its own
                           slot_cores / slot_cpu_per_job)  the slots' CPU
    on one host:       cores / (broker + slot CPU per job)

The cluster has no replicas (``?replicas=0``, no WAIT) and no AOF, like the bench's one
Redis: the same durability class, so that what differs is the number of shards.

``python -m bench.shards_bench [--seconds S] [--repeat N]`` prints JSON and writes
bench/results/shards.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import redis

from bench.common import REDIS, ROOT, free_listen, python, spawn, stop
from bench.master_bench import _cpu_seconds
from qcluster.client import Client

QUEUES = 6
SHARDS = 3
#: Jobs per queue per second of window filled before a run: more than a slot drains on
#: this 2-core host (~10,000/s per queue at most), so no queue runs dry (lowest_ready says).
FILL_PER_QUEUE_PER_S = 12_000
WARM_S = 3.0


def cluster_nodes(base: Path, masters: int = SHARDS) -> tuple[str, list[Any]]:
    """A Redis Cluster of ``masters`` masters, no replica, no AOF, on free loopback ports
    (tests/brokers.py's node class, as the tests' cluster). Returns its URL and nodes."""
    from tests.brokers import BrokerUnavailable, _ConfiguredRedis, free_port

    nodes = []
    for number in range(masters):
        node = _ConfiguredRedis(base / f"node-{number}", [
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(free_port()), "--save", ""], aof=False)
        node.start()
        nodes.append(node)
    create = subprocess.run(
        ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
         "--cluster-replicas", "0", "--cluster-yes"],
        capture_output=True, text=True, timeout=60, check=False)
    if create.returncode:
        for node in nodes:
            node.stop()
        raise BrokerUnavailable(f"redis-cli --cluster create failed: {create.stdout[-300:]}")
    _wait_cluster_ok([n.port for n in nodes])
    hosts = ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    return f"redis+cluster://{hosts}?replicas=0", nodes


def _wait_cluster_ok(ports: list[int], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(redis.Redis(port=port).cluster("INFO").get("cluster_state") == "ok"
                   for port in ports):
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the bench's Redis Cluster did not reach cluster_state:ok")


def spread_queues(ports: list[int], count: int = QUEUES) -> list[str]:
    """``count`` queue names, as many on each master as the others (by CLUSTER SLOTS and the
    hash slot of ``{NAME}``), so that the shards share the work evenly."""
    from redis.crc import key_slot

    spans = redis.Redis(port=ports[0]).execute_command("CLUSTER SLOTS")
    per_master = {int(span[2][1]): 0 for span in spans}
    wanted = count // len(per_master)
    names: list[str] = []
    while len(names) < count:
        name = f"bench-shard-{uuid.uuid4().hex[:6]}"
        slot = key_slot(f"{{{name}}}".encode())
        port = next(int(s[2][1]) for s in spans if int(s[0]) <= slot <= int(s[1]))
        if per_master[port] < wanted:
            per_master[port] += 1
            names.append(name)
    return names


def _redis_pids(ports: list[int]) -> list[psutil.Process]:
    return [psutil.Process(int(redis.Redis(port=port).info("server")["process_id"]))
            for port in ports]


def run_once(url: str, ports: list[int], queues: list[str], seconds: float,
             fill: int) -> dict[str, Any]:
    """One measured window on the broker at ``url`` (its servers on ``ports``)."""
    brokers = _redis_pids(ports)
    with Client(url) as client:
        publish_cpu = _cpu_seconds(brokers)
        for queue in queues:
            for first in range(0, fill, 20_000):
                client.enqueue_many(queue, [{}] * min(20_000, fill - first))
        publish_us = (_cpu_seconds(brokers) - publish_cpu) / (fill * len(queues)) * 1e6
        slots = ",".join(f"{queue}=1" for queue in queues)
        proc = spawn([python(), "-m", "qcluster", "master", "--app", "bench.shards_app",
                      "--broker", url, "--slots", slots, "--listen", free_listen(),
                      "--no-metrics", "--log-level", "WARNING"],
                     QB_QUEUES=",".join(queues), QB_BATCH="100")
        try:
            time.sleep(WARM_S)  # slots forked, connected and draining
            result = _watch(client, queues, proc.pid, brokers, seconds)
            result["broker_publish_us_per_job"] = round(publish_us, 2)
            return result
        finally:
            stop(proc)
            for queue in queues:
                client.purge(queue)


def _watch(client: Client, queues: list[str], master_pid: int,
           brokers: list[psutil.Process], seconds: float) -> dict[str, Any]:
    def left() -> tuple[int, int]:
        counts = [client.stats(queue) for queue in queues]
        return (sum(c["ready"] + c["locked"] for c in counts), min(c["ready"] for c in counts))

    master = psutil.Process(master_pid)
    groups = {"broker": brokers, "slots": master.children(), "master": [master]}
    cpu_before = {name: _cpu_seconds(procs) for name, procs in groups.items()}
    per_node_before = [_cpu_seconds([p]) for p in brokers]
    left_before, lowest = left()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        time.sleep(1.0)
        lowest = min(lowest, left()[1])
    elapsed = time.perf_counter() - start
    left_after, lowest_now = left()
    done = left_before - left_after
    cpu = {name: _cpu_seconds(procs) - cpu_before[name] for name, procs in groups.items()}
    return {
        "jobs_per_s": round(done / elapsed),
        "lowest_ready": min(lowest, lowest_now),
        "cpu_share": {name: round(value / elapsed, 2) for name, value in cpu.items()},
        "cores_obtained": round(sum(cpu.values()) / elapsed, 2),
        "broker_node_cpu_share": [round((_cpu_seconds([p]) - before) / elapsed, 2)
                                  for p, before in zip(brokers, per_node_before, strict=True)],
        "cpu_us_per_job": {name: round(value / max(done, 1) * 1e6, 2)
                           for name, value in cpu.items()},
    }


def model(one: dict[str, Any], shards: dict[str, Any]) -> dict[str, Any]:
    """The model (docs/benchmarks.md) from the measured CPU per job, and its check against
    the two measured points.

    A job costs the broker ``b`` (publish + take + settle, summed over the shards) and the
    slots and master ``s``. With N shards, each with a core of its own, the brokers cap the
    rate at N / b; the slots' cores cap it at cores / s; on one host the two share the cores:
    cores / (b + s). The window measured here had no producer (the queues were filled
    before), so its check uses ``b`` without the publish, and the cores the run obtained
    (the CPU its processes used, out of a shared 2-core machine)."""
    publish_us = statistics.median([one["publish_us"], shards["publish_us"]])
    consume_us = {1: one["broker_us"], SHARDS: shards["broker_us"]}
    host_us = statistics.median([one["slots_us"] + one["master_us"],
                                 shards["slots_us"] + shards["master_us"]])

    def bounds(n: int) -> dict[str, float]:
        broker_us = consume_us[1 if n == 1 else SHARDS] + publish_us
        return {"broker_bound": round(n * 1e6 / broker_us),
                "slots_per_core": round(1e6 / host_us),
                "one_host_of_2_cores": round(2e6 / (broker_us + host_us))}

    def check(n: int, measured: dict[str, Any]) -> dict[str, float]:
        broker_bound = n * 1e6 / consume_us[n]
        host_bound = measured["cores_obtained"] * 1e6 / (consume_us[n] + host_us)
        predicted = min(broker_bound, host_bound)
        return {"measured": round(measured["jobs_per_s"]), "broker_bound": round(broker_bound),
                "cores_obtained": measured["cores_obtained"],
                "host_bound": round(host_bound), "predicted": round(predicted),
                "error_pct": round((predicted / measured["jobs_per_s"] - 1) * 100, 1),
                "bound_by": "broker" if broker_bound < host_bound else "host CPU"}

    return {
        "broker_us_per_job": {"publish": round(publish_us, 2),
                              "take_and_settle_one_redis": round(consume_us[1], 2),
                              "take_and_settle_cluster": round(consume_us[SHARDS], 2)},
        "slots_and_master_us_per_job": round(host_us, 2),
        "by_shards": {str(n): bounds(n) for n in (1, 2, 3, 4, 6, 8)},
        "check": {"1": check(1, one), str(SHARDS): check(SHARDS, shards)},
    }


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "jobs_per_s": statistics.median(r["jobs_per_s"] for r in runs),
        "broker_us": statistics.median(r["cpu_us_per_job"]["broker"] for r in runs),
        "publish_us": statistics.median(r["broker_publish_us_per_job"] for r in runs),
        "slots_us": statistics.median(r["cpu_us_per_job"]["slots"] for r in runs),
        "master_us": statistics.median(r["cpu_us_per_job"]["master"] for r in runs),
        "broker_cpu_share": statistics.median(r["cpu_share"]["broker"] for r in runs),
        "cores_obtained": statistics.median(r["cores_obtained"] for r in runs),
    }


def run(seconds: float = 20.0, repeat: int = 3) -> dict[str, Any]:
    """``repeat`` windows of ``seconds`` on one Redis and on the cluster, alternating."""
    fill = int(FILL_PER_QUEUE_PER_S * (seconds + WARM_S + 2))
    base = Path(tempfile.mkdtemp(prefix="qcluster-bench-shards-"))
    cluster_url, nodes = cluster_nodes(base)
    try:
        ports = [n.port for n in nodes]
        queues = spread_queues(ports)
        one_port = int(redis.Redis.from_url(REDIS).connection_pool.connection_kwargs["port"])
        configs = {"one redis": (REDIS, [one_port]),
                   f"redis cluster, {SHARDS} shards": (cluster_url, ports)}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        for round_no in range(repeat):
            for name, (url, servers) in configs.items():
                result = run_once(url, servers, queues, seconds, fill)
                runs[name].append(result)
                print(f"  [{round_no + 1}/{repeat}] {name}: {result['jobs_per_s']:,} jobs/s, "
                      f"broker {result['cpu_share']['broker']} core "
                      f"({result['broker_node_cpu_share']}), slots "
                      f"{result['cpu_share']['slots']}, master {result['cpu_share']['master']}"
                      f", publish {result['broker_publish_us_per_job']} us/job",
                      flush=True)
    finally:
        for node in nodes:
            node.stop()
    names = list(configs)
    one, shards = _medians(runs[names[0]]), _medians(runs[names[1]])
    results = {
        "seconds": seconds, "repeat": repeat, "queues": QUEUES, "slots": QUEUES,
        "fill_per_queue": fill, "runs": runs,
        "median": {names[0]: one, names[1]: shards},
        "gain": round(shards["jobs_per_s"] / one["jobs_per_s"], 2),
        "model": model(one, shards),
    }
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "shards.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.seconds, args.repeat), indent=2))

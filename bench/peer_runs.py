"""The peers, measured the same way as qcluster: Celery, Dramatiq, RQ and arq.

Each peer is installed from PyPI into its own virtualenv under ``bench/.peers/<name>`` (arq
pins redis<6, Celery's kombu wants redis>=6.4: one environment cannot hold them all). Its
worker is started as a real process with the peer's own command line; the queue is counted
from outside, by the same observer as qcluster's slots. On Redis the peers use their own
database (``/9`` by default), flushed after every run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis
from kombu import Connection

from bench.common import (
    RABBITMQ,
    REDIS,
    ROOT,
    WINDOW_S,
    drain_rate,
    env,
    kill,
    spawn,
    stop,
    unique,
)

PEERS_DIR = ROOT / "bench" / ".peers"
#: name -> pip requirement; pinned so that a run can be repeated
PEERS = {
    "celery": "celery[redis]==5.7.0",
    "dramatiq": "dramatiq[redis,rabbitmq]==2.2.1",
    "rq": "rq==3.0.0",
    "arq": "arq==0.28.0",
}
PEER_REDIS = REDIS.rsplit("/", 1)[0] + "/9"
BROKERS = {"redis": PEER_REDIS, "rabbitmq": RABBITMQ}


def ensure_peers() -> dict[str, str]:
    """Create or refresh each peer's virtualenv; returns name -> installed version."""
    versions = {}
    for name, requirement in PEERS.items():
        venv = PEERS_DIR / name
        stamp = venv / ".installed"
        if not stamp.exists() or stamp.read_text() != requirement:
            print(f"  installing {requirement} into {venv} (once)", flush=True)
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", requirement],
                           check=True)
            stamp.write_text(requirement)
        versions[name] = subprocess.run(
            [str(venv / "bin" / "python"), "-c",
             f"import importlib.metadata as m; print(m.version({name!r}))"],
            capture_output=True, text=True, check=True).stdout.strip()
    return versions


def peer_bin(peer: str, program: str) -> str:
    return str(PEERS_DIR / peer / "bin" / program)


@dataclass
class PeerSystem:
    """One peer configuration: how to start its worker and how to count its queue."""

    peer: str
    broker: str
    worker: Callable[[str, str], list[str]]  # (queue, url) -> argv
    remaining: Callable[[str], Callable[[], int]]  # queue -> counter
    extra_env: dict[str, str] = field(default_factory=dict)

    def command(self, queue: str) -> str:
        return " ".join(self.worker(queue, BROKERS[self.broker])).replace(str(ROOT) + "/", "")


def celery_worker(pool: list[str]) -> Callable[[str, str], list[str]]:
    return lambda queue, url: [
        peer_bin("celery", "celery"), "-A", "bench.peers.celery_app", "worker", *pool,
        "-Q", queue, "-l", "WARNING", "--without-gossip", "--without-mingle",
        "--without-heartbeat"]


def dramatiq_worker(processes: int = 1) -> Callable[[str, str], list[str]]:
    return lambda queue, url: [
        peer_bin("dramatiq", "dramatiq"), "bench.peers.dramatiq_app", "--processes",
        str(processes), "--threads", "1", "-Q", queue]


def rq_worker(queue: str, url: str) -> list[str]:
    return [peer_bin("rq", "rq"), "worker", "--burst", "--quiet", "-w",
            "rq.worker.SimpleWorker", "-u", url, queue]


def arq_worker(queue: str, url: str) -> list[str]:
    return [peer_bin("arq", "arq"), "bench.peers.arq_app.WorkerSettings", "--custom-log-dict",
            "bench.peers.arq_app.QUIET_LOGS"]


def redis_count(command: str, key: Callable[[str], str]) -> Callable[[str], Callable[[], int]]:
    def counter(queue: str) -> Callable[[], int]:
        client = redis.Redis.from_url(PEER_REDIS)
        return lambda: int(client.execute_command(command, key(queue)))

    return counter


def rabbitmq_ready(queue: str) -> Callable[[], int]:
    """Messages ready in a RabbitMQ queue (those prefetched but unacked are not counted,
    which favours the peer by at most its prefetch)."""
    connection = Connection(RABBITMQ)
    channel = connection.channel()

    def ready() -> int:
        return int(channel.queue_declare(queue=queue, passive=True).message_count)

    return ready


SYSTEMS: dict[str, PeerSystem] = {
    "Celery solo, redis": PeerSystem(
        "celery", "redis", celery_worker(["--pool", "solo"]), redis_count("LLEN", str)),
    "Celery prefork -c 1, redis": PeerSystem(
        "celery", "redis", celery_worker(["--pool", "prefork", "-c", "1"]),
        redis_count("LLEN", str)),
    "Dramatiq 1 process 1 thread, default prefetch, redis": PeerSystem(
        "dramatiq", "redis", dramatiq_worker(), redis_count("HLEN", "dramatiq:{}.msgs".format)),
    "Dramatiq 1 process 1 thread, prefetch 100, redis": PeerSystem(
        "dramatiq", "redis", dramatiq_worker(), redis_count("HLEN", "dramatiq:{}.msgs".format),
        {"dramatiq_queue_prefetch": "100"}),
    "RQ SimpleWorker, redis": PeerSystem(
        "rq", "redis", rq_worker, redis_count("LLEN", "rq:queue:{}".format)),
    "arq (max_jobs 100, poll 10 ms, no results), redis": PeerSystem(
        "arq", "redis", arq_worker, redis_count("ZCARD", str)),
    "Celery solo, rabbitmq": PeerSystem(
        "celery", "rabbitmq", celery_worker(["--pool", "solo"]), rabbitmq_ready),
    "Celery prefork -c 1, rabbitmq": PeerSystem(
        "celery", "rabbitmq", celery_worker(["--pool", "prefork", "-c", "1"]), rabbitmq_ready),
    "Dramatiq 1 process 1 thread, default prefetch, rabbitmq": PeerSystem(
        "dramatiq", "rabbitmq", dramatiq_worker(), rabbitmq_ready),
    "Dramatiq 1 process 1 thread, prefetch 100, rabbitmq": PeerSystem(
        "dramatiq", "rabbitmq", dramatiq_worker(), rabbitmq_ready,
        {"dramatiq_queue_prefetch": "100"}),
}


def publish(peer: str, broker: str, queue: str, jobs: int, timed: int,
            **extra_env: str) -> dict[str, Any]:
    """Run the peer's publisher (``bench.peers.publish``) in its own environment."""
    out = subprocess.run(
        [peer_bin(peer, "python"), "-m", "bench.peers.publish", peer, str(jobs), str(timed)],
        cwd=ROOT, env=env(QB_QUEUE=queue, QB_BROKER=BROKERS[broker], **extra_env),
        capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def fill(peer: str, broker: str, queue: str, jobs: int, processes: int = 2) -> None:
    """Pre-enqueue ``jobs`` with the peer's own publisher, ``processes`` at once (Celery and
    Dramatiq publish one call per job; filling is not what is measured)."""
    share = -(-jobs // processes)
    procs = [subprocess.Popen(
        [peer_bin(peer, "python"), "-m", "bench.peers.publish", peer,
         str(min(share, jobs - i * share)), "0"],
        cwd=ROOT, env=env(QB_QUEUE=queue, QB_BROKER=BROKERS[broker]),
        stdout=subprocess.DEVNULL) for i in range(processes)]
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError(f"{peer} publisher failed with exit code {proc.returncode}")


def publish_rate(peer: str, broker: str, jobs: int, confirm: bool = False) -> float:
    """Jobs/s of the peer's own publish call, one call per job."""
    queue = unique(f"{peer}-pub")
    try:
        report = publish(peer, broker, queue, jobs, jobs, QB_CONFIRM="1" if confirm else "0")
    finally:
        clean(broker, queue)
    return float(report["timed_jobs"] / report["timed_seconds"])


def enqueue_systems(jobs: int) -> dict[str, Callable[[], float]]:
    calls = {"celery": "task.delay()", "dramatiq": "actor.send()", "rq": "Queue.enqueue()",
             "arq": "enqueue_job()"}
    runs: dict[str, Callable[[], float]] = {}
    for broker, peers in (("redis", PEERS), ("rabbitmq", ("celery", "dramatiq"))):
        for peer in peers:
            runs[f"{peer} {calls[peer]} {broker}"] = partial(publish_rate, peer, broker, jobs)
    for peer in ("celery", "dramatiq"):  # as Client.enqueue: the broker confirms each job
        runs[f"{peer} {calls[peer]} rabbitmq (confirmed)"] = partial(
            publish_rate, peer, "rabbitmq", jobs, confirm=True)
    return runs


def consume(system: PeerSystem, jobs: int) -> float:
    """Jobs/s of the peer's worker, from the first job gone, over the drain or WINDOW_S."""
    queue = unique(system.peer)
    try:
        fill(system.peer, system.broker, queue, jobs)
        proc = spawn(system.worker(queue, BROKERS[system.broker]), QB_QUEUE=queue,
                     QB_BROKER=BROKERS[system.broker], **system.extra_env)
        try:
            return drain_rate(jobs, system.remaining(queue), timeout_s=120, window_s=WINDOW_S)
        finally:
            kill(proc)
    finally:
        clean(system.broker, queue)


def clean(broker: str, queue: str) -> None:
    if broker == "redis":
        redis.Redis.from_url(PEER_REDIS).flushdb()
        return
    with Connection(RABBITMQ) as connection:
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            channel = connection.channel()
            try:
                channel.queue_delete(name)
                channel.exchange_delete(name)
            except Exception:  # a queue the peer never declared: nothing to delete
                pass


def consume_systems(jobs: int) -> dict[str, Callable[[], float]]:
    return {name: partial(consume, system, jobs) for name, system in SYSTEMS.items()}


def commands() -> dict[str, str]:
    """The exact worker command of every peer system (queue shown as QUEUE)."""
    return {name: system.command("QUEUE") + "".join(
        f"  [{k}={v}]" for k, v in system.extra_env.items())
        for name, system in SYSTEMS.items()}


def memory(processes: int = 8, ballast_mb: int = 100) -> dict[str, Any]:
    """Total PSS of Celery prefork -c 8 and Dramatiq --processes 8 with the big app, each
    against one process of the same interpreter importing the same app."""
    from bench.suites import MIB, process_tree_memory, single_process_pss

    runs = {
        "Celery prefork -c 8": ("celery", "bench.peers.celery_app",
                                celery_worker(["--pool", "prefork", "-c", str(processes)])),
        "Dramatiq --processes 8 --threads 1": ("dramatiq", "bench.peers.dramatiq_app",
                                               dramatiq_worker(processes)),
    }
    results = {}
    for name, (peer, module, worker) in runs.items():
        queue = unique("pmem")
        proc = spawn(worker(queue, PEER_REDIS), QB_QUEUE=queue, QB_BROKER=PEER_REDIS,
                     QB_BALLAST_MB=str(ballast_mb))
        try:
            tree = process_tree_memory(proc.pid, processes)
        finally:
            stop(proc)
            clean("redis", queue)
        single = single_process_pss(peer_bin(peer, "python"), module, ballast_mb)
        results[name] = {**tree, "one_process_pss_mib": round(single / MIB, 1),
                         "total_over_one_process": round(tree["total_pss_mib"] * MIB / single,
                                                         2),
                         "command": " ".join(worker("QUEUE", PEER_REDIS)).replace(
                             str(ROOT) + "/", "")}
    return results

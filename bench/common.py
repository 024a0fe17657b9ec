"""Shared plumbing: brokers, timing by an outside observer, medians, process control."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _broker_urls() -> tuple[str, str]:
    """Redis and RabbitMQ URLs: ``QB_REDIS_URL`` / ``QB_RABBITMQ_URL`` when set (an existing
    broker, or the private ones a parent bench process started), else private servers on
    free ports (tests/brokers.py), stopped when this process exits. The bench flushes its
    Redis database and fills queues: never the Redis or RabbitMQ a user runs."""
    redis_url = os.environ.get("QB_REDIS_URL", "")
    rabbitmq_url = os.environ.get("QB_RABBITMQ_URL", "")
    if redis_url and rabbitmq_url:
        return redis_url, rabbitmq_url
    from tests.brokers import BrokerUnavailable, PrivateBrokers

    base = Path(tempfile.mkdtemp(prefix="qcluster-bench-brokers-"))
    # No AOF: the published figures were measured on a Redis without AOF or snapshots.
    brokers = PrivateBrokers(base, redis_aof=False)
    atexit.register(shutil.rmtree, base, True)
    atexit.register(brokers.stop)
    # atexit runs on SIGINT (KeyboardInterrupt) and sys.exit; make SIGTERM one of those too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        redis_url = redis_url or brokers.redis_url()
        rabbitmq_url = rabbitmq_url or brokers.rabbitmq_url()
    except BrokerUnavailable as error:
        raise SystemExit(f"bench: {error}") from error
    # Inherited by every process the bench starts (env() copies os.environ).
    os.environ["QB_REDIS_URL"], os.environ["QB_RABBITMQ_URL"] = redis_url, rabbitmq_url
    print(f"bench brokers: {brokers.summary()}", flush=True)
    return redis_url, rabbitmq_url


STATE_DIR = ROOT / ".qcluster" / "bench"
EMBEDDED = f"embedded://{STATE_DIR}"
_STARTED: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """``REDIS``, ``RABBITMQ`` and ``BROKERS`` (the three by backend), started on first use:
    a bench that needs no broker (the planner's, the simulator's) starts none."""
    if name not in ("REDIS", "RABBITMQ", "BROKERS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _STARTED:
        redis_url, rabbitmq_url = _broker_urls()
        _STARTED.update(REDIS=redis_url, RABBITMQ=rabbitmq_url, BROKERS={
            "redis": redis_url, "rabbitmq": rabbitmq_url, "embedded": EMBEDDED})
    return _STARTED[name]


def unique(name: str) -> str:
    return f"bench-{name}-{uuid.uuid4().hex[:6]}"


def env(**extra: str) -> dict[str, str]:
    merged = dict(os.environ)
    merged["PYTHONPATH"] = os.pathsep.join([str(ROOT), merged.get("PYTHONPATH", "")])
    merged.pop("QCLUSTER_BROKER_URL", None)
    merged.update(extra)
    return merged


def spawn(args: list[str], **extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, cwd=ROOT, env=env(**extra), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def free_listen() -> str:
    """A free loopback address for a measured master's HTTP server (port 0 is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a measured process; one that had already exited with an error makes the figure a
    lie (a master refused at start measured 0 jobs/s), so it fails the suite instead."""
    if proc.poll() not in (None, 0):
        raise RuntimeError(f"{proc.args!r} exited with code {proc.returncode}"
                           " before its measurement ended")
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a measured process group whose queue is thrown away anyway (a graceful stop of
    some peers waits out their own timeouts)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def enqueue_noops(client: Any, queue: str, jobs: int, chunk: int = 20_000) -> None:
    """Queue ``jobs`` no-op jobs with ``Client.enqueue_many``, ``chunk`` per call (so that a
    deep fill never holds all its envelopes in memory at once)."""
    for first in range(0, jobs, chunk):
        client.enqueue_many(queue, [{}] * min(chunk, jobs - first))


#: How long a slow system is watched draining: its rate is steady within a second, long
#: before 20,000 jobs are gone (3 s were within the run-to-run noise of 5 s).
WINDOW_S = 3.0


def drain_rate(total: int, remaining: Callable[[], int], timeout_s: float = 300.0,
               window_s: float | None = None) -> float:
    """Jobs/s from the first job gone until the queue is empty, seen from outside.

    Start-up (imports, connections) is not counted: the clock starts when the count
    first drops, for every system alike. With ``window_s``, a slow system is watched for
    that long only: its rate is steady well before a deep backlog is gone.
    """
    deadline = time.monotonic() + timeout_s
    start_count = start = None
    while time.monotonic() < deadline:
        left = remaining()
        now = time.perf_counter()
        if start is None and left < total:
            start, start_count = now, left
        done = left == 0 or (window_s is not None and start is not None
                                 and now - start >= window_s)
        if done and start is not None and start_count is not None:
            # Jobs left at the first drop were all consumed within the timed span.
            return (start_count - left) / max(now - start, 1e-6)
        time.sleep(0.005)
    raise TimeoutError(f"queue not drained in {timeout_s}s ({remaining()} left)")


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": len(values)}


def python() -> str:
    return sys.executable


def versions() -> dict[str, Any]:
    from importlib.metadata import version

    import redis

    info: dict[str, Any] = {"python": sys.version.split()[0]}
    for package in ("qcluster", "kombu", "redis", "hiredis", "prometheus_client"):
        try:
            info[package] = version(package)
        except Exception:  # not installed is a fact worth printing, not a failure
            info[package] = None
    client = redis.Redis.from_url(__getattr__("REDIS"))
    info["redis-server"] = client.info("server")["redis_version"]
    client.close()
    return info

"""``python -m bench.take_instructions [--before REV]``: a take's cost to the Redis server.

The take is the hot path, and most of its cost is the Redis server's (one Lua script per
batch). This counts, with valgrind's callgrind, the instructions a private ``redis-server``
executes for takes of the current tree's scripts and of ``REV``'s (default ``HEAD``): each
variant runs twice, a short and a long series on a fresh server, and the difference divided
by the difference in calls is the cost per call without start-up. Instruction counts do
not move with the machine's load, unlike CPU time, except the server's timer work (it runs
a few times a second of wall time): on a loaded machine, repeat a figure before trusting a
change of a few percent. Two calls are measured, each on jobs
published beforehand: ``take`` alone, and ``settle_take`` (the slot's loop: the acks of the previous
batch, then the next take), at batch 100 and batch 1.

Prints JSON (instructions per call and the change). Takes a few minutes: the server runs
some 50 times slower under callgrind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
LUA = "qcluster/broker/lua"
TOTALS = re.compile(r"^(?:totals|summary): (\d+)", re.MULTILINE)
BATCHES = (100, 1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _source(rev: str | None, name: str) -> str:
    if rev is None:
        return (ROOT / LUA / f"{name}.lua").read_text()
    return subprocess.run(["git", "show", f"{rev}:{LUA}/{name}.lua"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def _settle_take(settle: str, take: str) -> str:
    """The combined script as the tree that holds ``settle`` and ``take`` builds it."""
    if "ARGV[3]" in take:  # a take token: settle_take.lua presents it
        wrapper = (ROOT / LUA / "settle_take.lua").read_text()
    else:
        wrapper = ("local n = tonumber(ARGV[1])\n"
                   "settle(KEYS, {unpack(ARGV, 2, n + 1)})\n"
                   "return take({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, "
                   "{unpack(ARGV, n + 2, #ARGV)})\n")
    return ("local function settle(KEYS, ARGV)\n" + settle + "\nend\n"
            "local function take(KEYS, ARGV)\n" + take + "\nend\n" + wrapper)


class Variant:
    """One tree's take and settle_take, called the way its broker calls them."""

    def __init__(self, client: redis.Redis, rev: str | None) -> None:
        take, settle = _source(rev, "take"), _source(rev, "settle")
        self.replayable = "ARGV[3]" in take
        #: settle.lua's ARGV starts with every section's count (13 values), or with 6.
        self.counts_first = "ARGV[13]" in settle
        self.take = client.register_script(take)
        self.settle_take = client.register_script(_settle_take(settle, take))
        self.taker = uuid.uuid4().hex[:16]
        self.count = 0

    def keys(self, queue: str) -> list[str]:
        base = f"qc:{{{queue}}}"
        names = ("ready", "locked", "jobs", "attempts", "dead", "reasons", "wake", "errors",
                 "finished")
        return [f"{base}:{name}" for name in names] + [f"{base}:taken:{self.taker}"]

    def call(self, kind: str, queue: str, batch: int, held: list[Any]) -> list[Any]:
        keys = self.keys(queue)
        self.count += 1
        take_args: list[Any] = [batch, 60_000]
        if self.replayable:
            take_args.append(f"bench:{self.count}")
        if kind == "take":
            reply = self.take(keys=keys[:4] + keys[9:] if self.replayable else keys[:4],
                              args=take_args)
        else:
            if self.counts_first:
                settle_args = [len(held), 0, 0, 0, 0, 0, 0, 0, 10_000, 14 * 86_400_000, 0, 0, 0,
                               *held]
            else:
                settle_args = [len(held), 0, 0, 0, 10_000, 14 * 86_400_000, *held]
            reply = self.settle_take(keys=keys if self.replayable else keys[:9],
                                     args=[len(settle_args), *settle_args, *take_args])
        return list(reply[3::4])


def _server(work: Path) -> tuple[subprocess.Popen[bytes], redis.Redis, Path]:
    """A private redis-server under callgrind, answering."""
    out, port = work / f"cg.{uuid.uuid4().hex[:8]}", _free_port()
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "redis-server",
         "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         # hz 1: the server's timer work grows with wall time, which callgrind and a loaded
         # machine stretch unevenly; the fewer timer runs, the less it blurs the difference.
         "--hz", "1", "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=600)
    for _ in range(3000):
        try:
            client.ping()
            return server, client, out
        except redis.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError("redis-server under callgrind did not answer")


def run(work: Path, rev: str | None, kind: str, batch: int, calls: int, jobs: int) -> int:
    """Instructions of a whole server life: start, ``jobs`` published, ``calls`` calls."""
    server, client, out = _server(work)
    try:
        variant = Variant(client, rev)
        queue = "bench"
        pipe = client.pipeline(transaction=False)
        for start in range(0, jobs, 1000):
            ids = range(start, min(jobs, start + 1000))
            pipe.zadd(f"qc:{{{queue}}}:ready", {f"job-{i:08d}": 0 for i in ids})
            pipe.hset(f"qc:{{{queue}}}:jobs", mapping={
                f"job-{i:08d}": b'{"payload":null}' * 4 for i in ids})
        pipe.execute()
        held = variant.call("take", queue, batch, [])  # loads both scripts' first use
        variant.call("settle_take", queue, batch, held)
        held = []
        for _ in range(calls):
            held = variant.call(kind, queue, batch, held)
            assert len(held) == batch, "ran out of jobs"
        with contextlib.suppress(redis.ConnectionError):
            client.shutdown(nosave=True)
    finally:
        server.wait(timeout=600)
    match = TOTALS.search(out.read_text())
    assert match, "callgrind wrote no totals"
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD", help="the tree compared with (a git rev)")
    parser.add_argument("--small", type=int, default=10, help="calls of the short run")
    parser.add_argument("--large", type=int, default=60, help="calls of the long run")
    parser.add_argument("--kind", choices=("take", "settle_take"), action="append",
                        help="only this call (again for both; default: both)")
    parser.add_argument("--batch", type=int, action="append",
                        help=f"only this batch size (default: {BATCHES})")
    options = parser.parse_args()
    if not shutil.which("valgrind"):
        raise SystemExit("bench: valgrind is not installed")
    work = Path(tempfile.mkdtemp(prefix="qcluster-take-instr-"))
    result: dict[str, Any] = {}
    try:
        for kind in options.kind or ("take", "settle_take"):
            for batch in options.batch or BATCHES:
                jobs = batch * (options.large + 3)
                for name, rev in (("before", options.before), ("after", None)):
                    small = run(work, rev, kind, batch, options.small, jobs)
                    large = run(work, rev, kind, batch, options.large, jobs)
                    result[f"{kind} batch {batch} {name}"] = round(
                        (large - small) / (options.large - options.small))
                base = f"{kind} batch {batch}"
                before, after = result[f"{base} before"], result[f"{base} after"]
                result[f"{base} change"] = f"{(after - before) / before:+.1%}"
                print(json.dumps({key: v for key, v in result.items() if key.startswith(base)}),
                      flush=True)
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

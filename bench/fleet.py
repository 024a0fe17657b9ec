"""The live fleet: one real manager, many real masters, an app of many queues, measured.

    python -m bench.fleet [--sizes 10x30,10x150,40x30,40x150] [--seconds 60]
                          [--slots-per-master 4] [--rate 300] [--no-browser]
                          [--manager-nice -10]

Each size ``MxQ`` starts, on the bench's private Redis, one ``qcluster manager`` (through
bench/fleet_manager.py, which adds timings and nothing else), ``M`` real ``qcluster master``
processes (each its own ``--host-name`` and port, at most ``--slots-per-master`` slots
each: ``M x`` that many real slots in all) and an app of ``Q`` queues (bench/fleet_app.py),
then a producer whose total rate swings between 0.4x and 1.6x ``--rate`` jobs/s, spread over
the queues by their weight. After a warm-up it measures, for ``--seconds``, with the admin
overview open (fetched every 3 s, as its refresh does):

- the manager's CPU (share of a core, and per planning round: the round thread's CPU and
  how long it held the state lock), and how long its threads waited for a CPU (the
  machine's load: ``manager_cpu_wait_share``, seconds per second summed over its threads);
- each report's time from arrival to reply (p50, p99), and each phase's: before the service
  is called, the state lock's wait, the work under it, after; the event loop's wait for a
  CPU meanwhile (bench/fleet_manager.py);
- ``/api/v1/cluster``: size and time (p50, p99 over 20 reads);
- the admin overview's and a queue page's load time in headless Chromium, DOM size, and
  where the overview's load goes (the server's answer, the transfer, the parse, the
  scripts, the rest: Navigation Timing);
- the broker commands the manager issues per round (Redis MONITOR, by the manager's ports);
- each master's CPU (share of a core) and RSS.

Writes bench/results/fleet.json, draws its figures against the masters in
docs/img/fleet-growth.svg (bench/fleet_plot.py) and prints a table. Every process it starts
is stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
import redis

from bench import fleet_plot
from bench.fleet_app import queue_shapes
from qcluster.client import Client

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "fleet.json"
TOKEN = "fleet-bench-token-7c2e91d4a8b3"
INTERVAL_S = 2.0
WARM_UP_S = 20.0
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]
#: Checked at the largest size run (the targets are set for 40 masters x 150 queues).
TARGETS = {
    "manager_core_share": ("<", 0.15, "manager CPU, share of a core"),
    "report_p99_ms": ("<", 50.0, "report reply p99 (ms)"),
    "overview_load_s": ("<", 1.0, "admin overview load in Chromium (s)"),
    "cluster_json_kib": ("<", 1024.0, "/api/v1/cluster size (KiB)"),
}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


class Fleet:
    """One size: its processes, its producer, its measurements."""

    def __init__(self, redis_url: str, masters: int, queues: int, slots_per_master: int,
                 workdir: Path, manager_nice: int = 0) -> None:
        self.redis_url, self.masters, self.queues = redis_url, masters, queues
        self.manager_nice = manager_nice
        self.workdir = workdir
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.master_procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "QCLUSTER_TOKEN": TOKEN, "QB_FLEET_QUEUES": str(queues),
                    "PYTHONPATH": str(ROOT)}
        self.env.pop("QCLUSTER_BROKER_URL", None)
        self.config = workdir / "qcluster.toml"
        self.config.write_text(f"[master]\nmax_slots = {slots_per_master}\n"
                               f"report_interval_s = {INTERVAL_S}\n")

    def start(self, name: str, args: list[str], nice: int = 0) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=(lambda: set_nice(nice)) if nice else None)
        self.procs.append(proc)
        return proc

    def start_all(self) -> None:
        self.manager = self.start("manager", [
            "-m", "bench.fleet_manager", "--broker", self.redis_url, "--config",
            str(self.config), "--listen", f"127.0.0.1:{self.port}", "--interval",
            str(INTERVAL_S), "--log-level", "WARNING"], nice=self.manager_nice)
        wait_for(lambda: self.get("/healthz") is not None, 60, "the manager")
        for index in range(self.masters):
            self.master_procs.append(self.start(f"master-{index:02d}", [
                "-m", "qcluster", "master", "--app", "bench.fleet_app", "--broker",
                self.redis_url, "--config", str(self.config), "--manager",
                f"http://127.0.0.1:{self.port}", "--host-name", f"fleet-host-{index:02d}",
                "--listen", f"127.0.0.1:{free_port()}", "--log-level", "WARNING"]))
        wait_for(self.all_reported, 120, f"{self.masters} masters reporting")

    def all_reported(self) -> bool:
        view = self.get("/api/v1/cluster")
        return bool(view) and sum(1 for host in view["hosts"] if host["alive"]) >= self.masters

    def get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        with suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())
        return None

    def stop(self) -> None:
        for proc in self.procs:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def set_nice(nice: int) -> None:
    """This process's nice value, and its session's: with the kernel's autogroups each
    session (every master is one) shares the CPUs as a group, whatever its nice value."""
    os.nice(nice)
    with suppress(OSError), open("/proc/self/autogroup", "w") as autogroup:
        autogroup.write(str(nice))


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise SystemExit(f"fleet bench: timed out after {timeout_s:g} s waiting for {what}")


@contextmanager
def producing(redis_url: str, queues: int, rate: float) -> Iterator[dict[str, int]]:
    """A producer thread: total rate ``rate * (1 + 0.6 sin(2 pi t / 60 s))`` jobs/s, each
    queue its weight's share, enqueued every 0.2 s in one call per queue."""
    shapes = queue_shapes(queues)
    stop = threading.Event()
    sent = {"jobs": 0}
    owed = [0.0] * len(shapes)

    def run() -> None:
        started = time.monotonic()
        with Client(redis_url) as client:
            while not stop.wait(0.2):
                now_rate = rate * (1 + 0.6 * math.sin(2 * math.pi * (time.monotonic()
                                                                      - started) / 60))
                for index, shape in enumerate(shapes):
                    owed[index] += now_rate * shape.weight * 0.2
                    count = int(owed[index])
                    if count:
                        owed[index] -= count
                        client.enqueue_many(shape.name, [{"n": n} for n in range(count)])
                        sent["jobs"] += count

    thread = threading.Thread(target=run, name="producer", daemon=True)
    thread.start()
    try:
        yield sent
    finally:
        stop.set()
        thread.join(timeout=10)


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def manager_commands(redis_url: str, manager_pid: int, seconds: float) -> int:
    """Commands the manager's connections sent to Redis during ``seconds`` (MONITOR)."""
    ports = {conn.laddr.port for conn in psutil.Process(manager_pid).net_connections("tcp")
             if conn.raddr and conn.raddr.port == redis.Redis.from_url(redis_url)
             .connection_pool.connection_kwargs["port"]}
    client = redis.Redis.from_url(redis_url)
    count = 0
    deadline = time.monotonic() + seconds
    with client.monitor() as monitor:
        for command in monitor.listen():
            address = str(command.get("client_address", ""))
            port = str(command.get("client_port", ""))
            if address and port.isdigit() and int(port) in ports:
                count += 1
            if time.monotonic() > deadline:
                break
    return count


#: Where a page's load went, from the browser's Navigation Timing (ms from the start):
#: the server's answer (request sent -> first byte), the body's transfer, the HTML parsed
#: into the DOM (to domInteractive), the deferred script and DOMContentLoaded, the rest to
#: the load event (styles, layout, sub-resources).
NAVIGATION_SPLIT = """() => {
  const n = performance.getEntriesByType("navigation")[0];
  return {server_ms: n.responseStart - n.requestStart,
          transfer_ms: n.responseEnd - n.responseStart,
          parse_ms: n.domInteractive - n.responseEnd,
          scripts_ms: n.domContentLoadedEventEnd - n.domInteractive,
          rest_ms: n.loadEventStart - n.domContentLoadedEventEnd,
          load_ms: n.loadEventStart - n.startTime};
}"""


def page_load(url: str, samples: int = 3) -> dict[str, float]:
    """The page's load in headless Chromium: median seconds to the load event, DOM size,
    and the median of each part of the load (``NAVIGATION_SPLIT``)."""
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium")
    if executable is None:
        raise SystemExit("fleet bench: Debian's chromium is not installed (make sysdeps)")
    times: list[float] = []
    splits: list[dict[str, float]] = []
    dom_kib = 0.0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            for _ in range(samples):
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                started = time.perf_counter()
                page.goto(url, wait_until="load", timeout=120_000)
                times.append(time.perf_counter() - started)
                splits.append(page.evaluate(NAVIGATION_SPLIT))
                dom_kib = len(page.content()) / 1024
                page.close()
        finally:
            browser.close()
    return {"load_s": statistics.median(times), "dom_kib": round(dom_kib, 1),
            **{part: round(statistics.median(split[part] for split in splits), 1)
               for part in splits[0]}}


@contextmanager
def overview_open(fleet: Fleet) -> Iterator[None]:
    """An operator's open overview while the reports are measured: the page's refresh
    fetches it every ``REFRESH_S`` (each fetch builds the cluster view under the manager's
    state lock, as the reports take it)."""
    from qcluster.admin_ui.router import REFRESH_S

    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(REFRESH_S):
            with suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{fleet.port}/", timeout=60) as response:
                response.read()

    thread = threading.Thread(target=refresh, name="overview", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=70)


def cluster_reads(fleet: Fleet, count: int = 20) -> dict[str, float]:
    times: list[float] = []
    size = 0
    for _ in range(count):
        started = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{fleet.port}/api/v1/cluster",
                                    timeout=60) as response:
            size = len(response.read())
        times.append(time.perf_counter() - started)
        time.sleep(0.1)
    return {"cluster_p50_ms": percentile(times, 0.5) * 1000,
            "cluster_p99_ms": percentile(times, 0.99) * 1000, "cluster_json_kib": size / 1024}


def measure(fleet: Fleet, seconds: float, browser: bool) -> dict[str, Any]:
    manager = psutil.Process(fleet.manager.pid)
    masters = [psutil.Process(proc.pid) for proc in fleet.master_procs]
    before = (fleet.get("/bench/timings") or {}).get("threads", {})  # drops the warm-up's
    manager_cpu, master_cpu = cpu_seconds(manager), [cpu_seconds(m) for m in masters]
    started = time.monotonic()
    with overview_open(fleet):
        commands = manager_commands(fleet.redis_url, manager.pid, min(20.0, seconds / 2))
        monitored_s = time.monotonic() - started
        time.sleep(max(0.0, seconds - monitored_s))
    wall = time.monotonic() - started
    manager_share = (cpu_seconds(manager) - manager_cpu) / wall
    master_shares = [(cpu_seconds(m) - before) / wall for m, before in zip(masters, master_cpu,
                                                                           strict=True)]
    timings = fleet.get("/bench/timings") or {}
    rounds = timings.get("round_cpu_s", [])
    reports = timings.get("report_s", [])
    figures: dict[str, Any] = {
        "masters": fleet.masters, "queues": fleet.queues, "seconds": round(wall, 1),
        "manager_nice": fleet.manager_nice, "load_average": round(os.getloadavg()[0], 1),
        "slots": sum(sum(h["slots"].values()) for h in (fleet.get("/api/v1/cluster") or
                                                        {"hosts": []})["hosts"]),
        "manager_core_share": round(manager_share, 4),
        "manager_rss_mib": round(manager.memory_info().rss / 2**20, 1),
        "rounds": len(rounds),
        "round_cpu_ms_median": round(statistics.median(rounds) * 1000, 2) if rounds else None,
        "round_cpu_ms_p99": round(percentile(rounds, 0.99) * 1000, 2) if rounds else None,
        "reports": len(reports),
        "report_p50_ms": round(percentile(reports, 0.5) * 1000, 2),
        "report_p99_ms": round(percentile(reports, 0.99) * 1000, 2),
        **report_phases(timings),
        **lock_holds(timings),
        "manager_cpu_wait_share": cpu_wait_share(before, timings.get("threads", {}), wall),
        "manager_commands_per_round": round(commands / max(1.0, monitored_s / INTERVAL_S), 1),
        "master_core_share_median": round(statistics.median(master_shares), 4),
        "master_core_share_max": round(max(master_shares), 4),
        "master_rss_mib_median": round(statistics.median(
            m.memory_info().rss / 2**20 for m in masters), 1),
        **{key: round(value, 2) for key, value in cluster_reads(fleet).items()},
    }
    if browser:
        base = f"http://127.0.0.1:{fleet.port}"
        overview, queue_page = page_load(f"{base}/"), page_load(f"{base}/queues/fleet-000")
        figures.update(overview_load_s=round(overview["load_s"], 3),
                       overview_dom_kib=overview["dom_kib"],
                       queue_page_load_s=round(queue_page["load_s"], 3),
                       queue_page_dom_kib=queue_page["dom_kib"],
                       **{f"overview_{part}": value for part, value in overview.items()
                          if part.endswith("_ms")})
    return figures


def report_phases(timings: dict[str, Any]) -> dict[str, float]:
    """Where the reports' time went (ms, p50 and p99 of each phase; bench/fleet_manager.py):
    before the service is called, the state lock's wait, the work under it, after it; and
    how long the event loop's thread waited for a CPU meanwhile (the machine's load)."""
    found = {}
    for phase in ("before", "lock_wait", "work", "after", "loop_cpu_wait"):
        values = timings.get(f"report_{phase}_s", [])
        for name, fraction in (("p50", 0.5), ("p99", 0.99)):
            found[f"report_{phase}_{name}_ms"] = round(percentile(values, fraction) * 1000, 2)
    return found


def lock_holds(timings: dict[str, Any]) -> dict[str, float]:
    """How long the state lock is held: by each round (all its holds, summed), and by each
    reader's hold (the views, the controls; not the reports)."""
    rounds = timings.get("round_lock_held_s", [])
    readers = timings.get("reader_lock_held_s", [])
    return {"round_lock_held_ms_median": round(percentile(rounds, 0.5) * 1000, 2),
            "round_lock_held_ms_max": round(max(rounds, default=math.nan) * 1000, 2),
            "reader_lock_held_ms_p99": round(percentile(readers, 0.99) * 1000, 2)}


def cpu_wait_share(before: dict[str, float], after: dict[str, float], wall: float) -> float:
    """Seconds the manager's threads waited for a CPU (runnable, not running) per second of
    the measurement, summed over its threads: the machine's load, not the manager's."""
    if "cpu_wait_s" not in before or "cpu_wait_s" not in after:
        return math.nan
    return round((after["cpu_wait_s"] - before["cpu_wait_s"]) / wall, 3)


def run_size(redis_url: str, masters: int, queues: int, args: argparse.Namespace) -> dict[str, Any]:
    redis.Redis.from_url(redis_url).flushdb()
    with tempfile.TemporaryDirectory(prefix="qcluster-fleet-") as tmp:
        fleet = Fleet(redis_url, masters, queues, args.slots_per_master, Path(tmp),
                      args.manager_nice)
        try:
            print(f"fleet {masters} masters x {queues} queues: starting", flush=True)
            fleet.start_all()
            with producing(redis_url, queues, args.rate) as sent:
                time.sleep(WARM_UP_S)
                figures = measure(fleet, args.seconds, not args.no_browser)
            figures["jobs_enqueued"] = sent["jobs"]
        except BaseException:
            for log in sorted(Path(tmp).glob("manager.log")):
                print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        finally:
            fleet.stop()
    print(json.dumps(figures), flush=True)
    return figures


def private_redis() -> tuple[str, Any]:
    url = os.environ.get("QB_REDIS_URL", "")
    if url:
        return url, None
    from tests.brokers import PrivateBrokers

    base = Path(tempfile.mkdtemp(prefix="qcluster-fleet-brokers-"))
    brokers = PrivateBrokers(base, redis_aof=False)
    return brokers.redis_url(), (brokers, base)


def targets_met(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    largest = max(rows, key=lambda row: (row["masters"], row["queues"]))
    checks = []
    for key, (op, bound, what) in TARGETS.items():
        value = largest.get(key)
        met = value is not None and (value < bound if op == "<" else value > bound)
        checks.append({"what": f"{what} at {largest['masters']} masters x "
                               f"{largest['queues']} queues", "value": value,
                       "target": f"{op} {bound:g}", "met": met})
    return checks


def run(sizes: str = "10x30,10x150,40x30,40x150", seconds: float = 60.0,
        slots_per_master: int = 4, rate: float = 300.0, browser: bool = True,
        manager_nice: int = 0) -> dict[str, Any]:
    """Every size in ``sizes`` (``MxQ,...``), one after the other: their rows and targets."""
    args = argparse.Namespace(seconds=seconds, slots_per_master=slots_per_master, rate=rate,
                              no_browser=not browser, manager_nice=manager_nice)
    redis_url, owned = private_redis()
    try:
        rows = [run_size(redis_url, masters, queues, args)
                for masters, queues in parse_sizes(sizes)]
    finally:
        if owned is not None:
            owned[0].stop()
            shutil.rmtree(owned[1], ignore_errors=True)
    return {"rows": rows, "targets": targets_met(rows)}


def parse_sizes(sizes: str) -> list[tuple[int, int]]:
    parsed = []
    for size in sizes.split(","):
        masters, _, queues = size.partition("x")
        parsed.append((int(masters), int(queues)))
    return parsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10x30,10x150,40x30,40x150")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--slots-per-master", type=int, default=4)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--no-browser", action="store_true")
    parser.add_argument("--manager-nice", type=int, default=0,
                        help="the manager's nice value (-10: ahead of the masters and slots "
                             "sharing its cores, as on a machine of its own; needs root)")
    args = parser.parse_args(argv)
    result = {"command": "python -m bench.fleet " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              **run(args.sizes, args.seconds, args.slots_per_master, args.rate,
                    not args.no_browser, args.manager_nice)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS} and {fleet_plot.write(result)}")
    for check in result["targets"]:
        print(f"{'met ' if check['met'] else 'MISS'} {check['what']}: {check['value']} "
              f"(target {check['target']})")



#: The columns of the fleet table (bench/results/latest.md, docs/benchmarks.md).
COLUMNS = (("masters", "masters"), ("queues", "queues"), ("slots", "slots"),
           ("manager_core_share", "manager core share"), ("round_cpu_ms_median", "round CPU ms"),
           ("report_p50_ms", "report p50 ms"), ("report_p99_ms", "report p99 ms"),
           ("cluster_json_kib", "/api/v1/cluster KiB"), ("cluster_p99_ms", "its p99 ms"),
           ("overview_load_s", "overview load s"), ("overview_dom_kib", "its DOM KiB"),
           ("queue_page_load_s", "queue page s"),
           ("manager_commands_per_round", "manager broker commands/round"),
           ("master_core_share_median", "master core share"),
           ("master_rss_mib_median", "master RSS MiB"))


def markdown_rows(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## fleet", "", "| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "---:|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(key, "")) for key, _ in COLUMNS) + " |")
    return [*lines, ""]


if __name__ == "__main__":
    main()

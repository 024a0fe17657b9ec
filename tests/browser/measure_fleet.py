"""Measure the admin overview and ``/api/v1/cluster`` at fleet size.

    python -m tests.browser.measure_fleet [--hosts 40] [--queues 150] [--slots 3500]

A real ``qcluster manager`` on a private Redis; the hosts are not real: their reports are
real report JSON (``tests/browser/fleet_reports.py``) posted every 2 s by this script, as 40
masters would. Then ``/api/v1/cluster`` is fetched ``--samples`` times (size, p50, p99) and
the overview is loaded in Debian's headless Chromium (load time, DOM size). Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from tests.brokers import PrivateRedis, free_port
from tests.browser.conftest import CHROMIUM_ARGS
from tests.browser.fleet_reports import host_report, post_report, queue_names

TOKEN = "measure-fleet-token-0123456789"


def _feed(url: str, hosts: int, names: list[str], per_host: int, stop: threading.Event) -> None:
    while not stop.is_set():
        started = time.monotonic()
        for host in range(hosts):
            try:
                post_report(url, host_report(host, names, per_host), TOKEN)
            except OSError:  # the manager not listening yet
                break
        stop.wait(max(0.0, 2.0 - (time.monotonic() - started)))


def _wait_ready(url: str, hosts: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/api/v1/cluster", timeout=30) as response:
                view = json.loads(response.read())
            if len(view["hosts"]) == hosts and any(q["slots_planned"] for q in view["queues"]):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the manager never showed every host")


def _cpu_s(processes: list[psutil.Process]) -> float:
    """CPU seconds (user + system) the processes used so far: on a shared, loaded machine
    the CPU a page costs says more than its wall-clock time."""
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _browser_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "chrom" in p.name().lower()]


def _api(url: str, samples: int, manager: psutil.Process) -> dict[str, Any]:
    times, size = [], 0
    cpu_before = _cpu_s([manager])
    for _ in range(samples):
        started = time.perf_counter()
        with urllib.request.urlopen(url + "/api/v1/cluster", timeout=30) as response:
            size = len(response.read())
        times.append(time.perf_counter() - started)
    cpu = (_cpu_s([manager]) - cpu_before) / samples
    times.sort()
    return {"bytes": size, "p50_ms": round(statistics.median(times) * 1000, 1),
            "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1000, 1),
            "manager_cpu_ms_per_request_reports_included": round(cpu * 1000, 1)}


def _page(url: str, path: str, loads: int, manager: psutil.Process) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("Debian's chromium is not installed")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(url + path, wait_until="load")  # the browser's own start is not counted
        times, cpus, server = [], [], []
        for _ in range(loads):
            browser_procs = _browser_processes()
            cpu_before, server_before = _cpu_s(browser_procs), _cpu_s([manager])
            started = time.perf_counter()
            page.goto(url + path, wait_until="load")
            times.append(time.perf_counter() - started)
            cpus.append(_cpu_s(browser_procs) - cpu_before)
            server.append(_cpu_s([manager]) - server_before)
        dom = page.evaluate("document.documentElement.outerHTML.length")
        elements = page.evaluate("document.getElementsByTagName('*').length")
        browser.close()
    times.sort()
    return {"path": path, "load_ms": [round(t * 1000) for t in times],
            "browser_cpu_ms": sorted(round(c * 1000) for c in cpus),
            "manager_cpu_ms_reports_included": sorted(round(c * 1000) for c in server),
            "median_ms": round(statistics.median(times) * 1000), "dom_chars": dom,
            "elements": elements}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=40)
    parser.add_argument("--queues", type=int, default=150)
    parser.add_argument("--slots", type=int, default=3500)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--loads", type=int, default=5)
    args = parser.parse_args()
    names = queue_names(args.queues)
    with tempfile.TemporaryDirectory() as folder:
        redis = PrivateRedis(Path(folder) / "redis", aof=False)
        redis.start()
        config = Path(folder) / "qcluster.toml"
        config.write_text(f'token = "{TOKEN}"\n[manager]\ninterval_s = 2.0\n')
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        manager = subprocess.Popen(
            [sys.executable, "-m", "qcluster", "manager", "--config", str(config), "--broker",
             redis.url, "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING"])
        process = psutil.Process(manager.pid)
        stop = threading.Event()
        try:
            time.sleep(1.0)
            feeder = threading.Thread(target=_feed, daemon=True, args=(
                url, args.hosts, names, args.slots // args.hosts, stop))
            feeder.start()
            _wait_ready(url, args.hosts)
            time.sleep(4.0)  # a few rounds planned
            result = {"hosts": args.hosts, "queues": args.queues, "slots": args.slots,
                      "loadavg": os.getloadavg(),
                      "cluster_api": _api(url, args.samples, process),
                      "overview": _page(url, "/", args.loads, process),
                      "queue_page": _page(url, f"/queues/{names[0]}", args.loads, process)}
            print(json.dumps(result, indent=1))
        finally:
            stop.set()
            manager.terminate()
            manager.wait(timeout=30)
            redis.stop()


if __name__ == "__main__":
    main()

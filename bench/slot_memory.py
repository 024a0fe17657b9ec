"""A no-op slot's own memory: PSS and Private_Dirty of the slots of a master running 8
no-op slots (an app that allocates nothing), idle and after 25,000 jobs each, with the
slot's Private_Dirty per mapping.

``python -m bench.slot_memory`` prints the figures and the per-mapping table as JSON;
``make bench`` runs it in the memory suite. Targets: PSS <= 12 MiB idle, Private_Dirty
<= 6 MiB after 25,000 jobs. ``--jobs N`` / ``--slots N`` measure after fewer jobs (a
slot holds no more after 5,000 jobs than after 25,000: a quicker check of a change).

Eight slots, not one: a page the master writes after the fork is copied for the master,
and the original stays shared by the slots; with a single slot it would count as that
slot's private memory although the slot never wrote it.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections import Counter
from typing import Any

from bench.common import REDIS, enqueue_noops, free_listen, python, spawn, stop, unique
from qcluster.client import Client

MIB = 1 << 20
SLOTS = 8
JOBS_EACH = 25_000
#: What the issue asks of a no-op slot.
TARGET_PSS_MIB = 12.0
TARGET_DIRTY_MIB = 6.0


def rollup(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` in bytes, by field."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle.readlines()[1:]:
            name, _, value = line.partition(":")
            fields[name] = int(value.split()[0]) * 1024
    return fields


def dirty_by_mapping(pid: int) -> dict[str, float]:
    """Private_Dirty (KiB) per mapping name (files by base name; [anon], [heap]...)."""
    found: Counter[str] = Counter()
    name = "[anon]"
    with open(f"/proc/{pid}/smaps") as handle:
        for line in handle:
            parts = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                name = parts[5] if len(parts) > 5 else "[anon]"
                name = os.path.basename(name) if name.startswith("/") else name
            elif parts[0] == "Private_Dirty:":
                found[name] += int(parts[1])
    return {key: kib for key, kib in found.most_common() if kib}


def _slots_of(master: int) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(master).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _sample(master: int, slots: list[int]) -> dict[str, Any]:
    samples = [rollup(pid) for pid in slots]
    pss = [s["Pss"] / MIB for s in samples]
    dirty = [s["Private_Dirty"] / MIB for s in samples]
    return {"pss_mib": round(statistics.median(pss), 2),
            "private_dirty_mib": round(statistics.median(dirty), 2),
            "private_dirty_range_mib": [round(min(dirty), 2), round(max(dirty), 2)],
            "master_pss_mib": round(rollup(master)["Pss"] / MIB, 1),
            "by_mapping_kib": dirty_by_mapping(slots[0])}


def noop_slot_memory(slots: int = SLOTS, jobs_each: int = JOBS_EACH) -> dict[str, Any]:
    """Idle (after 5 s) and after ``jobs_each`` no-op jobs per slot (batch 100, Redis)."""
    queue = unique("slotmem")
    proc = spawn([python(), "-m", "qcluster", "master", "--app", "bench.apps", "--broker", REDIS,
                  "--slots", f"{queue}={slots}", "--listen", free_listen(),
                  "--log-level", "WARNING"], QB_QUEUE=queue, QB_BALLAST_MB="0")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_slots_of(proc.pid)) < slots:
            time.sleep(0.3)
        time.sleep(5)
        pids = _slots_of(proc.pid)
        idle = _sample(proc.pid, pids)
        with Client(REDIS) as client:
            enqueue_noops(client, queue, jobs_each * slots)
            while sum(client.stats(queue)[key] for key in ("ready", "locked")):
                time.sleep(0.2)
            client.purge(queue)
        time.sleep(2)
        busy = _sample(proc.pid, pids)
    finally:
        stop(proc)
    return {"slots": slots, "jobs_each": jobs_each, "idle": idle, "after_jobs": busy,
            "target_pss_mib": TARGET_PSS_MIB, "target_private_dirty_mib": TARGET_DIRTY_MIB}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.slot_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=SLOTS)
    parser.add_argument("--jobs", type=int, default=JOBS_EACH, help="jobs per slot")
    options = parser.parse_args()
    print(json.dumps(noop_slot_memory(options.slots, options.jobs), indent=2))

"""Chaos rows for process faults (issue 16): F2, F3, F4, F5, F12, F13.

Real ``qcluster master`` / ``manager`` processes run ``tests.chaos.process_apps`` on the embedded
broker; every job is counted by the ledger (tests/chaos/ledger.py). What is killed, and how
its end is seen:

- F2 (core) a hung slot, three ways (it SIGSTOPs itself, a busy loop, a sleep far past
  its deadline): the master kills it within batch_timeout + the kill margin, and no job
  runs in two slots at once (the ledger's start, finish and ``alive`` lines).
- F3 a memory hog (over ``memory_kill_factor`` x its limit at once) is killed within the
  master's memory sampling interval.
- F4 (core) the master SIGKILLed on a schedule: no slot of it outlives it by 5 s (its
  session, read from /proc), 0 lost.
- F5 (core) the manager SIGKILLed on a schedule: the masters keep the throughput (>= 90% of
  the throughput before the kill) and one embedded redis-server serves the data directory.
- F12 one master's clock 2 h ahead or behind (libfaketime): no duplicate execution.
- F13 (core) SIGTERM to masters under load: 0 lost, 0 duplicate executions.

The short profile (make test) injects 2 faults per row; ``QC_CHAOS_PROFILE=full`` (make
chaos) the issue's periods. The schedule (victim, gaps, modes) comes from the row's seed.
Waits are conditions with deadlines; the thresholds measured in seconds are the product's
own promises (the kill margin, the sampling interval, the 5 s orphan bound).
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qcluster import Client
from qcluster.broker.embedded import socket_path, stop_embedded
from qcluster.master.supervisor import MEMORY_PROBE_INTERVAL_S, TICK_S
from qcluster.policy import kill_margin
from tests.chaos import process_apps as papps
from tests.chaos import process_kills as faults
from tests.chaos.conftest import ChaosBroker, ChaosRun, delete_queues
from tests.chaos.ledger import LEDGER_ENV, Producer
from tests.chaos.process_cluster import (
    Hosts,
    SlotWatch,
    SteadyProducer,
    orphans_after,
    overlaps,
    runs_by_id,
    signal_master,
    write_config,
)
from tests.chaos.rows import RowResult, by_profile
from tests.conftest import ROOT, wait_until
from tests.e2e.cluster import Procs, get_text, try_json

#: A SIGKILLed master's slots must be gone within this (PR_SET_PDEATHSIG).
ORPHAN_BOUND_S = 5.0
#: Jobs one slot can hold when it dies: a take of read-ahead plus the batch run before it
#: whose acks wait for the next take (the slot settles a batch with its next take).
HELD_PER_SLOT = 2 * 32
#: Per job in F4 and F13: 100 jobs/s keep the 4 slots about half busy, so a fault mostly
#: finds a slot of the victim in the middle of a batch (at 2 ms per job, 6 kills of the
#: full profile found every slot idle: 0 jobs recovered).
BUSY_WORK_MS = 20


@pytest.fixture
def hosts(chaos: ChaosRun) -> Iterator[Hosts]:
    running = Hosts.of(chaos)
    yield running
    running.stop_all()


def restarts(port: int, reason: str) -> float:
    text = get_text(port, "/metrics")
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "qcluster_slot_restarts" for sample in family.samples
               if sample.name.endswith("_total") and sample.labels.get("reason") == reason)


def drain_and_finish(chaos: ChaosRun, hosts: Hosts, row: str, queues: list[str], *,
                     faults_done: int, **extra: Any) -> RowResult:
    chaos.wait_drained(queues, timeout_s=240)
    hosts.stop_all()
    return chaos.finish(row, queues, faults=faults_done, **extra)


# --- F2: hung slots -------------------------------------------------------------------------


def test_f2_hung_slot_killed_within_deadline_and_no_job_runs_twice_at_once(
    chaos: ChaosRun, hosts: Hosts
) -> None:
    """Each round enqueues one hanging job per mode (stop, busy, sleep; order from the
    seed) beside a flow of healthy jobs. A hung run's slot must end within
    batch_timeout + kill margin of the run's start (measured: the pidfd of the slot wakes
    the watcher), and its job's next run must start after the hung run's last sign of life
    (its alive lines, every 5 ms, from a thread of the hung slot)."""
    rounds = by_profile(1, 5)
    hang, flow = chaos.q("hang"), chaos.q("flow")
    port = hosts.start_master("a", f"{hang}=3,{flow}=1")
    watch = SlotWatch(port)
    watch.start()
    hung_ids: dict[str, str] = {}
    try:
        chaos.producer.enqueue(flow, 300)
        for _ in range(rounds):
            modes = ["stop", "busy", "sleep"]
            chaos.rng.shuffle(modes)
            for mode in modes:
                (job_id,) = chaos.producer.enqueue(hang, 1, fields={"mode": mode})
                hung_ids[job_id] = mode
            wait_until(lambda: chaos.ledger().completed_ids() >= set(hung_ids),
                       timeout_s=120, message="every hung job done on a later run")
        chaos.wait_drained([hang, flow], timeout_s=120)
        hung_kills = restarts(port, "hung")
    finally:
        watch.stop()
    ledger = chaos.ledger()
    grace = kill_margin(papps.HANG_BATCH_TIMEOUT_S)
    late: dict[str, float] = {}
    unmeasured: list[str] = []
    by_id = runs_by_id(ledger)
    for job_id, mode in hung_ids.items():
        first = by_id[job_id][0]
        assert first["end"] is None, f"{mode} job {job_id}: its first run was not cut"
        ended = watch.ended.get(first["pid"])
        if ended is None:
            unmeasured.append(job_id)
            continue
        late[f"{mode}:{job_id}"] = round(ended - (first["start"] + papps.HANG_BATCH_TIMEOUT_S), 3)
    overlap = overlaps(ledger)
    hosts.stop_all()
    result = chaos.finish("F2", [hang, flow], faults=len(hung_ids), hung_kills=hung_kills,
                          kill_after_deadline_s=late, grace_s=grace, overlaps=overlap,
                          unmeasured=unmeasured)
    assert not overlap, f"jobs ran in two slots at once (seconds of overlap): {overlap}"
    assert not unmeasured, f"slot end not seen for {unmeasured} (watcher attached too late)"
    too_late = {key: value for key, value in late.items() if value > grace}
    assert not too_late, f"hung slots killed later than deadline + {grace} s: {too_late}"
    assert hung_kills >= len(hung_ids), hung_kills
    assert result.lost == 0 and result.unexpected == 0, result.line()
    assert result.residue_total == 0, result.residue


# --- F3: memory hog -------------------------------------------------------------------------


@pytest.mark.chaos
def test_f3_memory_hog_killed_within_a_sampling_interval(
    chaos: ChaosRun, hosts: Hosts
) -> None:
    """A job dirties 64 MiB at once, over twice its queue's 20 MiB limit, says when
    (``hogged``), then sleeps: the master, which samples every slot's memory every
    MEMORY_PROBE_INTERVAL_S on its 1 s tick, must SIGKILL it within that interval (plus
    one tick: the sample is taken on the tick). Its job then runs again and finishes."""
    count = by_profile(1, 3)
    hog, flow = chaos.q("hog"), chaos.q("flow")
    port = hosts.start_master("a", f"{hog}={count},{flow}=1")
    watch = SlotWatch(port)
    watch.start()
    try:
        chaos.producer.enqueue(flow, 200)
        ids = chaos.producer.enqueue(hog, count)
        wait_until(lambda: chaos.ledger().completed_ids() >= set(ids), timeout_s=120,
                   message="every hog job done on a later run")
        chaos.wait_drained([hog, flow], timeout_s=120)
        memory_kills = restarts(port, "memory")
    finally:
        watch.stop()
    ledger = chaos.ledger()
    hogged = {(str(line["id"]), int(line["pid"])): float(line["m"])
              for line in ledger.lines if line["e"] == "hogged"}
    bound = MEMORY_PROBE_INTERVAL_S + TICK_S
    kill_after: dict[str, float] = {}
    for (job_id, pid), at in hogged.items():
        ended = watch.ended.get(pid)
        kill_after[job_id] = round(ended - at, 3) if ended is not None else float("nan")
    hosts.stop_all()
    result = chaos.finish("F3", [hog, flow], faults=len(hogged), memory_kills=memory_kills,
                          kill_after_hog_s=kill_after, bound_s=bound)
    assert len(hogged) == count, hogged
    assert all(value <= bound for value in kill_after.values()), kill_after
    assert memory_kills >= count, memory_kills
    assert result.lost == 0 and result.unexpected == 0, result.line()
    assert result.residue_total == 0, result.residue


# --- F4: master SIGKILL ---------------------------------------------------------------------


def _two_masters_under_load(chaos: ChaosRun, hosts: Hosts) -> tuple[str, SteadyProducer]:
    """Masters a and b with 2 flow slots each, and a steady producer of busy jobs started."""
    flow = chaos.q("flow")
    for name in ("a", "b"):  # side by side: a master takes seconds to start on a busy CPU
        hosts.start_master(name, f"{flow}=2", wait=False)
    for name in ("a", "b"):
        hosts.wait_slots_up(name)
    producer = SteadyProducer(chaos.broker.url, chaos.ledger_dir, seed=chaos.seed,
                              queue=flow, rate=100, fields={"work_ms": BUSY_WORK_MS})
    producer.start()
    return flow, producer


def test_f4_master_sigkill_leaves_no_orphan_and_loses_nothing(
    chaos: ChaosRun, hosts: Hosts
) -> None:
    """Two masters (2 slots each) under a steady 100 jobs/s of 20 ms each; on the schedule
    one of them (chosen by the seed) is SIGKILLed alone (not its group): its slots must
    follow it within 5 s (PR_SET_PDEATHSIG; the master's session is read from /proc, so a
    slot forked a moment before the kill is seen too). It is restarted; at the end every
    acknowledged job ran and the duplicates stay within what the killed slots held."""
    kills = by_profile(2, 6)
    period = by_profile(3.0, 20.0)
    flow, producer = _two_masters_under_load(chaos, hosts)
    orphan_s: list[float] = []
    orphans: dict[int, list[int]] = {}
    try:
        for _ in range(kills):
            time.sleep(period * chaos.rng.uniform(0.75, 1.25))
            victim = chaos.rng.choice(["a", "b"])
            proc = hosts.procs[victim]
            signal_master(proc, signal.SIGKILL)
            proc.wait()
            left, waited = orphans_after(proc.pid, ORPHAN_BOUND_S)
            orphan_s.append(round(waited, 3))
            if left:
                orphans[proc.pid] = left
            hosts.start_master(victim, f"{flow}=2")
        time.sleep(1.0)
    finally:
        sent = producer.stop()
    result = drain_and_finish(chaos, hosts, "F4", [flow], faults_done=kills, enqueued=sent,
                              orphans=orphans, slots_gone_after_s=orphan_s)
    bound = kills * 2 * HELD_PER_SLOT
    assert not orphans, f"slots outlived their SIGKILLed master by {ORPHAN_BOUND_S} s: {orphans}"
    assert result.lost == 0 and result.unexpected == 0, result.line()
    assert result.dup_exec <= bound, (result.dup_exec, bound)
    assert result.residue_total == 0, result.residue


# --- F5: manager SIGKILL --------------------------------------------------------------------


@pytest.fixture
def private_cluster(chaos_seed: int, tmp_path: Path) -> Iterator[tuple[Hosts, Path]]:
    """Hosts on an embedded broker of their own (state dir under tmp_path), which the
    cluster starts itself: no server is started for it in advance."""
    state = tmp_path / "state"
    prefix = f"c{uuid.uuid4().hex[:8]}"
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    running = Hosts(f"embedded://{state}", tmp_path, prefix, {LEDGER_ENV: str(ledger_dir)})
    yield running, state
    running.stop_all()
    stop_embedded(state)


@pytest.mark.chaos
def test_f5_manager_sigkill_keeps_throughput_and_one_embedded_server(
    chaos_seed: int, private_cluster: tuple[Hosts, Path], tmp_path: Path
) -> None:
    """A manager and two masters start together on a fresh embedded state directory (the
    first of them starts the server, under its file lock). Under a steady 200 jobs/s the
    manager is SIGKILLed, stays down for a window, and is restarted on its port. The jobs
    finished per second while it is down must be >= 90% of those in an equal window just
    before the kill (the masters keep their last row), and exactly one redis-server
    serves the data directory throughout (counted in /proc by its working directory)."""
    hosts, state = private_cluster
    kills = by_profile(2, 4)
    window = by_profile(4.0, 10.0)  # 800 jobs a window: a batch's lag is ~1% of it
    up_gap = by_profile(4.0, 20.0)
    config = write_config(tmp_path / "qcluster.toml", hosts.prefix)
    flow = f"{hosts.prefix}-flow"
    manager_url = "http://127.0.0.1:{}"
    hosts.start_manager(config, wait=False)
    manager_url = manager_url.format(hosts.ports["manager"])
    for name in ("a", "b"):
        hosts.start_master(name, manager=manager_url, config=config, wait=False)
    wait_until(lambda: try_json(hosts.ports["manager"], "/healthz"), message="manager up")
    wait_until(lambda: _answers(state), message="the embedded server answering")
    run = _private_run(hosts, state, chaos_seed, tmp_path)
    servers: list[int] = [len(faults.redis_servers(state / "data"))]
    producer = SteadyProducer(run.broker.url, run.ledger_dir, seed=chaos_seed, queue=flow,
                              rate=200)
    ratios: list[float] = []
    before_total = down_total = 0.0
    try:
        wait_until(lambda: _flow_slots(hosts, flow) >= 2, message="2 flow slots running")
        producer.start()
        wait_until(lambda: run.ledger().completed_ids(), message="jobs flowing")
        for _ in range(kills):
            time.sleep(max(window, up_gap * run.rng.uniform(0.75, 1.25)))
            manager = hosts.procs["manager"]
            killed_at = time.monotonic()
            signal_master(manager, signal.SIGKILL)
            manager.wait()
            time.sleep(window)
            back_at = time.monotonic()
            hosts.start_manager(config)
            servers.append(len(faults.redis_servers(state / "data")))
            ledger = run.ledger()
            before = ledger.throughput(killed_at - window, killed_at)
            down = ledger.throughput(killed_at, back_at)
            before_total += before
            down_total += down
            ratios.append(round(down / before, 3) if before else 0.0)
        wait_until(lambda: _flow_slots(hosts, flow) >= 2, message="2 flow slots running")
        servers.append(len(faults.redis_servers(state / "data")))
    finally:
        sent = producer.stop()
    run.wait_drained([flow], timeout_s=240)
    hosts.stop_all()
    ratio = round(down_total / before_total, 3) if before_total else 0.0
    result = run.finish("F5", [flow], faults=kills, enqueued=sent, down_vs_before=ratio,
                        ratios=ratios, redis_servers=servers)
    delete_queues(run.client, [flow])
    run.client.close()
    assert servers == [1] * len(servers), f"redis-servers on the data directory: {servers}"
    assert ratio >= 0.9, f"throughput while the manager was down / before: {ratios}"
    assert result.lost == 0 and result.unexpected == 0, result.line()
    assert result.residue_total == 0, result.residue


def _answers(state: Path) -> bool:
    from qcluster.broker.embedded import _answers as answers

    return bool(answers(socket_path(state)))


def _flow_slots(hosts: Hosts, queue: str) -> int:
    """Slots of ``queue`` running (idle or busy) on masters a and b together."""
    return sum(1 for name in ("a", "b") for s in try_json(hosts.ports[name], "/api/v1/slots") or []
               if s["queue"] == queue and s["state"] in ("idle", "busy"))


def _running_on_both(hosts: Hosts, queue: str) -> bool:
    for name in ("a", "b"):
        slots = try_json(hosts.ports[name], "/api/v1/slots") or []
        if not any(s["queue"] == queue and s["state"] in ("idle", "busy") for s in slots):
            return False
    return True


def _private_run(hosts: Hosts, state: Path, seed: int, workdir: Path) -> ChaosRun:
    """A ChaosRun (the ledger, the verdict) on the hosts' private broker."""
    import random

    client = Client(hosts.url)
    ledger_dir = Path(hosts.env[LEDGER_ENV])
    return ChaosRun(broker=ChaosBroker("embedded", hosts.url), seed=seed, workdir=workdir,
                    prefix=hosts.prefix, procs=Procs(workdir, dict(hosts.env)), client=client,
                    producer=Producer(client, ledger_dir, seed=seed),
                    rng=random.Random(seed))


# --- F12: clock skew ------------------------------------------------------------------------


@pytest.mark.chaos
@pytest.mark.parametrize("skew_h", [2, -2])
def test_f12_clock_skew_on_one_master_makes_no_duplicate(
    chaos: ChaosRun, hosts: Hosts, tmp_path: Path, skew_h: int
) -> None:
    """A manager and two masters; master b runs under libfaketime with its wall clock
    ``skew_h`` hours off (CLOCK_MONOTONIC left alone: deadlines are monotonic, and a skew
    is about the clock another host shows; time.sleep goes through select() there, see
    ``process_kills.SLEEP_WORKAROUND``). Locks and activation times come from the
    broker's clock, so nothing may run twice. Master b must have run jobs (its slots'
    ledger lines carry the skewed wall time)."""
    library = faults.faketime_library()
    if library is None:
        pytest.fail(f"libfaketime is missing ({faults.FAKETIME_DIR}): install the Debian "
                    "package faketime (requested for make sysdeps)", pytrace=False)
    seconds = by_profile(8.0, 60.0)
    flow = chaos.q("flow")
    # 4 slots at least, 2 at most per host: the plan must keep 2 on the skewed master.
    config = write_config(tmp_path / "qcluster.toml", chaos.prefix, min_flow_slots=4,
                          master_max_slots=2)
    manager = f"http://127.0.0.1:{hosts.start_manager(config)}"
    hosts.start_master("a", manager=manager, config=config, wait=False)
    skewed = faults.faketime_env(library, skew_h, tmp_path, str(ROOT))
    hosts.start_master("b", manager=manager, config=config, env=skewed, wait=False)
    wait_until(lambda: _running_on_both(hosts, flow), message="flow slots on both hosts")
    producer = SteadyProducer(chaos.broker.url, chaos.ledger_dir, seed=chaos.seed,
                              queue=flow, rate=200)
    producer.start()
    try:
        time.sleep(seconds)
    finally:
        sent = producer.stop()
    chaos.wait_drained([flow], timeout_s=240)
    mono, wall = time.monotonic(), time.time()
    offset = wall - mono
    skewed_finishes = sum(1 for line in chaos.ledger().lines if line["e"] == "finish"
                          and abs(float(line["t"]) - float(line["m"]) - offset
                                  - skew_h * 3600) < 600)
    hosts.stop_all()
    result = chaos.finish("F12", [flow], faults=1, enqueued=sent, skew_h=skew_h,
                          skewed_master_finished=skewed_finishes)
    assert skewed_finishes > 0, "the skewed master ran no job: the row proves nothing"
    assert result.dup_exec == 0, result.line()
    assert result.lost == 0 and result.unexpected == 0, result.line()
    assert result.residue_total == 0, result.residue


# --- F13: SIGTERM under load ----------------------------------------------------------------


def test_f13_sigterm_to_masters_under_load_loses_and_repeats_nothing(
    chaos: ChaosRun, hosts: Hosts
) -> None:
    """Two masters (2 slots each) under a steady 100 jobs/s of 20 ms each; on the schedule
    one (chosen by the seed) gets SIGTERM: its slots finish and settle their batch, give
    back what they took ahead, and it exits 0 with no slot left; it is restarted. Every
    acknowledged job runs exactly once."""
    stops = by_profile(2, 6)
    period = by_profile(2.0, 10.0)
    flow, producer = _two_masters_under_load(chaos, hosts)
    codes: list[int | None] = []
    left_over: dict[int, list[int]] = {}
    try:
        for _ in range(stops):
            time.sleep(period * chaos.rng.uniform(0.75, 1.25))
            victim = chaos.rng.choice(["a", "b"])
            proc = hosts.procs[victim]
            signal_master(proc, signal.SIGTERM)
            codes.append(proc.wait(timeout=120))
            left, _ = orphans_after(proc.pid, ORPHAN_BOUND_S)
            if left:
                left_over[proc.pid] = left
            hosts.start_master(victim, f"{flow}=2")
        time.sleep(1.0)
    finally:
        sent = producer.stop()
    result = drain_and_finish(chaos, hosts, "F13", [flow], faults_done=stops, enqueued=sent,
                              exit_codes=codes)
    assert codes == [0] * stops, codes
    assert not left_over, left_over
    assert result.lost == 0 and result.unexpected == 0, result.line()
    assert result.dup_exec == 0, result.line()
    assert result.residue_total == 0, result.residue

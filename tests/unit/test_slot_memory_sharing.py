"""What keeps a forked slot's private memory small: decoding jobs keeps nothing alive, and
what every slot would make after the fork is made once, before it, by the master
(qcluster.slot.prefork; docs/benchmarks.md, slot memory).

The fork cases run in a child process of their own: the metric value class and the
imports they check are process-wide."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcluster.job import decode_envelope
from qcluster.master import effects
from qcluster.slot import prefork

#: More ids than pydantic-core's JSON string cache holds (16,384).
IDS = 20_000


def body(job_id: str, payload: object = None) -> bytes:
    return json.dumps({"v": 1, "id": job_id, "queue": "q", "payload": payload,
                       "enqueued_at": 1.0, "headers": {}}).encode()


def test_decoding_jobs_keeps_none_of_their_ids_alive() -> None:
    """Regression: pydantic-core's process-wide string cache kept the last 16,384 job ids
    a slot decoded alive (1.9 MiB of each slot's private memory after 25,000 jobs)."""
    bodies = [body(uuid.uuid4().hex) for _ in range(IDS)]
    decode_envelope(bodies[0])  # (what a first decode makes once, not per job)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for one in bodies:
            decode_envelope(one)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 100_000, f"decoding {IDS} jobs kept {kept} bytes alive"


@settings(max_examples=50, deadline=None)
@given(job_id=st.text(min_size=1, max_size=200),
       payload=st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                            lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                            max_leaves=12))
def test_an_envelope_decodes_to_what_was_encoded(job_id: str, payload: object) -> None:
    """Without the string cache a decode still gives back every string as it was sent."""
    envelope = decode_envelope(body(job_id, payload))
    assert (envelope.id, envelope.payload) == (job_id, payload)


def test_prctl_is_loaded_once() -> None:
    assert effects.prctl() is effects.prctl()


def run(program: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(program), *args],
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def test_a_slot_names_its_metric_files_with_the_value_class_its_master_made(
        tmp_path: Path) -> None:
    """The value class is made in the master, before the fork; the slot's files still
    carry its own identity, and the master writes none."""
    out = run("""
        import os, sys
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
        from qcluster import metrics
        from qcluster.slot.prefork import prepare_slots
        prepare_slots(None, True)  # in the master, before it forks
        made = metrics.slot_value_class()
        pid = os.fork()
        if pid == 0:
            metrics.use_slot_identity(3)
            from prometheus_client import values
            assert values.ValueClass is made
            metrics.slot_metrics().jobs.labels("q", "done").inc()
            metrics.slot_metrics().slot_busy.labels("q", "3").set(1)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        print(sorted(os.listdir(sys.argv[1])))
    """, str(tmp_path))
    assert out == "['counter_slot3.db', 'gauge_livemostrecent_slot3.db']"


def test_a_slot_that_takes_another_number_writes_under_it(tmp_path: Path) -> None:
    out = run("""
        import os, sys
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
        from qcluster import metrics
        metrics.use_slot_identity(1)
        metrics.slot_metrics().jobs.labels("q", "done").inc()
        metrics.use_slot_identity(2)
        metrics.slot_metrics().jobs.labels("q", "done").inc()
        print(sorted(os.listdir(sys.argv[1])))
    """, str(tmp_path))
    assert out == "['counter_slot1.db', 'counter_slot2.db']"


def test_the_master_imports_the_slots_modules_before_it_forks() -> None:
    out = run("""
        import sys
        from qcluster.slot.prefork import SLOT_MODULES, prepare_slots
        prepare_slots("redis://127.0.0.1:1", False)
        print(all(name in sys.modules for name in SLOT_MODULES),
              "qcluster.broker.redis_broker" in sys.modules)
    """)
    assert out == "True True"


@pytest.mark.parametrize("url", [None, "embedded", "amqp://127.0.0.1:1/",
                                 "redis+sentinel://127.0.0.1:1/mymaster"])
def test_a_template_opens_no_broker_but_a_single_redis(
        url: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import qcluster.broker

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"opened {url!r}")

    monkeypatch.setattr(qcluster.broker, "open_broker", refuse)
    prefork.warm_redis(url, tmp_path)


def test_a_template_warm_up_is_never_an_error(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """Its slots open their own broker and say what fails; the warm-up says nothing."""
    import qcluster.broker
    from qcluster.errors import ConfigError

    opened: list[str] = []

    def evicting(url: str, *, state_dir: Path) -> None:
        opened.append(url)
        raise ConfigError("evicts keys")

    monkeypatch.setattr(qcluster.broker, "open_broker", evicting)
    prefork.warm_redis("redis://127.0.0.1:6379", tmp_path)
    assert opened == ["redis://127.0.0.1:6379"]


def test_a_slot_connects_its_own_copy_of_the_broker_its_master_made(
        redis_url: str, tmp_path: Path) -> None:
    """The master makes the slots' Redis client and its connection before it forks and
    never connects them: each slot connects its own copy (its own socket, none shared
    with the master or with another slot), and uses it."""
    out = run("""
        import os, socket, sys
        from pathlib import Path
        from qcluster.slot import prefork
        url, state = sys.argv[1], Path(sys.argv[2])
        prefork.prepare_slots(url, False)  # in the master, before it forks
        made, connection = prefork._slot_broker[2:]
        made_record = made._take_record("q")
        ours = prefork.open_slot_broker(url, state_dir=state)  # the master opens its own
        assert ours is not made
        ours.stats("q")

        def sockets():
            found = set()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    found.add(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:  # (the listing's own descriptor, closed by now)
                    pass
            return {name for name in found if name.startswith("socket:")}

        inherited = sockets()
        r, w = os.pipe()
        children = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                broker = prefork.open_slot_broker(url, state_dir=state)
                assert broker is made
                assert broker.stats("q").ready == 0
                assert broker.client.connection_pool._available_connections == [connection]
                assert connection._sock is not None
                new = sorted(sockets() - inherited)
                again = prefork.open_slot_broker(url, state_dir=state)
                assert again is not made
                again.close()
                record = broker._take_record("q")  # its own, not the master's or a sibling's
                assert record != made_record
                os.write(w, (record + " " + " ".join(new) + "\\n").encode())
                os._exit(0)
            children.append(pid)
        for pid in children:
            assert os.waitpid(pid, 0)[1] == 0
        lines = os.read(r, 4096).decode().split("\\n")[:2]
        # The made connection never connected in the master; each slot made one socket
        # and names its own take record.
        records = {line.split()[0] for line in lines}
        own = {" ".join(line.split()[1:]) for line in lines}
        print(connection._sock, len(records), len(own), [len(l.split()) - 1 for l in lines])
    """, redis_url, str(tmp_path))
    assert out == "None 2 2 [1, 1]"


@pytest.mark.parametrize("url", [None, "embedded", "amqp://127.0.0.1:1/",
                                 "redis+sentinel://127.0.0.1:1/mymaster",
                                 "redis://10.1.2.3:6379",
                                 "redis://127.0.0.1:6379/0?socket_timeout=soon"])
def test_a_master_makes_no_slot_broker_but_for_a_single_redis_its_slots_may_use(
        url: str | None) -> None:
    """Sentinel and Cluster clients connect as they are made; a remote Redis without a
    password, or an option redis-py refuses, is refused by each slot's own open, as
    before (never by the preparation)."""
    out = run("""
        import sys
        from qcluster.slot import prefork
        prefork.prepare_slots(sys.argv[1] if sys.argv[1] != "-" else None, False)
        print(prefork._slot_broker)
    """, url or "-")
    assert out == "None"


EXPOSED = """
    import os, sys
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=sys.argv[1])
    print(generate_latest(registry).decode())
"""


def test_a_slot_writes_the_samples_prometheus_client_children_would(tmp_path: Path) -> None:
    """A slot's figures go to metric values made without prometheus_client's children
    (less of each slot's private memory): the master exposes the very samples the
    children would have written."""
    by_children, by_slot = tmp_path / "children", tmp_path / "slot"
    by_children.mkdir()
    by_slot.mkdir()
    run("""
        import os, sys
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
        from qcluster import metrics
        metrics.use_slot_identity(1)
        defs = metrics.slot_metrics()
        outcomes = {o: defs.jobs.labels("q", o) for o in ("done", "retried", "failed",
                                                         "malformed")}
        outcomes["done"].inc(3)
        outcomes["failed"].inc(1)
        for child, values in ((defs.batch_duration.labels("q"), [0.004, 0.2, 700.0]),
                              (defs.batch_size.labels("q"), [1, 100]),
                              (defs.job_wait.labels("q"), [0.0, 3.5])):
            for value in values:
                child.observe(value)
        defs.slot_private_dirty.labels("q", "1").set(6 << 20)
    """, str(by_children))
    run("""
        import os, sys
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
        from qcluster import metrics
        from qcluster.slot.slot_metrics import SlotMetrics
        metrics.use_slot_identity(1)
        slot = SlotMetrics("1")
        figures = slot._for("q")
        figures.done += 3
        figures.outcomes["failed"] += 1
        for tally, values in ((figures.duration, [0.004, 0.2, 700.0]),
                              (figures.size, [1, 100]), (figures.wait, [0.0, 3.5])):
            tally.add_many(values)
        slot.write()
        slot.private_dirty("q", 6 << 20)
    """, str(by_slot))
    assert sorted(os.listdir(by_slot)) == sorted(os.listdir(by_children))
    exposed = run(EXPOSED, str(by_slot))
    assert 'qcluster_jobs_total{outcome="done",queue="q"} 3.0' in exposed
    assert exposed == run(EXPOSED, str(by_children))

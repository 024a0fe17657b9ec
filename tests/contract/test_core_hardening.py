"""Issue 15, core part: regressions against real brokers (Redis, embedded, RabbitMQ where
the contract is shared). Each test failed on the code before its fix."""

from __future__ import annotations

import json
import stat
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from qcluster import App, Client, Job
from qcluster.broker import Broker, open_broker
from qcluster.broker.embedded import redis_server_binary
from qcluster.broker.redis_broker import RedisBroker
from qcluster.errors import BrokerError, ConfigError, InvalidDelay, InvalidQueueName
from qcluster.job import Delivery, Envelope
from qcluster.slot.runtime import SlotRunner
from tests.conftest import QCLUSTER, free_port, qcluster_env, start_qcluster, wait_until


def body(job_id: str, queue: str, payload: object) -> bytes:
    return Envelope(id=job_id, queue=queue, payload=payload, enqueued_at=time.time()
                    ).model_dump_json().encode()


def run_until(runner: SlotRunner, predicate: Callable[[], object], timeout_s: float = 30.0
              ) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runner.step()
        if predicate():
            return
    raise AssertionError("slot did not reach the expected state in time")


def take_all(broker: Broker, queue: str, count: int) -> list[Delivery]:
    """Take until ``count`` deliveries came (RabbitMQ streams them in)."""
    got: list[Delivery] = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        got += broker.take(queue, max_jobs=count - len(got), lock_timeout_s=60, wait_s=0.2)
    assert len(got) == count, f"took {len(got)} of {count}"
    return got


@pytest.fixture
def broker(broker_url: str) -> Iterator[Broker]:
    opened = open_broker(broker_url)
    yield opened
    opened.close()


# --- defect 2: no job dead-lettered without running ------------------------------------


def test_released_jobs_are_ready_at_once_with_no_attempt_counted(
    broker_url: str, broker: Broker, queue_name: str
) -> None:
    broker.publish_many(queue_name, [(f"r{i}", body(f"r{i}", queue_name, i)) for i in range(3)])
    taken = take_all(broker, queue_name, 3)
    broker.release(queue_name, taken)
    again = take_all(broker, queue_name, 3)
    assert sorted(d.id for d in again) == ["r0", "r1", "r2"]
    assert [d.attempts for d in again] == [1, 1, 1], "a release must not count an attempt"
    broker.ack(queue_name, again)


def test_one_slow_job_among_fast_ones_dead_letters_no_job_that_never_ran(
    broker_url: str, broker: Broker, queue_name: str
) -> None:
    # Given batch 1 (the slot reads ahead 32 jobs for a fast handler) and max_attempts 1,
    # and one slow job early in the queue: the jobs read ahead behind it are handed back.
    app = App()
    ran: list[int] = []

    @app.queue(queue_name, batch_size=1, max_attempts=1)
    def handle(jobs: list[Job]) -> None:
        for job in jobs:
            if job.payload == 1:
                time.sleep(0.7)  # longer than the slot runs read-ahead batches
            ran.append(job.payload)

    ids = [f"job-{n:02d}" for n in range(31)]  # Redis orders equal scores by id
    broker.publish_many(queue_name, [(i, body(i, queue_name, n)) for n, i in enumerate(ids)])
    runner = SlotRunner(app, queue_name, open_broker(broker_url))
    client = Client(broker_url)
    run_until(runner, lambda: len(set(ran)) + client.stats(queue_name)["dead"] >= 31)
    runner._flush()
    dead = client.dead_jobs(queue_name, limit=100)
    assert dead == [], f"dead-lettered without running: {[(d.id, d.reason) for d in dead]}"
    assert sorted(ran) == list(range(31))


def test_jobs_read_ahead_when_sigterm_arrives_go_back_with_no_attempt_counted(
    broker_url: str, broker: Broker, queue_name: str
) -> None:
    # Given a slot reading ahead (batch 1, fast handler) that gets SIGTERM mid-take
    app = App()
    ran: list[int] = []
    runner: SlotRunner

    @app.queue(queue_name, batch_size=1, max_attempts=1)
    def handle(jobs: list[Job]) -> None:
        ran.extend(job.payload for job in jobs)
        if len(ran) == 3:
            runner.handle_stop_signal(15, None)  # what the SIGTERM handler does

    ids = [f"job-{n:02d}" for n in range(20)]
    broker.publish_many(queue_name, [(i, body(i, queue_name, n)) for n, i in enumerate(ids)])
    runner = SlotRunner(app, queue_name, open_broker(broker_url))
    run_until(runner, lambda: runner.should_stop)
    runner._flush()  # what SlotRunner.run does on its way out
    runner._leave(queue_name)
    # Then the jobs it had not started are ready again, their attempt not counted
    rest = take_all(broker, queue_name, 20 - len(ran))
    assert sorted(d.id for d in rest) == sorted(ids[n] for n in range(20) if n not in ran)
    assert {d.attempts for d in rest} == {1}
    broker.ack(queue_name, rest)


@pytest.mark.parametrize("backend", ["redis_url", "embedded_url", "rabbitmq_url"])
def test_a_poison_job_that_kills_its_slot_does_not_take_its_batch_mates_with_it(
    request: pytest.FixtureRequest, backend: str, queue_name: str, tmp_path: Path
) -> None:
    # Given a batch of 4 whose "poison" job calls os._exit in every slot that runs it
    # (max_attempts 3), run by real `qcluster slot` processes restarted after each crash
    url = str(request.getfixturevalue(backend))
    client = Client(url)
    client.enqueue_many(queue_name, ["a", "poison", "b", "c"])

    def executed() -> set[str]:
        return {line for log in tmp_path.glob("poison-*.log") for line in log.read_text().split()}

    def settled() -> bool:
        stats = client.stats(queue_name)
        return stats["ready"] + stats["locked"] + stats["delayed"] == 0

    deadline = time.monotonic() + 90
    while not settled() and time.monotonic() < deadline:
        proc = start_qcluster(
            "slot", "--app", "tests.apps.slot_apps", "--queue", queue_name, "--broker", url,
            "--burst", "--log-level", "WARNING",
            QC_TEST_POISON_QUEUE=queue_name, QC_TEST_LOG_DIR=str(tmp_path),
        )
        proc.wait(timeout=60)
        # Then wait for the crashed slot's locks to expire before the next slot starts
        wait_until(lambda: settled() or client.stats(queue_name)["ready"] > 0, timeout_s=60,
                   message="jobs ready again after the slot died")
    # Then only the poison job is dead-lettered; its batch-mates ran and were acked
    dead = client.dead_jobs(queue_name)
    assert [json.loads(d.body)["payload"] for d in dead] == ["poison"], [
        (json.loads(d.body)["payload"], d.reason) for d in dead]
    assert executed() == {"a", "b", "c"}
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 1}
    client.close()


# --- defect 7: input that cannot be decoded ------------------------------------------


@pytest.mark.parametrize("backend", ["redis_url", "embedded_url"])
def test_a_job_with_a_non_utf8_id_is_dead_lettered_and_the_slot_goes_on(
    request: pytest.FixtureRequest, backend: str, queue_name: str
) -> None:
    url = str(request.getfixturevalue(backend))
    broker = open_broker(url)
    bad_id = b"\xff\xfe-not-utf8"
    broker.publish_many(queue_name, [(bad_id, b'{"v":1}'), ("bad-body", b"\xff\xfe{")])  # type: ignore[list-item]
    app = App()
    handled: list[object] = []

    @app.queue(queue_name, batch_size=10)
    def handle(jobs: list[Job]) -> None:
        handled.extend(job.payload for job in jobs)

    client = Client(url)
    client.enqueue(queue_name, "fine")
    runner = SlotRunner(app, queue_name, open_broker(url))
    run_until(runner, lambda: client.stats(queue_name)["dead"] == 2 and handled == ["fine"])
    runner._flush()
    reasons = sorted(d.reason for d in client.dead_jobs(queue_name))
    assert all(r.startswith("malformed:") for r in reasons), reasons
    assert client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0, "dead": 2}
    broker.close()


# --- defect 8: delays ----------------------------------------------------------------


@pytest.mark.parametrize("delay", [-1.0, float("nan"), float("inf"), 1e15])
def test_bad_delays_are_refused_at_enqueue_and_nothing_is_stored(
    redis_url: str, queue_name: str, delay: float
) -> None:
    client = Client(redis_url)
    with pytest.raises(InvalidDelay, match="between 0 and"):
        client.enqueue(queue_name, {"n": 1}, delay=delay)
    assert client.stats(queue_name)["delayed"] + client.stats(queue_name)["ready"] == 0


def test_a_far_activation_time_does_not_break_an_idle_take(
    broker: Broker, queue_name: str
) -> None:
    broker.publish_many(queue_name, [("far", body("far", queue_name, 1))], delay_s=1e15)
    assert broker.take(queue_name, max_jobs=1, lock_timeout_s=5, wait_s=0.2) == []


def test_retry_with_nan_is_an_error_outcome_and_the_batch_still_settles(
    broker_url: str, queue_name: str
) -> None:
    app = App()
    seen: list[object] = []

    @app.queue(queue_name, batch_size=10, retry_base_delay=30, retry_max_delay=60)
    def handle(jobs: list[Job]) -> None:
        for job in jobs:
            seen.append(job.payload)
            if job.payload == "nan":
                try:
                    job.retry(float("nan"))
                except ValueError:
                    job.fail("bad retry delay")

    client = Client(broker_url)
    client.enqueue_many(queue_name, ["ok", "nan", "ok2"])
    runner = SlotRunner(app, queue_name, open_broker(broker_url))
    run_until(runner, lambda: len(seen) == 3)
    runner._flush()
    wait_until(lambda: client.stats(queue_name) == {"ready": 0, "locked": 0, "delayed": 0,
                                                      "dead": 1},
               timeout_s=60, message="ok jobs acked, the nan one dead-lettered")


# --- defect 13: handlers that return something ---------------------------------------


def test_a_handler_returning_a_coroutine_fails_the_batch_instead_of_acking_it(
    broker_url: str, queue_name: str
) -> None:
    app = App()
    ran: list[int] = []

    async def work(jobs: list[Job]) -> None:
        ran.append(len(jobs))

    @app.queue(queue_name, batch_size=10, max_attempts=1)
    def handle(jobs: list[Job]):
        return work(jobs)  # a sync handler handing back a coroutine nobody awaits

    reasons = _reasons_three_jobs_died_for(app, broker_url, queue_name)
    assert ran == []
    assert all("returned coroutine" in reason for reason in reasons), reasons


def _reasons_three_jobs_died_for(app: App, broker_url: str, queue_name: str) -> list[str]:
    """Three jobs enqueued to ``queue_name`` and run by a slot of ``app`` until all three
    are dead letters: their reasons."""
    client = Client(broker_url)
    client.enqueue_many(queue_name, [1, 2, 3])
    runner = SlotRunner(app, queue_name, open_broker(broker_url))
    run_until(runner, lambda: client.stats(queue_name)["dead"] == 3)
    runner._flush()
    return [dead.reason for dead in client.dead_jobs(queue_name)]


def _sync_returns_a_coroutine(app: App, queue: str, ran: list[int]) -> None:
    async def work(job: Job) -> None:
        ran.append(job.payload)

    @app.job_queue(queue, batch_size=10, max_attempts=1)
    def handle(job: Job):
        return work(job)  # the per-job form of the same slip


def _async_returns_a_coroutine(app: App, queue: str, ran: list[int]) -> None:
    async def work(job: Job) -> None:
        ran.append(job.payload)

    @app.job_queue(queue, batch_size=10, max_attempts=1)
    async def handle(job: Job):
        return work(job)  # forgot the await


def _sync_returns_a_generator(app: App, queue: str, ran: list[int]) -> None:
    def work(job: Job) -> Iterator[None]:
        ran.append(job.payload)
        yield None

    @app.job_queue(queue, batch_size=10, max_attempts=1)
    def handle(job: Job):
        return work(job)


@pytest.mark.parametrize("declare", [_sync_returns_a_coroutine, _async_returns_a_coroutine,
                                     _sync_returns_a_generator])
def test_a_per_job_handler_returning_unrun_work_fails_its_job_instead_of_acking_it(
    broker_url: str, queue_name: str, declare: Callable[[App, str, list[int]], None]
) -> None:
    """@app.job_queue ignored what its handler returned: the jobs were acked as done
    although their work never ran, and nothing was dead-lettered."""
    app = App()
    ran: list[int] = []
    declare(app, queue_name, ran)
    reasons = _reasons_three_jobs_died_for(app, broker_url, queue_name)
    assert ran == []
    assert len(reasons) == 3 and all("the handler returned" in r for r in reasons), reasons


# --- defect 5: queue names -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["redis_url", "embedded_url"])
@pytest.mark.parametrize("name", ["[/q]", "x}:dead", "", "a b", "-x", "x" * 129])
def test_invalid_queue_names_are_refused_by_app_client_and_broker(
    request: pytest.FixtureRequest, backend: str, name: str
) -> None:
    url = str(request.getfixturevalue(backend))
    with pytest.raises(ConfigError, match="invalid queue name"):
        App().queue(name)(lambda jobs: None)
    with Client(url) as client, pytest.raises(InvalidQueueName):
        client.enqueue(name, 1)
    broker = open_broker(url)
    with pytest.raises(InvalidQueueName):
        broker.publish(name, "id", b"{}")
    with pytest.raises(InvalidQueueName):
        broker.take(name, max_jobs=1, lock_timeout_s=1)
    broker.close()


# --- Redis details -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["redis_url", "embedded_url"])
def test_take_above_the_lua_unpack_limit_strands_no_job(
    request: pytest.FixtureRequest, backend: str, queue_name: str
) -> None:
    broker = open_broker(str(request.getfixturevalue(backend)))
    broker.publish_many(queue_name, [(f"j{i}", b"{}") for i in range(4500)])
    taken = broker.take(queue_name, max_jobs=5000, lock_timeout_s=60)
    stats = broker.stats(queue_name)
    assert 0 < len(taken) <= 4500
    assert stats.ready + stats.locked == 4500, f"jobs stranded: {stats}"
    broker.close()


@pytest.mark.parametrize("backend", ["redis_url", "embedded_url"])
def test_dead_letters_are_trimmed_to_the_retention_count(
    request: pytest.FixtureRequest, backend: str, queue_name: str
) -> None:
    url = str(request.getfixturevalue(backend))
    opened = open_broker(url)
    assert isinstance(opened, RedisBroker)
    broker = RedisBroker(opened.client, safe_url="test", dead_max_count=3)
    broker.publish_many(queue_name, [(f"d{i}", b"{}") for i in range(5)])
    for _ in range(5):  # one at a time: each dead-lettering is newer than the last
        (delivery,) = broker.take(queue_name, max_jobs=1, lock_timeout_s=60)
        broker.dead(queue_name, delivery, "no")
    assert broker.stats(queue_name).dead == 3
    kept = broker.dead_jobs(queue_name, limit=10)
    assert len(kept) == 3 and all(d.body == "{}" for d in kept)
    opened.close()


def test_embedded_broker_data_is_private(embedded_url: str, queue_name: str) -> None:
    broker = open_broker(embedded_url)
    broker.publish(queue_name, "private", b"{}")
    broker.close()
    data = Path(embedded_url.removeprefix("embedded://")) / "data"
    paths = [data, *data.rglob("*")]
    assert len(paths) > 1, "the embedded broker wrote no data file"
    loose = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in paths
             if stat.S_IMODE(p.stat().st_mode) & 0o077}
    assert loose == {}, f"readable by others: {loose}"


# --- defect 12 and CLI: a private redis-server with the configuration under test -------


@pytest.fixture
def private_redis(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A redis-server of the test's own on a free port; extra args via indirect param."""
    port = free_port()
    extra = list(getattr(request, "param", []))
    if "--save" not in extra:
        extra += ["--save", ""]
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir",
         str(tmp_path), "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    wait_until(answers, timeout_s=60, message="private redis-server up")
    client.close()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.parametrize("private_redis", [["--maxmemory-policy", "allkeys-lru"]], indirect=True)
def test_an_evicting_redis_is_refused_at_connect(private_redis: str) -> None:
    with pytest.raises(ConfigError, match="maxmemory-policy allkeys-lru"):
        open_broker(private_redis)


@pytest.mark.parametrize("private_redis", [["--rename-command", "CONFIG", ""]], indirect=True)
def test_a_redis_without_config_is_used_and_said_unchecked(private_redis: str) -> None:
    broker = open_broker(private_redis)
    (note,) = broker.durability()
    assert "not checked" in note
    broker.publish("q", "j", b"{}")
    assert broker.stats("q").ready == 1
    broker.close()


@pytest.mark.parametrize("private_redis", [["--save", "900", "1"]], indirect=True)
def test_snapshot_only_redis_is_named_in_stats(private_redis: str) -> None:
    broker = open_broker(private_redis)
    notes = broker.durability()
    assert len(notes) == 1 and "snapshots only" in notes[0]
    result = subprocess.run([*QCLUSTER, "stats", "--broker", private_redis],
                            env=qcluster_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "snapshots only" in result.stdout
    broker.close()


def test_stats_and_dead_print_names_and_reasons_verbatim(private_redis: str) -> None:
    # A queue named with rich markup before names were checked, and a reason with it.
    raw = redis.Redis.from_url(private_redis)
    raw.sadd("qc:queues", "[/q]")
    raw.zadd("qc:{[/q]}:dead", {"j1": 1000})
    raw.hset("qc:{[/q]}:reasons", "j1", "[bold]boom[/bold]")
    raw.hset("qc:{[/q]}:jobs", "j1", "[red]{}")
    raw.close()
    stats = subprocess.run([*QCLUSTER, "stats", "--broker", private_redis],
                           env=qcluster_env(), capture_output=True, text=True, timeout=60)
    assert stats.returncode == 0, stats.stderr
    assert "[/q]" in stats.stdout
    dead = subprocess.run([*QCLUSTER, "dead", "[/q]", "--broker", private_redis],
                          env=qcluster_env(), capture_output=True, text=True, timeout=60)
    assert dead.returncode == 0, dead.stderr
    assert "[bold]boom[/bold]" in dead.stdout


def qcluster(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*QCLUSTER, *args], env=qcluster_env(), capture_output=True,
                          text=True, timeout=60, cwd=cwd)


@pytest.mark.parametrize("delay", ["-1", "nan", "inf", "1e15"])
def test_cli_enqueue_bad_delay_is_one_line(private_redis: str, delay: str) -> None:
    result = qcluster("enqueue", "q", "1", "--delay", delay, "--broker", private_redis)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "delay" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_enqueue_bad_queue_name_is_one_line_printed_verbatim(private_redis: str) -> None:
    result = qcluster("enqueue", "[/q]", "1", "--broker", private_redis)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "invalid queue name '[/q]'" in result.stderr


def test_cli_enqueue_file_with_a_bad_line_says_how_many_were_enqueued(
    private_redis: str, tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(f'{{"n": {n}}}\n' for n in range(1500)) + "{oops\n")
    result = qcluster("enqueue", "q", "--file", str(jobs), "--broker", private_redis)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "jobs.jsonl:1501" in result.stderr
    assert "enqueued 1000 job(s)" in result.stderr
    with Client(private_redis) as client:
        assert client.stats("q")["ready"] == 1000


def test_cli_enqueue_file_that_is_not_utf8_names_its_line(
    private_redis: str, tmp_path: Path
) -> None:
    """It ended in a UnicodeDecodeError traceback (exit 1)."""
    jobs = tmp_path / "latin1.jsonl"
    jobs.write_bytes(b'{"n": 1}\n{"name": "caf\xe9"}\n')
    result = qcluster("enqueue", "q-latin1", "--file", str(jobs), "--broker", private_redis)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{jobs}:2: not UTF-8 text (byte 0xe9)" in " ".join(result.stderr.split())
    with Client(private_redis) as client:
        assert client.stats("q-latin1")["ready"] == 0


def test_cli_job_not_found_is_one_line(private_redis: str) -> None:
    """It was folded over two or three lines at 80 columns (stderr not a terminal)."""
    result = qcluster("job", "no-such-job", "--queue", "a-rather-long-queue-name-for-the-line",
                      "--broker", private_redis, "--manager", "http://127.0.0.1:9")
    assert result.returncode == 15, result.stderr
    said = ("no job no-such-job in a-rather-long-queue-name-for-the-line (finished jobs are "
            "remembered for their queue's keep_finished_s only)")
    assert said in result.stderr.splitlines(), result.stderr  # this private Redis has no
    # AOF: the line before it is the durability note


def test_cli_dead_limit_zero_shows_no_job(private_redis: str) -> None:
    broker = open_broker(private_redis)
    broker.publish("q", "j1", b"{}")
    (delivery,) = broker.take("q", max_jobs=1, lock_timeout_s=60)
    broker.dead("q", delivery, "reason-marker")
    broker.close()
    result = qcluster("dead", "q", "--limit", "0", "--broker", private_redis)
    assert result.returncode == 0, result.stderr
    assert "reason-marker" not in result.stdout
    assert "reason-marker" in qcluster("dead", "q", "--broker", private_redis).stdout


def test_cli_refuses_a_queue_no_app_declares_unless_forced(
    private_redis: str, tmp_path: Path
) -> None:
    (tmp_path / "qcluster.toml").write_text('app = "tests.apps.slot_apps"\n')
    args = ("enqueue", "nobody-serves-this", "1", "--broker", private_redis,
            "--config", str(tmp_path / "qcluster.toml"))
    refused = qcluster(*args)
    assert refused.returncode == 2, refused.stderr
    assert "no queue of the app is named 'nobody-serves-this'" in refused.stderr
    forced = qcluster(*args, "--force")
    assert forced.returncode == 0, forced.stderr
    assert forced.stderr.count("no queue of the app is named 'nobody-serves-this'") == 1


def test_client_honours_the_queue_policy_max_message_bytes(
    redis_url: str, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    from qcluster.errors import EnvelopeError

    app = App()
    app.queue(queue_name, max_message_bytes=300)(lambda jobs: None)
    with Client(redis_url, app=app) as client:
        with pytest.raises(EnvelopeError, match="over the 300-byte limit"):
            client.enqueue(queue_name, "x" * 400)
        client.enqueue(f"{queue_name}-undeclared", "x" * 400)
        assert "no queue of app" in caplog.text
        client.purge(f"{queue_name}-undeclared")
        client.broker.delete_queue(f"{queue_name}-undeclared")



def test_config_errors_keep_their_bracketed_section_names(tmp_path: Path) -> None:
    config = tmp_path / "qcluster.toml"
    config.write_text("[queues.foo]\nno_such_key = 1\n")
    result = qcluster("stats", "--config", str(config))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "[queues.foo]" in result.stderr, result.stderr


@pytest.mark.parametrize("private_redis", [["--maxmemory", "3mb", "--maxmemory-policy",
                                            "noeviction"]], indirect=True)
def test_a_full_redis_says_so_and_slots_that_finish_jobs_free_it(private_redis: str) -> None:
    """A Redis at its maxmemory refused a job with 'command not allowed when used memory
    > 'maxmemory'. script: 2360fca1..., on @user_script:22.': it now says it is full and
    what frees it. Taking and acknowledging jobs still work there (they free memory), and
    a job is accepted again once they did."""
    broker = open_broker(private_redis)
    body = json.dumps({"pad": "x" * 500}).encode()
    published = 0
    with pytest.raises(BrokerError) as full:
        for _ in range(10_000):
            broker.publish_many("q", [(uuid.uuid4().hex, body) for _ in range(100)])
            published += 100
    message = str(full.value)
    assert "is full (used memory above its maxmemory)" in message, message
    assert "script:" not in message and "qcluster purge" in message
    assert published > 0
    taken = broker.take("q", max_jobs=published, lock_timeout_s=30)
    assert taken
    broker.ack("q", taken)
    assert broker.publish("q", uuid.uuid4().hex, body)
    broker.close()


def test_a_per_job_handler_returning_a_value_is_done(broker_url: str, queue_name: str) -> None:
    """A value (not unrun work) returned by a per-job handler is not used: its job is done."""
    app = App()

    @app.job_queue(queue_name, batch_size=10, max_attempts=1)
    def handle(job: Job) -> dict[str, int]:
        return {"sent": job.attempts}

    client = Client(broker_url)
    client.enqueue_many(queue_name, [1, 2, 3])
    runner = SlotRunner(app, queue_name, open_broker(broker_url))
    run_until(runner, lambda: client.stats(queue_name) == {"ready": 0, "locked": 0,
                                                           "delayed": 0, "dead": 0})
    runner._flush()
    assert client.dead_jobs(queue_name) == []

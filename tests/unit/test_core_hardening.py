"""Issue 15, core part: pure rules (names, delays) and a Redis client that
must not hang on a silent server. Each test failed on the code before its fix."""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from qcluster import Job, exitcodes
from qcluster.broker.redis_broker import RedisBroker
from qcluster.broker.redis_scripts import delay_ms
from qcluster.cli import cli, register_commands
from qcluster.errors import (
    BrokerUnavailable,
    EnvelopeError,
    InvalidDelay,
    InvalidJobId,
    InvalidQueueName,
)
from qcluster.job import MAX_DELAY_S, check_delay, decode_envelope
from qcluster.names import MAX_JOB_ID_CHARS, QUEUE_NAME_PATTERN, check_job_id, check_queue_name

# --- names ---------------------------------------------------------------------------


@given(st.from_regex(QUEUE_NAME_PATTERN, fullmatch=True))
def test_every_name_of_the_rule_is_accepted(name: str) -> None:
    assert check_queue_name(name) == name


@given(st.text(max_size=140))
def test_a_name_is_accepted_only_if_it_is_safe_in_keys_and_markup(name: str) -> None:
    try:
        check_queue_name(name)
    except InvalidQueueName:
        return
    assert 1 <= len(name) <= 128
    assert not set(name) & set("{}[]/ \n\t\\\"'"), name


def test_a_trailing_newline_is_not_a_valid_name() -> None:
    with pytest.raises(InvalidQueueName):
        check_queue_name("emails\n")


# --- job ids -------------------------------------------------------------------------


@given(st.text(max_size=MAX_JOB_ID_CHARS + 10))
def test_a_job_id_is_looked_up_only_when_a_job_could_have_it(job_id: str) -> None:
    if job_id.strip() and len(job_id) <= MAX_JOB_ID_CHARS:
        assert check_job_id(job_id) == job_id
    else:
        with pytest.raises(InvalidJobId, match="invalid job id"):
            check_job_id(job_id)


@pytest.mark.parametrize("job_id", ["", "  ", "x" * (MAX_JOB_ID_CHARS + 1)])
def test_qcluster_job_refuses_an_id_no_job_has_before_reaching_the_broker(job_id: str) -> None:
    # Nothing listens on port 1: an id that got past the check would end in "unreachable".
    register_commands()
    result = CliRunner().invoke(cli, ["job", job_id, "--broker", "redis://127.0.0.1:1/0"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == exitcodes.USAGE, result.output
    assert "invalid job id" in result.output


# --- delays --------------------------------------------------------------------------


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_delay_is_accepted_only_finite_and_within_a_year(delay: float) -> None:
    ok = math.isfinite(delay) and 0 <= delay <= MAX_DELAY_S
    if ok:
        assert check_delay(delay) == delay
    else:
        with pytest.raises(InvalidDelay):
            check_delay(delay)


@pytest.mark.parametrize("delay", ["5", b"5", True, False, None, [5]])
def test_a_delay_that_is_not_a_number_is_refused(delay: object) -> None:
    # float() would read "5" as five seconds and True as one: a caller's mix-up (a
    # config string, a flag passed in the wrong place) would run on silently.
    with pytest.raises(InvalidDelay, match="must be a number of seconds"):
        check_delay(delay)  # type: ignore[arg-type]


@pytest.mark.parametrize("delay", [0, 5, 2.5, 1e-9])
def test_an_int_or_float_delay_is_taken(delay: float) -> None:
    assert check_delay(delay) == float(delay)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_settling_never_fails_on_a_delay(delay: float) -> None:
    assert 0 <= delay_ms(delay) <= MAX_DELAY_S * 1000


def test_job_retry_refuses_nan_infinity_negative_and_huge() -> None:
    job = Job(id="j", queue="q", payload=None, attempts=1, enqueued_at=0, activate_at=0)
    for bad in (float("nan"), float("inf"), -1.0, 1e15):
        with pytest.raises(ValueError, match="retry delay"):
            job.retry(bad)
    assert job.outcome is None
    job.retry(2.5)
    assert (job.outcome, job.retry_delay_s) == ("retry", 2.5)


# --- Redis on a dead link ------------------------------------------------------------


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers (a hung Redis)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                accepted.append(conn)
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    for conn in accepted:
        conn.close()
    listener.close()


def test_a_take_on_a_silent_redis_ends_in_a_clear_error(silent_server: int) -> None:
    broker = RedisBroker.from_url(f"redis://127.0.0.1:{silent_server}/0")
    outcome: list[BaseException | object] = []

    def take() -> None:
        try:
            outcome.append(broker.take("q", max_jobs=1, lock_timeout_s=5, wait_s=0))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(timeout=60)  # generous: the client gives up after SOCKET_TIMEOUT_S
    assert not thread.is_alive(), "take still blocked on a server that never answers"
    assert len(outcome) == 1 and isinstance(outcome[0], BrokerUnavailable), outcome
    assert "unreachable" in str(outcome[0])


# --- take replies --------------------------------------------------------------------

_IDS = st.one_of(st.binary(min_size=1, max_size=12), st.text(min_size=1, max_size=12).map(
    lambda text: text.encode()))


@given(st.lists(st.tuples(_IDS, st.integers(-50, 50).filter(bool)), max_size=20))
def test_a_take_reply_always_becomes_deliveries_marking_suspects_and_bad_ids(
    jobs: list[tuple[bytes, int]],
) -> None:
    from qcluster.broker.redis_scripts import deliveries as parse
    from qcluster.broker.redis_scripts import wire_id

    reply: list[object] = [1_700_000_000_000, 1_700_000_060_000,
                           sum(1 for _, attempts in jobs if attempts < 0)]
    for job_id, attempts in jobs:
        reply += [job_id, b"{}", attempts, b"1700000000000"]
    deliveries = parse(reply)
    assert len(deliveries) == len(jobs)
    for delivery, (job_id, attempts) in zip(deliveries, jobs, strict=True):
        assert wire_id(delivery.id) == job_id, "settling must address the stored id"
        assert (delivery.attempts, delivery.suspect) == (abs(attempts), attempts < 0)
        try:
            job_id.decode()
        except UnicodeDecodeError:
            assert delivery.malformed.startswith("malformed:")
        else:
            assert delivery.malformed == ""


# --- non-JSON numbers in a raw message (chaos row B1) ---------------------------------

_HEAD = b'{"v":1,"id":"x","queue":"q","enqueued_at":'


@pytest.mark.parametrize("payload", [
    b"NaN", b"-Infinity", b"Infinity", b"1e999", b"-1e309", b"1" + b"0" * 400 + b".5",
    b'[1, {"a": 1e400}]', b'{"a": [[[NaN]]]}',
])
def test_a_payload_no_producer_could_send_is_malformed(payload: bytes) -> None:
    """pydantic's JSON parser reads NaN, Infinity and 1e999 as floats; the producer refuses
    them (allow_nan=False), so a raw message carrying them is dead-lettered, never run."""
    with pytest.raises(EnvelopeError, match=r"^malformed: payload"):
        decode_envelope(_HEAD + b'1.5,"payload":' + payload + b"}")


@pytest.mark.parametrize("enqueued_at", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_an_infinite_or_nan_enqueue_time_is_malformed(enqueued_at: bytes) -> None:
    with pytest.raises(EnvelopeError, match=r"^malformed: enqueued_at"):
        decode_envelope(_HEAD + enqueued_at + b',"payload":1}')


@pytest.mark.parametrize("payload", [
    b'"NaN"', b'"Infinity"', b"1.5e300", b"-0.0", b"1" + b"0" * 400, b'{"a": [1, 2.5, null]}',
])
def test_finite_numbers_and_look_alike_strings_still_decode(payload: bytes) -> None:
    assert decode_envelope(_HEAD + b'1.5,"payload":' + payload + b"}").enqueued_at == 1.5

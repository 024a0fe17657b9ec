"""Issue 15, defect 3 (pure part): a job's lock must outlast its batch deadline by the time
the master needs to kill a hung slot, and setting only one of the two timeouts derives the
other instead of being refused."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.policy import QueuePolicy, kill_margin

seconds = st.floats(0.01, 10_000, allow_nan=False)


@given(lock=seconds, batch=seconds)
def test_lock_must_cover_the_batch_plus_the_kill_margin(lock: float, batch: float) -> None:
    margin = max(1.0, 0.1 * batch)
    if lock >= batch + margin:
        assert QueuePolicy(lock_timeout=lock, batch_timeout=batch).lock_timeout == lock
    elif lock < batch + margin - 1e-6:
        with pytest.raises(ValueError, match="must be at least batch_timeout"):
            QueuePolicy(lock_timeout=lock, batch_timeout=batch)


def test_the_issue_pair_is_refused() -> None:
    """lock 1.3 s / batch 1.0 s ran the same job in two slots (the kill came 0.9 s late)."""
    with pytest.raises(ValueError, match="must be at least batch_timeout"):
        QueuePolicy(lock_timeout=1.3, batch_timeout=1.0)


@given(lock=st.floats(1.01, 10_000, allow_nan=False))
def test_lock_timeout_alone_derives_a_batch_timeout_that_fits(lock: float) -> None:
    policy = QueuePolicy(lock_timeout=lock)
    assert policy.lock_timeout == lock
    assert 0 < policy.batch_timeout <= 30.0
    assert policy.batch_timeout + kill_margin(policy.batch_timeout) <= lock + 1e-6


def test_lock_timeout_5_alone_is_accepted() -> None:
    assert QueuePolicy(lock_timeout=5).batch_timeout == pytest.approx(4.0)


@given(batch=seconds)
def test_batch_timeout_alone_derives_a_lock_timeout_that_fits(batch: float) -> None:
    policy = QueuePolicy(batch_timeout=batch)
    assert policy.batch_timeout == batch
    assert policy.lock_timeout >= max(60.0, batch + kill_margin(batch)) - 1e-6


@pytest.mark.parametrize("lock", [0.5, 1.0])
def test_a_lock_too_short_for_any_batch_is_refused_clearly(lock: float) -> None:
    with pytest.raises(ValueError, match="leaves no time for a batch"):
        QueuePolicy(lock_timeout=lock)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_timeouts_are_refused(value: float) -> None:
    for field in ("lock_timeout", "batch_timeout"):
        with pytest.raises(ValueError):
            QueuePolicy.model_validate({field: value})


def test_an_override_of_one_timeout_rederives_the_other() -> None:
    code = QueuePolicy(lock_timeout=120.0, batch_timeout=60.0)
    assert code.merged({"lock_timeout": 5}).batch_timeout == pytest.approx(4.0)
    assert code.merged({"batch_timeout": 200}).lock_timeout == pytest.approx(220.0)
    assert code.merged({"batch_timeout": 10}).lock_timeout == 120.0  # still fits: kept
    with pytest.raises(ValueError):
        code.merged({"lock_timeout": 5, "batch_timeout": 10})

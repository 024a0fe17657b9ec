"""A queue sized by its wait (``size_by = "wait"``) in the planner: bounds, monotonicity,
its reason, a flat rate, and the policy's refusal without a target_wait."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster import App
from qcluster.config import load_settings
from qcluster.errors import ConfigError
from qcluster.manager.planning.plan import (
    MAX_UTILIZATION,
    QueueInput,
    QueuePlan,
    QueueWindow,
    plan,
)
from qcluster.policy import QueuePolicy
from tests.unit.test_planning import assert_moves_once_at_a_flat_rate

TU = 0.8
BIG = 10_000


def make_policy(**fields: Any) -> QueuePolicy:
    return QueuePolicy.model_validate({"max_slots": 200, **fields})


def first_round(policy: QueuePolicy, work: float, job_s: float) -> QueuePlan:
    """A queue's first plan from no slot, its window busy ``work`` slot-seconds a second."""
    window = QueueWindow(processed=max(1, round(60 * work / job_s)), busy_s=60 * work,
                         alive_s=60.0 * max(1.0, work), backlog=0, span_s=60.0)
    return plan([QueueInput("q", policy, 0, window)], BIG, TU)["q"]


works = st.floats(0.05, 150.0)
jobs = st.sampled_from([0.005, 0.02, 0.05, 0.2, 0.5])
targets = st.sampled_from([0.5, 2.0, 10.0, 30.0, 120.0])
batches = st.sampled_from([1, 10, 100])


@given(works, jobs, targets, batches)
def test_a_queue_sized_by_its_wait_gets_no_more_slots_than_the_target_utilization_gives_and_no_fewer_than_95_percent_busy(  # noqa: E501
        work: float, job_s: float, target: float, batch: int) -> None:
    sized = first_round(make_policy(size_by="wait", target_wait=target, batch_size=batch),
                        work, job_s)
    usual = first_round(make_policy(target_wait=target, batch_size=batch), work, job_s)
    assert math.ceil(work / MAX_UTILIZATION) <= sized.planned <= usual.planned
    assert usual.planned == math.ceil(work / TU)


@given(works, works, jobs, targets)
def test_more_work_never_gets_fewer_slots(a: float, b: float, job_s: float,
                                          target: float) -> None:
    policy = make_policy(size_by="wait", target_wait=target)
    low, high = sorted((a, b))
    assert first_round(policy, low, job_s).planned <= first_round(policy, high, job_s).planned


@given(works, jobs, targets, targets)
def test_a_longer_target_wait_never_gets_more_slots(work: float, job_s: float, a: float,
                                                    b: float) -> None:
    short, long = sorted((a, b))
    slots = [first_round(make_policy(size_by="wait", target_wait=t), work, job_s).planned
             for t in (short, long)]
    assert slots[1] <= slots[0]


def test_the_reason_says_the_queue_is_sized_by_its_wait() -> None:
    """10 slot-seconds a second of 20 ms jobs, target 2 s: 11 slots at 95% busy keep the
    predicted p99 wait well within 1 s (half the target), against 13 at 80%."""
    decision = first_round(make_policy(size_by="wait", target_wait=2.0), 10.0, 0.02)
    assert decision.planned == 11
    assert "sized by wait: p99 ~" in decision.reason
    assert "s within 1s at 95% busy" in decision.reason and "slots at 95%" in decision.reason


def test_a_tight_target_sizes_below_95_percent() -> None:
    """1 slot-second a second of 500 ms jobs within 4 s (p99 within 2 s): one slot at 95%
    would keep jobs waiting far longer; 2 slots (at most what 80% gives) it is."""
    decision = first_round(make_policy(size_by="wait", target_wait=4.0), 1.0, 0.5)
    assert decision.planned == 2 and "at 80% busy" in decision.reason


def test_size_by_utilization_is_the_default_planner() -> None:
    window = QueueWindow(processed=6000, busy_s=240.0, alive_s=300.0, backlog=30, span_s=60.0)
    default, explicit = (
        plan([QueueInput("q", policy, 5, window)], BIG, TU)["q"]
        for policy in (make_policy(target_wait=2.0),
                       make_policy(target_wait=2.0, size_by="utilization")))
    assert default.reason == explicit.reason
    assert replace(default, why=explicit.why) == explicit  # a Why compares by identity


@given(st.integers(1, 5_000), st.sampled_from([0.001, 0.01, 0.1]),
       st.lists(st.integers(0, 3), min_size=20, max_size=20), st.integers(-5, 10),
       st.sampled_from([1.0, 2.0, 30.0]))
def test_a_flat_rate_moves_a_queue_sized_by_its_wait_at_most_once(
        rate: int, job_s: float, lag: list[int], priority: int, target: float) -> None:
    """As for any queue: whatever the masters' lag, a flat arrival rate settles the plan in
    at most one move after the first decision."""
    policy = make_policy(priority=priority, max_slots=100, size_by="wait", target_wait=target)
    assert_moves_once_at_a_flat_rate(policy, rate, job_s, lag)


NEEDS_TARGET = 'size_by = "wait" needs a target_wait'


def test_size_by_wait_without_a_target_wait_is_refused_when_the_policy_is_built() -> None:
    with pytest.raises(ValueError, match=NEEDS_TARGET):
        QueuePolicy.model_validate({"size_by": "wait"})
    with pytest.raises(ValueError, match="size_by"):
        QueuePolicy.model_validate({"size_by": "fast"})


def test_an_app_queue_sized_by_wait_without_a_target_wait_is_refused_in_one_line() -> None:
    app = App("sizing")
    with pytest.raises(ConfigError) as refused:
        app.queue("mail", size_by="wait")(lambda jobs: None)
    assert NEEDS_TARGET in str(refused.value) and "\n" not in str(refused.value)
    app.queue("mail", size_by="wait", target_wait=30)(lambda jobs: None)  # accepted


def test_a_configured_queue_sized_by_wait_without_a_target_wait_is_refused_in_one_line(
        tmp_path: Path) -> None:
    """Refused where the app is loaded: the target_wait may come from the code
    (tests/unit/test_config_messages.py has that case)."""
    config = tmp_path / "qcluster.toml"
    config.write_text('[queues.mail]\nsize_by = "wait"\n')
    app = App("sizing")
    app.queue("mail")(lambda jobs: None)
    with pytest.raises(ConfigError) as refused:
        app.with_overrides(load_settings(config).queues)
    assert "queues.mail" in str(refused.value) and NEEDS_TARGET in str(refused.value)
    assert "\n" not in str(refused.value)
    config.write_text('[queues.mail]\nsize_by = "wait"\ntarget_wait = 30\n')
    assert load_settings(config).queues["mail"]["size_by"] == "wait"

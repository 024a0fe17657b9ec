"""How the RabbitMQ backend counts a job's attempts from its headers (pure: amqp_messages).

A consumer that dies gets every message it held redelivered, and nothing says which one
ran: the first death of a job that was not suspect is not charged (it comes back suspect
and runs alone); every later death is. A quorum queue counts deaths in
``x-delivery-count``; a copy qcluster republishes (given back, released) moves that count
into its own header. Wherever the copies happen, no death is lost or counted twice."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from qcluster.broker.amqp_messages import (
    ATTEMPTS_HEADER,
    DELIVERY_COUNT_HEADER,
    SUSPECT_HEADER,
    charge_redelivery,
    fold_delivery_count,
    taken_attempts,
)


def quorum_death(headers: dict[str, Any]) -> None:
    """RabbitMQ's side: the consumer holding the message died (a quorum queue counts it)."""
    headers[DELIVERY_COUNT_HEADER] = headers.get(DELIVERY_COUNT_HEADER, 0) + 1


@given(st.lists(st.booleans(), max_size=12))
def test_a_quorum_job_is_charged_every_death_but_its_first_wherever_it_was_copied(
    copy_after: list[bool],
) -> None:
    """``copy_after[i]``: after death i the message was republished (folded) before it was
    taken again, or handed out as it came back."""
    headers: dict[str, Any] = {}
    for copy in copy_after:
        quorum_death(headers)
        if copy:
            fold_delivery_count(headers)
            assert DELIVERY_COUNT_HEADER not in headers
    attempts, suspect = taken_attempts(headers)
    deaths = len(copy_after)
    assert attempts == 1 + max(deaths - 1, 0)
    assert suspect == (deaths > 0)


@given(st.integers(0, 1000), st.booleans(), st.integers(0, 50))
def test_folding_a_quorum_count_changes_nothing_the_next_take_sees(
    attempts: int, suspect: bool, count: int
) -> None:
    headers: dict[str, Any] = {ATTEMPTS_HEADER: attempts, DELIVERY_COUNT_HEADER: count}
    if suspect:
        headers[SUSPECT_HEADER] = 1
    before = taken_attempts(headers)
    fold_delivery_count(headers)
    assert taken_attempts(headers) == before


@given(st.integers(1, 12))
def test_a_classic_job_is_charged_every_death_but_its_first(deaths: int) -> None:
    """A classic queue only flags a redelivery: each is republished, charged once."""
    headers: dict[str, Any] = {}
    for _ in range(deaths):
        charge_redelivery(headers, 1)
    assert taken_attempts(headers) == (deaths, True)


def test_a_death_beside_others_is_not_charged_a_death_alone_is() -> None:
    batch_mate: dict[str, Any] = {ATTEMPTS_HEADER: 2}  # two earlier runs that failed
    charge_redelivery(batch_mate, 1)
    assert taken_attempts(batch_mate) == (3, True)
    charge_redelivery(batch_mate, 1)  # suspect: it ran alone, and died
    assert taken_attempts(batch_mate) == (4, True)


def test_an_unreadable_count_is_left_for_the_slot_to_dead_letter() -> None:
    headers: dict[str, Any] = {ATTEMPTS_HEADER: "abc", DELIVERY_COUNT_HEADER: 1}
    fold_delivery_count(headers)
    assert headers[ATTEMPTS_HEADER] == "abc"
    charge_redelivery(headers, 1)
    assert headers[ATTEMPTS_HEADER] == "abc" and SUSPECT_HEADER in headers

"""Which slot holds a job, where the broker cannot say (RabbitMQ): the slot's shared take
progress answers its master (TakeProgress.find), and the manager's lookup waits for the
masters' answers (manager/held_lookup.py)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcluster.channel import TakeProgress
from qcluster.job import Delivery
from qcluster.manager.held_lookup import MAX_WAITING, HeldLookup, LookupsBusy
from qcluster.messages import HeldJob, Progress


def take(ids: list[str], taken_at: float = 1e9) -> list[Delivery]:
    return [Delivery(job_id, b"", n + 1, taken_at, taken_at, "application/json", 0)
            for n, job_id in enumerate(ids)]


@given(st.lists(st.uuids().map(str), min_size=1, max_size=40, unique=True),
       st.data())
def test_a_take_answers_for_its_unfinished_jobs_only(ids: list[str], data: st.DataObject) -> None:
    progress = TakeProgress()
    assert progress.begin(1, "mail", 0, take(ids), settleable=False)
    states = data.draw(st.lists(st.sampled_from([Progress.UNSTARTED, Progress.RUNNING,
                                                 Progress.DONE, Progress.FAILED]),
                                min_size=len(ids), max_size=len(ids)))
    progress.states[: len(ids)] = bytes(states)
    wanted = set(data.draw(st.lists(st.sampled_from(ids))))
    found = {job.id: job for job in progress.find(wanted | {"not-held"})}
    expected = {i for i, s in zip(ids, states, strict=True)
                if i in wanted and s <= Progress.RUNNING}
    assert set(found) == expected
    for n, job_id in enumerate(ids):
        if job_id in found:
            job = found[job_id]
            assert job.queue == "mail" and job.attempts == n + 1 and job.taken_at == 1e9
            assert job.started == (states[n] == Progress.RUNNING)


def test_a_take_followed_for_lookups_only_is_never_settled_by_the_master() -> None:
    """RabbitMQ gives back a dead slot's messages itself: its master must not settle them
    again, nor report a lock token for them."""
    progress = TakeProgress()
    assert progress.begin(1, "mail", 0, take(["a", "b"]), settleable=False)
    assert progress.read() is None and progress.receipt() is None
    assert [job.id for job in progress.find({"b"})] == ["b"]
    assert progress.begin(2, "mail", 9, take(["c"]))
    assert progress.read() is not None and progress.receipt() == 9
    assert progress.find({"a", "b"}) == []  # the next take replaced them


def held(job_id: str) -> HeldJob:
    return HeldJob(id=job_id, queue="mail", attempts=1, taken_at=1e9, started=True, slot_no=2)


def answer_when_asked(lookup: HeldLookup, answers: dict[str, list[HeldJob]]) -> threading.Thread:
    """Masters replying to the next report's find_jobs, as their reporter threads do."""
    def run() -> None:
        while not lookup.wanted():
            threading.Event().wait(0.001)
        for host, jobs in answers.items():
            lookup.answered(host, lookup.wanted(), jobs)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_host_whose_slot_holds_the_job_is_found() -> None:
    lookup = HeldLookup()
    answer_when_asked(lookup, {"a": [], "b": [held("j1")]})
    found = lookup.find("j1", {"a", "b"}, timeout_s=60)
    assert found.host == "b" and found.job is not None and found.job.slot_no == 2


def test_no_holder_once_every_reporting_host_answered_without_waiting_the_deadline() -> None:
    lookup = HeldLookup()
    answer_when_asked(lookup, {"a": [], "b": []})
    found = lookup.find("j1", {"a", "b"}, timeout_s=600)  # not 600 s: both answered
    assert found.host is None and (found.answered, found.asked) == (2, 2)


def test_a_host_that_never_answers_ends_the_wait_at_its_deadline() -> None:
    found = HeldLookup().find("j1", {"silent", "other"}, timeout_s=0.05)
    assert found.host is None and (found.answered, found.asked) == (0, 2)


def test_an_answer_given_before_a_lookup_began_is_not_taken_and_asks_expire() -> None:
    now = [0.0]
    lookup = HeldLookup(clock=lambda: now[0])
    lookup.answered("a", ["j1"], [held("j1")])  # nobody asked: nothing kept
    assert lookup.find("j1", {"a"}, timeout_s=0).host is None
    now[0] = 1.0
    lookup.answered("a", ["j1"], [held("j1")])
    now[0] = 2.0
    assert lookup.find("j1", {"a"}, timeout_s=0).host is None  # answered before it began
    assert lookup.wanted() == ["j1"]
    now[0] = 33.0
    assert lookup.wanted() == []


def test_two_lookups_of_one_job_at_once_both_get_the_holder() -> None:
    """A second lookup (a page refresh, the CLI beside the page) must not leave the first
    one waiting out its deadline and answering that no slot holds the job."""
    began: set[threading.Thread] = set()

    def clock() -> float:  # a lookup reads it first when it begins, under the lookup's lock
        began.add(threading.current_thread())
        return time.monotonic()

    lookup = HeldLookup(clock=clock)
    results: list[str | None] = []

    def look() -> None:
        results.append(lookup.find("j1", {"a"}, timeout_s=60).host)

    first, second = threading.Thread(target=look), threading.Thread(target=look)
    for thread in (first, second):
        thread.start()
        # Only answers given after a lookup began count: answering before the second one
        # began (a busy CPU may start a thread late) would leave it waiting out its 60 s.
        while thread not in began:
            threading.Event().wait(0.001)
    lookup.answered("a", ["j1"], [held("j1")])
    first.join(60)
    second.join(60)
    assert results == ["a", "a"]


def test_lookups_beyond_the_limit_are_refused_not_queued() -> None:
    lookup = HeldLookup()
    waiting = [threading.Thread(target=lookup.find, args=(f"j{n}", {"silent"}, 5.0))
               for n in range(MAX_WAITING)]
    for thread in waiting:
        thread.start()
    while len(lookup.wanted()) < MAX_WAITING:
        threading.Event().wait(0.001)
    with pytest.raises(LookupsBusy):
        lookup.find("one-more", {"silent"}, timeout_s=5.0)
    for n in range(MAX_WAITING):
        lookup.answered("silent", [f"j{n}"], [])
    for thread in waiting:
        thread.join(60)

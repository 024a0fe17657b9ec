"""A slot a reload template double-forks waits to become the master's child before it runs
(master/template.py ``become_slot``): the middle child exits meanwhile, at any moment."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

from qcluster import App, exitcodes
from qcluster.master import effects, template
from qcluster.master.template import ForkSlot, TemplateSpec

MASTER, MIDDLE, INIT = 1000, 2000, 1
RAN = 77
"""What the stand-in for the slot's run returns: the slot got as far as running."""


def parents(*seen: int) -> Iterator[int]:
    """``os.getppid()`` over time: each value once, the last one from then on."""
    yield from seen
    while True:
        yield seen[-1]


def become(monkeypatch: pytest.MonkeyPatch, *seen: int) -> int:
    answers = parents(*seen)
    monkeypatch.setattr(template.os, "getppid", lambda: next(answers))
    monkeypatch.setattr(template.time, "sleep", lambda _s: None)
    monkeypatch.setattr(effects, "become_slot", lambda *_args: RAN)
    spec = TemplateSpec(app="tmpl_app", master_pid=MASTER)
    left, right = socket.socketpair()
    try:
        return template.become_slot(left, spec, App("t"), ForkSlot(queue="q", slot_no=3),
                                    [], MIDDLE)
    finally:
        left.close()
        right.close()


def test_a_slot_reparented_to_the_master_between_two_looks_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The middle child exits right after the slot's first look: the next look sees the
    # master. It used to look twice per check and take the master, seen second, for a
    # stranger: the slot exited 1 at once and a rolling reload stopped as failed.
    assert become(monkeypatch, MIDDLE, MASTER) == RAN


def test_a_slot_whose_parent_is_already_the_master_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert become(monkeypatch, MASTER) == RAN


def test_a_slot_reparented_elsewhere_exits_and_says_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger=template.__name__):
        assert become(monkeypatch, MIDDLE, INIT) == exitcodes.FAILURE
    assert "its parent is pid 1, not the master (pid 1000): the master is gone" in caplog.text

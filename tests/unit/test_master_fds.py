"""The master's descriptors when forks fail (review finding 2): a template that does not
fork a slot left the slot's TakeProgress memfd open, one per attempt, until the master
hit its descriptor limit and died of the OSError the next channel raised."""

from __future__ import annotations

import errno
import os

import pytest

from qcluster.master.counters import MasterCounters
from qcluster.master.effects import ProcessEffects
from qcluster.master.pool import SlotPool
from qcluster.master.template import Tend


class RefusingTemplate:
    """A template that never forks (dead, or too slow): fork_slot answers None."""

    pid, answer, ended, reaped = 1, None, False, False

    def fork_slot(self, queue: str, slot_no: int, channel_fd: int,
                  progress_fd: int | None, *, tend: Tend | None = None) -> int | None:
        return None


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def never(*args: object) -> int:
    raise AssertionError("no slot runs here")


def test_failed_template_forks_keep_the_descriptor_count_flat() -> None:
    effects = ProcessEffects()
    template = RefusingTemplate()
    effects.fork_via(template, "q", 0)  # (anything opened once, e.g. by a first import)
    before = open_fds()
    for slot_no in range(100):
        assert effects.fork_via(template, "q", slot_no) is None
    assert open_fds() == before


@pytest.mark.parametrize("via_template", [False, True])
def test_no_descriptor_left_is_logged_and_retried_not_the_masters_end(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, via_template: bool
) -> None:
    def no_descriptor() -> object:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("qcluster.master.effects.slot_channel_pair", no_descriptor)
    pool = SlotPool(ProcessEffects(), MasterCounters(), never)
    pool.template = RefusingTemplate() if via_template else None
    pool.fork("q", 0.0)  # raised out of the loop before: the master and its slots died
    assert pool.slots == {} and "Too many open files" in caplog.text
    assert not pool.effects.fork_lock.locked()

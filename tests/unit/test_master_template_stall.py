"""A stalled reload template delays no hung slot's kill: while the master waits for a
template to fork a slot, the kills that fall due still happen at their deadline (a real
SIGSTOPped template, and the supervisor's loop in the component harness)."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qcluster.master.template import Ready, TemplateHandle, TemplateSpec, Tend
from tests.conftest import wait_until
from tests.unit.test_master_component import Q, busy, harness, make_app
from tests.unit.test_master_reload_component import FakeTemplate, Reloading
from tests.unit.test_master_reload_template import GOOD, app_dir, spec

__all__ = ["app_dir"]  # (a fixture, used by name)


def test_a_stopped_template_still_lets_the_loop_tend_its_deadlines(
    app_dir: Path, tmp_path: Path
) -> None:
    """Fails on the code before: the exchange blocked in one recv for its whole timeout
    (5 s), nothing else ran meanwhile (no ``tend``)."""
    (app_dir / "tmpl_app.py").write_text(GOOD.format(version="v1"))
    handle = TemplateHandle(spec(tmp_path))
    calls: list[float] = []

    def tend() -> float:
        calls.append(time.monotonic())
        return calls[-1] + 0.1

    try:
        wait_until(lambda: isinstance(handle.poll(), Ready), timeout_s=60, message="ready")
        os.kill(handle.pid, signal.SIGSTOP)
        a, b = socket.socketpair()
        with a, b:
            assert handle.fork_slot("tq", 0, a.fileno(), b.fileno(), tend=tend,
                                    timeout_s=1.0) is None
        _, status = os.waitpid(handle.pid, 0)  # killed, stopped as it was
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
        assert len(calls) >= 3, calls
    finally:
        handle.end()


class StalledTemplate(FakeTemplate):
    """Never answers a fork: the master waits its whole timeout, its clock running."""

    stalled_s = 5.0

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.kills_seen: list[tuple[float, list[tuple[int, int]]]] = []
        """(the clock, the kills so far) at each step of the stall."""

    def fork_slot(self, queue: str, slot_no: int, channel_fd: int,
                  progress_fd: int | None, *, tend: Tend | None = None) -> int | None:
        waited = 0.0
        while waited < self.stalled_s:
            self.h.clock.now += 0.05
            waited += 0.05
            self.kills_seen.append((self.h.clock.now, list(self.h.os.kills)))
            if tend is not None:
                tend()
        return None


@pytest.fixture
def r(monkeypatch: pytest.MonkeyPatch) -> Iterator[Reloading]:
    for h in harness(monkeypatch, make_app(Q), {Q: 2}):
        yield Reloading(h)


def test_a_hung_slot_is_killed_at_its_deadline_while_the_template_stalls(
    r: Reloading, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue's scenario: after a reload the template is stopped, an idle slot ends, the
    master asks the template for its replacement; a slot whose batch deadline falls in that
    wait was killed only once the exchange gave up (at +6.7 s for a 4 s batch), while its
    jobs' locks expired and another slot ran them. Fails on the code before."""
    h = r.h

    def stalled(spec: TemplateSpec) -> FakeTemplate:
        template = StalledTemplate(h, spec, 90_000 + len(r.templates))
        r.templates.append(template)
        return template

    monkeypatch.setattr(h.sup.reload, "spawn", stalled)
    old = r.rolling()  # the template is ready: the next fork goes through it
    victim = old[0]
    busy(h, victim, deadline_in_s=1.0)
    deadline = h.clock.now + 1.0
    h.step()  # the rollout asks the (stalled) template for a new slot
    template = r.template
    assert isinstance(template, StalledTemplate) and template.kills_seen, "no fork asked"
    killed_at = next((at for at, kills in template.kills_seen
                      if (victim, signal.SIGKILL) in kills), None)
    assert killed_at is not None, "the hung slot was not killed while the template stalled"
    assert deadline <= killed_at <= deadline + 0.1

"""Reload in the supervisor's loop, driven by the component harness (fake fork, kill,
waitpid and clock) and a fake template that answers what the test says and "forks"
slots whose channel ends the test keeps (master/reload.py, master/rollout.py)."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from qcluster import exitcodes
from qcluster.master.http import MasterCollector, host_json
from qcluster.master.template import Failed, Ready, TemplateSpec
from qcluster.policy import QueuePolicy
from tests.unit.test_master_component import Harness, Q, harness, make_app, started


class FakeTemplate:
    """A template process as the master sees it; its slots are the harness's forks."""

    def __init__(self, h: Harness, spec: TemplateSpec, pid: int) -> None:
        self.h, self.spec, self.pid = h, spec, pid
        self.sock, self._other = socket.socketpair()
        self.answer: Ready | Failed | None = None
        self.ended = False
        self.reaped = False
        self.forked: list[int] = []

    def poll(self) -> Ready | Failed | None:
        return self.answer

    def fork_slot(self, queue: str, slot_no: int, channel_fd: int,
                  progress_fd: int | None, *, tend: Any = None) -> int | None:
        assert channel_fd >= 0 and progress_fd is not None  # what goes over SCM_RIGHTS
        pid = self.h._fork()
        self.forked.append(pid)
        return pid

    def end(self) -> None:
        self.ended = True
        self.sock.close()
        self._other.close()


class Reloading:
    """The harness plus the templates its supervisor spawned."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.templates: list[FakeTemplate] = []
        h.sup.reload.spawn = self._spawn

    def _spawn(self, spec: TemplateSpec) -> FakeTemplate:
        template = FakeTemplate(self.h, spec, 90_000 + len(self.templates))
        self.templates.append(template)
        return template

    @property
    def template(self) -> FakeTemplate:
        return self.templates[-1]

    def ready(self, version: str = "v2") -> None:
        policy = QueuePolicy.model_validate({"batch_size": 3})
        self.template.answer = Ready(version=version, queues={Q: policy})

    def rolling(self) -> list[int]:
        """Start the slots, SIGHUP, the template answers ready: the rollout begins. Returns
        the old slots' pids."""
        old = started(self.h)
        self.h.signal(signal.SIGHUP)
        self.h.step()
        self.ready()
        self.h.step()
        return old

    def code(self) -> Any:
        return self.h.sup.snapshot.code

    def serving(self) -> int:
        """Slots that take jobs: said hello and not stopping."""
        return sum(1 for s in self.h.slots() if s.state in ("idle", "busy"))

    def stop_orders(self) -> list[int]:
        """Slots the master told to stop (StopSlot), read from their channel ends."""
        stopped = []
        for pid in self.h.live_pids():
            if "stop" in self.h.received(pid):
                stopped.append(pid)
        return stopped


@pytest.fixture
def r(monkeypatch: pytest.MonkeyPatch) -> Iterator[Reloading]:
    for h in harness(monkeypatch, make_app(Q), {Q: 4}):
        yield Reloading(h)


def roll_to_the_end(r: Reloading, old: list[int]) -> None:
    """Play the rollout: new slots say hello, stopped old ones exit; the queue never has
    fewer than its row serving."""
    h = r.h
    for _ in range(40):
        h.step(0.1)
        assert r.serving() >= 4
        assert sum(1 for s in h.slots() if s.state == "starting") <= 1  # one in flight
        fresh = [pid for pid in r.template.forked if pid in h.live_pids()
                 and h.states()[pid] == "starting"]
        h.hello(*fresh)
        for pid in r.stop_orders():
            assert pid in old  # only old slots are told to stop
            h.exit(pid, 0)
        if r.code().state == "idle" and r.code().old_slots == 0:
            return
    raise AssertionError(f"the rollout did not end: {r.code()}")


def test_a_reload_replaces_every_slot_new_one_first(r: Reloading) -> None:
    h = r.h
    old = started(h)
    h.signal(signal.SIGHUP)
    h.step()
    assert r.code().state == "loading" and r.template.spec.master_pid > 0
    h.step(0.5)
    assert r.template.forked == []  # nothing happens to the slots while it imports
    r.ready()
    h.step()
    assert r.code().state == "rolling" and r.code().version == "v2"
    assert r.code().generation == 1 and r.code().old_slots == 4
    assert len(r.template.forked) == 1 and not r.stop_orders()  # the new one first
    roll_to_the_end(r, old)
    assert set(h.live_pids()) == set(r.template.forked[-4:])
    assert h.sup.snapshot.reloads == {"took": 1, "failed": 0}
    assert not r.template.ended  # the newest template forks every later slot
    victim, forks = h.live_pids()[0], len(h.os.forks)
    h.exit(victim, 70 << 8)  # a crash: restarted through the template, after its backoff
    h.step()
    h.step(1.0)
    assert len(h.os.forks) == forks + 1 and h.os.forks[-1] == r.template.forked[-1]
    assert r.template.forked[-1] in h.live_pids() and victim not in h.live_pids()


def test_a_failed_import_keeps_the_old_slots_and_reports_the_error(r: Reloading) -> None:
    h = r.h
    old = started(h)
    h.signal(signal.SIGHUP)
    h.step()
    r.template.answer = Failed(error="SyntaxError: invalid syntax (app.py, line 3)")
    h.step()
    code = r.code()
    assert code.state == "failed" and code.error.startswith("SyntaxError")
    assert code.version == "" and code.generation == 0
    assert r.template.ended and r.template.forked == []
    assert h.live_pids() == old and h.os.kills == []
    assert host_json(h.sup.snapshot)["code"]["state"] == "failed"
    families = {f.name: f for f in MasterCollector(lambda: h.sup.snapshot, "h").collect()}
    assert [s.value for s in families["qcluster_master_reloads"].samples
            if s.labels == {"result": "failed"}] == [1]


def test_a_template_that_does_not_answer_in_time_fails(r: Reloading) -> None:
    h = r.h
    started(h)
    h.signal(signal.SIGHUP)
    h.step()
    h.step(59.0)
    assert r.code().state == "loading"
    h.step(2.0)
    assert r.code().state == "failed" and "did not answer within 60 s" in r.code().error
    assert r.template.ended


def test_a_template_that_exits_before_answering_fails(r: Reloading) -> None:
    h = r.h
    started(h)
    h.signal(signal.SIGHUP)
    h.step()
    h.os.exits.append((r.template.pid, 9))  # killed by SIGKILL (wait status 9)
    h.step()
    assert r.code().state == "failed" and "exited with code -9" in r.code().error


def test_an_import_error_sent_before_the_template_exited_is_the_error(
    r: Reloading, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding 7: the master reaps before it reads the template's socket; a
    template that answered failed and exited was reported as 'exited with code 0 before
    it answered' instead of its import error."""
    h = r.h
    started(h)
    h.signal(signal.SIGHUP)
    h.step()
    template, said = r.template, Failed(error="ModuleNotFoundError: No module named 'x'")

    def poll() -> Failed:  # as TemplateHandle: the answer is read from the socket
        template.answer = said
        return said

    monkeypatch.setattr(template, "poll", poll)
    h.os.exits.append((template.pid, 0))
    h.step()
    assert r.code().state == "failed" and r.code().error == said.error


@pytest.mark.parametrize(("code", "reason"), [
    (exitcodes.BOOT_ERROR, "boot_error"), (exitcodes.APP_IMPORT, "boot_error"),
    (1, "crash"), (-9, "crash"),
])
def test_a_new_slot_that_cannot_start_aborts_and_old_code_serves_again(
    r: Reloading, code: int, reason: str
) -> None:
    h = r.h
    old = r.rolling()
    [new] = r.template.forked
    h.os.end(new, code << 8 if code > 0 else -code)
    h.step()
    info = r.code()
    assert info.state == "failed" and f"queue {Q}" in info.error
    assert f"({reason}, exit code {code};" in info.error
    assert info.generation == 0 and r.template.ended
    assert set(old) <= set(h.live_pids()) and not r.stop_orders()
    h.step(1.0)  # past the boot error's backoff: nothing is missing, nothing forked
    assert len(r.template.forked) == 1 and set(h.live_pids()) == set(old)


def test_the_first_reload_id_is_recorded_a_new_one_reloads(r: Reloading) -> None:
    h = r.h
    started(h)
    h.sup.set_reload_id("r1")  # asked before this master started: it runs that code
    h.step()
    assert r.templates == [] and r.code().reload_id == "r1" and r.code().state == "idle"
    h.sup.set_reload_id("r1")
    h.sup.set_reload_id("")  # a restarted manager forgot it: nothing to do
    h.step()
    assert r.templates == [] and r.code().reload_id == "r1"
    h.sup.set_reload_id("r2")
    h.step()
    assert len(r.templates) == 1 and r.code().state == "loading"
    assert r.code().reload_id == "r2"


def test_a_second_sighup_while_loading_starts_over_with_the_newest_code(
    r: Reloading
) -> None:
    h = r.h
    started(h)
    h.signal(signal.SIGHUP)
    h.step()
    h.signal(signal.SIGHUP)
    h.step()
    first, second = r.templates
    assert first.ended and not second.ended and r.code().state == "loading"


def test_a_sighup_while_rolling_rolls_on_to_the_newest_code(r: Reloading) -> None:
    h = r.h
    old = started(h)
    h.signal(signal.SIGHUP)
    h.step()
    r.ready("v2")
    h.step()
    rolling = r.template
    h.signal(signal.SIGHUP)
    h.step()
    r.ready("v3")
    h.step()
    assert rolling.ended and r.code().version == "v3" and r.code().generation == 2
    roll_to_the_end(r, old + rolling.forked)
    assert set(h.live_pids()) <= set(r.template.forked)


def test_sigterm_during_a_reload_stops_everything(r: Reloading) -> None:
    h = r.h
    pids = r.rolling()
    h.signal(signal.SIGTERM)
    h.step()
    assert r.template.ended
    for pid in h.live_pids():
        assert h.signals_to(pid) == [signal.SIGTERM]
        h.exit(pid, 0)
    h.step()
    assert h.returned == exitcodes.OK and set(pids) | set(r.template.forked)


def test_the_report_carries_the_code_and_the_newest_policies(r: Reloading) -> None:
    from qcluster.master.reporter import build_report

    h = r.h
    r.rolling()
    report = build_report(h.sup, 2.0, 1)
    assert report.code.version == "v2" and report.code.state == "rolling"
    assert report.queues[Q].batch_size == 3




def test_a_template_that_cannot_be_started_fails_the_reload_only(r: Reloading) -> None:
    h = r.h
    old = started(h)

    def no_process(spec: TemplateSpec) -> FakeTemplate:
        raise OSError(11, "Resource temporarily unavailable")

    h.sup.reload.spawn = no_process
    h.signal(signal.SIGHUP)
    h.step()
    assert r.code().state == "failed" and "cannot start a template" in r.code().error
    h.step(1.0)
    assert h.live_pids() == old and h.returned is None


def test_a_dead_serving_template_starts_no_reload_and_the_master_forks_again(
    r: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    """Review finding 1: a dead template (OOM killer, an operator) reloaded whatever code
    was on disk; when that failed, every later fork went to the dead template (EPIPE) and
    a crashed slot was never replaced."""
    h = r.h
    old = r.rolling()
    roll_to_the_end(r, old)
    serving, survivors = r.template, h.live_pids()
    h.os.exits.append((serving.pid, 9))  # OOM-killed, or killed after a fork timeout
    h.step()
    assert len(r.templates) == 1 and serving.ended  # no reload nobody asked for
    assert "exited with code -9: new slots are forked from version" in caplog.text
    code = r.code()
    assert code.generation == 0 and code.state == "idle" and "exited with code -9" in code.error
    assert code.old_slots == 0 and set(h.live_pids()) == set(survivors)
    h.step(1.0)
    assert not r.stop_orders()  # the new code's slots serve on: nothing replaces them
    victim, forks = survivors[0], len(h.os.forks)
    h.exit(victim, 70 << 8)  # a crash: restarted by the master itself (generation 0)
    h.step()
    h.step(1.0)
    assert len(h.os.forks) == forks + 1 and h.os.forks[-1] not in serving.forked
    assert len(h.live_pids()) == 4 and not r.stop_orders()
    h.signal(signal.SIGHUP)  # a reload asked for later replaces every slot
    h.step()
    r.ready("v3")
    h.step()
    assert r.code().old_slots == 4 and r.code().generation == 2


def test_a_serving_template_dead_mid_rollout_rolls_back(r: Reloading) -> None:
    """Finding 1, mid-rollout: forks go back to the previous code and the rollout
    replaces the new slots with it (it stuck at failed with old_slots=1 before)."""
    h = r.h
    old = r.rolling()
    [new] = r.template.forked
    h.hello(new)
    h.step()
    [retiring] = r.stop_orders()
    h.exit(retiring, 0)
    h.step()
    h.os.exits.append((r.template.pid, 9))
    h.step()
    code = r.code()
    assert code.state == "failed" and "exited with code -9" in code.error
    assert code.generation == 0 and len(r.templates) == 1
    for _ in range(10):
        h.step(0.5)
        h.hello(*[p for p in h.live_pids() if h.states()[p] == "starting"])
        for pid in r.stop_orders():
            h.exit(pid, 0)
    assert new not in h.live_pids() and len(h.live_pids()) == 4
    assert r.code().old_slots == 0 and set(old) - {retiring} <= set(h.live_pids())


def test_a_rollback_when_both_templates_died_forks_from_the_master(r: Reloading) -> None:
    h = r.h
    old = started(h)
    for version in ("v2", "v3"):
        h.signal(signal.SIGHUP)
        h.step()
        r.ready(version)
        h.step()
        if version == "v2":
            roll_to_the_end(r, old)
    previous, serving = r.templates
    h.os.exits.append((previous.pid, 9))
    h.step()
    h.os.exits.append((serving.pid, 9))
    h.step()
    assert r.code().generation == 0 and r.code().state == "failed"
    for pid in r.stop_orders():  # the rollout replaces every slot with the master's code
        h.exit(pid, 0)
    h.step(1.0)
    assert h.os.forks[-1] not in previous.forked + serving.forked  # the master forks


def test_a_new_slot_that_dies_after_its_queue_booted_is_only_restarted(
    r: Reloading
) -> None:
    h = r.h
    r.rolling()
    [new] = r.template.forked
    h.hello(new)
    h.step()
    h.exit(new, 70)
    h.step()
    assert r.code().state == "rolling" and not r.template.ended


def test_a_new_slots_hello_retires_an_old_one_in_the_same_pass(r: Reloading) -> None:
    h = r.h
    r.rolling()
    [new] = r.template.forked
    h.step(0.2)  # no tick due: a pass that only reads messages decides nothing
    h.hello(new)
    h.step()  # the hello alone: decided at once, not at the next tick
    assert len(r.stop_orders()) == 1


def test_after_an_abort_the_rollback_retires_at_each_hello(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    for h in harness(monkeypatch, make_app(Q, "b"), {Q: 1, "b": 1}):
        r = Reloading(h)
        started(h)
        h.signal(signal.SIGHUP)
        h.step()
        r.ready()
        r.template.answer = Ready(version="v2", queues={q: QueuePolicy.model_validate({})
                                                        for q in (Q, "b")})
        h.step()
        [new_b] = r.template.forked  # queues in name order: b first
        h.hello(new_b)
        h.step()
        [old_b] = r.stop_orders()
        h.exit(old_b, 0)
        h.step()
        new_q = r.template.forked[-1]
        h.exit(new_q, exitcodes.BOOT_ERROR)  # the new code cannot run queue Q: abort
        h.step()
        assert r.code().state == "failed" and r.code().old_slots == 1  # new_b is old now
        h.step(0.6)  # (the boot error's backoff)
        back = h.os.forks[-1]  # forked by the master again: the previous code
        assert back not in r.template.forked
        h.step(0.2)
        h.hello(back)
        h.step()
        assert r.stop_orders() == [new_b]


def test_pausing_a_queue_while_its_first_new_slot_boots_does_not_abort(
    r: Reloading
) -> None:
    """Review finding 6: the rollout stops a new slot that is still booting (the queue
    was paused); SIGTERM's default action ends it (-15) before its handler is installed.
    That was a crash: restart counted, backoff, and the good reload aborted."""
    h = r.h
    old = r.rolling()
    [new] = r.template.forked
    h.sup.set_row({Q: 0})  # paused by the manager
    h.step()
    assert set(r.stop_orders()) == {*old, new}
    h.os.end(new, signal.SIGTERM)  # wait status: killed by SIGTERM
    for pid in old:
        h.exit(pid, 0)
    h.step()
    info = r.code()
    assert info.state == "idle" and info.error == "" and info.generation == 1
    assert h.restarts() == {} and h.sup.snapshot.reloads == {"took": 1, "failed": 0}
    assert not r.template.ended

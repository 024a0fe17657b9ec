"""Rolling code reload, the master's side: which code new slots are forked from and the
template processes behind it (:class:`CodeSources`), and the reload's state machine
(:class:`Reloader`, reported as ``messages.CodeInfo``).

::

    idle/failed --SIGHUP or a new reload_id--> loading --template ready--> rolling
                                                  |                           |
          import error, template exit, timeout    |  a queue's first new slot | no old
                                                  v  dies before its hello,   v slot left
                                                failed <--- its template dies-+  idle

* loading: a fresh template process (master/template.py) imports the app anew; the
  slots keep being forked from the current code meanwhile;
* rolling: the template answered ready: every fork goes through it (new generation), and
  the supervisor's decide step runs master/rollout.py until no older slot is left; then
  the previous template is ended and the reload took;
* failed: the new code is dropped (its template ended); when it failed during rolling,
  forks go back to the previous code and the rollout replaces the new slots with it.

A serving template that dies starts no reload: forks go back to the previous code while
rolling (as an abort does), else to the master's own code, whose slots serve on beside
the dead template's (``CodeSources.serving_died``).

A new request while loading starts over with a fresh template (the newest code); while
rolling, a new template is started and, once ready, replaces the rolling one (every slot
not of the newest code is replaced).
"""


from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from qcluster.master.pool import SlotPool
from qcluster.master.slots import RestartReason, SlotRecord
from qcluster.master.template import (
    EXITED_EARLY,
    Failed,
    Ready,
    Template,
    TemplateHandle,
    TemplateSpec,
)
from qcluster.messages import MAX_SLOTS, CodeInfo, ReloadState
from qcluster.policy import QueuePolicy

logger = logging.getLogger("qcluster.master.reload")

#: Seconds a template has to import the app and answer.
RELOAD_TIMEOUT_S = 60.0
RELOAD_RESULTS = ("took", "failed")


@dataclass
class CodeSource:
    """Code slots are forked from: the master's own (generation 0) or a template's."""

    generation: int
    version: str
    policies: dict[str, QueuePolicy]
    template: Template | None = None


class ReloadRequests:
    """The manager's ``Assignment.reload_id``s, handed over by the reporter thread (a
    deque: appends are atomic). The first one a master sees is recorded, not acted on:
    the master started on the newest code. Later, an id that differs is a request; ""
    (a restarted manager forgot its ids) never is."""

    def __init__(self) -> None:
        self.last = ""
        """The last id recorded or acted on (reported as CodeInfo.reload_id)."""
        self._offered: deque[str] = deque()
        self._seen_one = False

    def offer(self, reload_id: str) -> None:
        self._offered.append(reload_id)

    def new(self) -> list[str]:
        """Ids to act on now (the newest wins: each one starts over)."""
        requested: list[str] = []
        while self._offered:
            reload_id = self._offered.popleft()
            if not self._seen_one:
                self._seen_one, self.last = True, reload_id
            elif reload_id and reload_id != self.last:
                self.last = reload_id
                requested = [reload_id]
        return requested


class CodeSources:
    """The code new slots are forked from and the template processes behind it: what
    serves, what it replaces while rolling, a template still importing. The pool forks
    from ``serving``; every template's socket is watched until it answers or ends."""

    def __init__(self, pool: SlotPool, base: CodeSource) -> None:
        self.pool = pool
        self.base = base
        """The master's own code: forked from when no template is left to fork from."""
        self.serving = base
        """Where new slots come from (the newest code once its template is ready)."""
        self.previous: CodeSource | None = None
        """What ``serving`` replaces while rolling (an abort goes back to it)."""
        self.loading: Template | None = None
        self.next_generation = base.generation + 1

    def policies(self) -> dict[str, QueuePolicy]:
        """Every queue a live slot may run, the newest code's policy first."""
        previous = self.previous  # one read: the reporter thread calls this
        older = previous.policies if previous else {}
        return {**older, **self.serving.policies}

    def templates(self) -> list[Template]:
        """The template processes there are: loading, serving, previous."""
        previous = self.previous.template if self.previous else None
        return [h for h in (self.loading, self.serving.template, previous) if h is not None]

    def load(self, template: Template) -> None:
        self.loading = template
        self.pool.channels.watch(template.sock)

    def drop_loading(self) -> None:
        if self.loading is not None:
            self.end(self.loading)
            self.loading = None

    def promote(self, ready: Ready) -> CodeSource:
        """The loading template is ready: new slots come from it. What served becomes
        ``previous`` (a rolling reload this one supersedes is ended instead)."""
        assert self.loading is not None
        self.pool.channels.unwatch(self.loading.sock)  # its replies are read where asked for
        source = CodeSource(self.next_generation, ready.version, ready.queues, self.loading)
        self.next_generation += 1
        self.loading = None
        if self.previous is None:
            self.previous = self.serving
        else:
            self.end_source(self.serving)  # a rolling reload superseded by this one
        self.serve(source)
        return source

    def fall_back(self) -> CodeSource:
        """Fork from the previous code again (the master's own when the previous template
        is gone too) and end the new code's template; returns what serves now."""
        failed, back, self.previous = self.serving, self.previous, None
        if back is None or not _alive(back):
            back = self.base
        self.serve(back)
        self.end_source(failed)
        return back

    def serving_died(self, pid: int, code: int) -> str:
        """The serving template died: fork from the previous code while rolling (the
        rollout then replaces the new slots), else from the master's own code; the dead
        template's slots serve on (the rollout leaves them alone). Returns the error."""
        dead = back = self.serving
        if self.previous is not None:
            back = self.fall_back()
        else:
            self.end_source(dead)
            self.serve(back := self.base)
            self.pool.serving_generations.add(dead.generation)
        return (f"the template of version {dead.version} (pid {pid}) exited with code "
                f"{code}: new slots are forked from version {back.version} (generation "
                f"{back.generation}) until the next reload")

    def retire_previous(self) -> None:
        if self.previous is not None:
            self.end_source(self.previous)
            self.previous = None

    def serve(self, source: CodeSource) -> None:
        self.serving = source
        self.pool.template, self.pool.generation = source.template, source.generation
        self.pool.serving_generations = {source.generation}

    def end_source(self, source: CodeSource) -> None:
        if source.template is not None:
            self.end(source.template)

    def end(self, handle: Template) -> None:
        self.pool.channels.unwatch(handle.sock)
        handle.end()

    def end_all(self) -> None:
        for handle in self.templates():
            self.end(handle)
        self.loading = None

    def mark_reaped(self, pid: int) -> None:
        """A template ended: it is never signalled again (its pid is free for another
        process now)."""
        for handle in self.templates():
            if handle.pid == pid:
                handle.reaped = True


class Reloader:
    """The reload state machine; the supervisor's loop drives it (one thread)."""

    def __init__(self, pool: SlotPool, base: CodeSource, spec: TemplateSpec,
                 row: Callable[[], list[str]], *,
                 spawn: Callable[[TemplateSpec], Template] = TemplateHandle,
                 timeout_s: float = RELOAD_TIMEOUT_S) -> None:
        self.pool, self.spawn = pool, spawn
        self._spec, self._row = spec, row
        """What a template is told (the row's queues and this pid filled in at spawn)."""
        self.timeout_s = timeout_s
        self.code = CodeSources(pool, base)
        self._loading_since = 0.0
        self.state: ReloadState = "idle"
        self.error = ""
        self.old_slots = 0
        self.results = dict.fromkeys(RELOAD_RESULTS, 0)
        self._booted: set[str] = set()
        self._hello_seen = False
        """A slot said hello: decide now (during a rollout an old slot may retire; hellos
        are rare, unlike the per-batch messages a pass applies without deciding)."""
        self.requests = ReloadRequests()
        pool.on_hello, pool.on_ended = self._on_hello, self._on_ended
        pool.on_other_child = self._on_other_child

    def offer_reload_id(self, reload_id: str) -> None:
        """From the reporter thread: the manager's Assignment.reload_id."""
        self.requests.offer(reload_id)

    def start(self, why: str, now: float) -> None:
        """Import the newest code in a fresh template (a loading one is ended first)."""
        self.code.drop_loading()
        spec = self._spec.model_copy(update={"row": self._row(), "master_pid": os.getpid(),
                                             "generation": self.code.next_generation})
        self.state = "loading"
        try:
            template = self.spawn(spec)
        except OSError as exc:  # no process, no memory, no descriptor left
            self._fail(f"cannot start a template process: {exc}")
            return
        self.code.load(template)
        self._loading_since = now
        self.error = ""
        logger.info("reload started (%s): importing the app anew in template pid %d",
                    why, template.pid)

    def observe(self, now: float) -> bool:
        """Requests from the manager, the template's answer or its timeout; True when the
        decide step should run."""
        changed = self._hello_seen
        for reload_id in self.requests.new():
            self.start(f"manager request {reload_id}", now)
            changed = True
        self._hello_seen = False
        if self.code.loading is None:
            return changed
        answer = self.code.loading.poll()
        if isinstance(answer, Ready):
            self._roll(answer)
        elif isinstance(answer, Failed):
            self._fail(answer.error)
        elif now - self._loading_since > self.timeout_s:
            self._fail(f"the template did not answer within {self.timeout_s:g} s")
        else:
            return changed
        return True

    def after_pass(self) -> None:
        """After the decide step: the rollout is over once no older slot is left."""
        serving = self.code.serving
        old_slots = sum(1 for s in self.pool.slots.values() if not self.pool.is_current(s))
        self.old_slots = old_slots
        if self.code.previous is None or old_slots:
            return
        self.code.retire_previous()
        if self.state == "rolling":  # (not when a newer request is loading meanwhile)
            self.state = "idle"
        self.results["took"] += 1
        logger.info("reload took: every slot runs version %s (generation %d)",
                    serving.version, serving.generation)

    def info(self) -> CodeInfo:
        return CodeInfo(version=self.code.serving.version,
                        generation=self.code.serving.generation,
                        state=self.state, error=self.error[:2000],
                        reload_id=self.requests.last[:64],
                        old_slots=min(self.old_slots, MAX_SLOTS))

    def shutdown(self) -> None:
        """The master stops: end every template (slots are the master's own children)."""
        self.code.end_all()

    # --- transitions -----------------------------------------------------------------

    def _roll(self, ready: Ready) -> None:
        source = self.code.promote(ready)
        self.state, self._booted = "rolling", set()
        logger.info("reload: version %s (generation %d) ready in template pid %d: replacing "
                    "the slots a few at a time", ready.version, source.generation,
                    source.template.pid if source.template else os.getpid())

    def _fail(self, error: str) -> None:
        self.code.drop_loading()
        self.state, self.error = "failed", error
        self.results["failed"] += 1
        logger.error("reload failed, the old code keeps serving: %s", error)

    def _abort(self, error: str) -> None:
        """The new code cannot run: fork from the previous code again (the rollout then
        replaces the new slots with it)."""
        self.code.fall_back()
        self._fail(error)

    # --- the pool's hooks ------------------------------------------------------------

    def _on_hello(self, slot: SlotRecord) -> None:
        if slot.generation == self.code.serving.generation:
            self._booted.add(slot.queue)
        self._hello_seen = True  # during a rollout, an old slot may retire now

    def _on_ended(self, slot: SlotRecord, reason: RestartReason | None, code: int) -> None:
        """A new slot that dies before any slot of its queue on the new code said hello
        (a boot error, a crash, killed as hung or for memory) aborts the reload: the
        rollout would wait for that hello forever while the old slots serve. Not one
        told to stop (a queue paused or scaled down meanwhile): it was not needed."""
        serving = self.code.serving
        if (self.state == "rolling" and reason is not None and not slot.stopping
                and slot.generation == serving.generation and slot.queue not in self._booted):
            self._abort(f"the first slot of queue {slot.queue} on version "
                        f"{serving.version} could not start ({reason}, exit code "
                        f"{code}; its error is in the master's log)")

    def _on_other_child(self, pid: int, code: int) -> None:
        """A child that is no slot ended: a template, or an orphan adopted as subreaper
        (ignored)."""
        self.code.mark_reaped(pid)
        loading, serving = self.code.loading, self.code.serving
        if loading is not None and pid == loading.pid and not loading.answer:
            self._fail(exit_error(loading, code))  # (reaped before its answer was read)
        elif (serving.template is not None and pid == serving.template.pid
                and not serving.template.ended):
            self._serving_died(pid, code)

    def _serving_died(self, pid: int, code: int) -> None:
        """No reload nobody asked for (the code on disk may be broken): new slots come
        from older code still alive; the slots already forked serve on."""
        error = self.code.serving_died(pid, code)
        if self.state == "rolling":
            self._fail(error)  # the rollout goes back to the older code
        else:
            self.error = error
            logger.error("%s", error)


def exit_error(loading: Template, code: int) -> str:
    """Why a template that exited before its answer was read failed: its own answer
    (an import error it sent first) when there is one, else its exit."""
    answer = loading.poll()
    if isinstance(answer, Failed) and answer.error != EXITED_EARLY:
        return answer.error
    when = "after it answered" if isinstance(answer, Ready) else "before it answered"
    return f"the template exited with code {code} {when}"


def _alive(source: CodeSource) -> bool:
    """Slots can be forked from it: the master's own code, or a template not ended."""
    return source.template is None or not (source.template.ended or source.template.reaped)

"""Rolling code reload across hosts, one host at a time: pure (no clock, no lock, no I/O).

A *rollout* is an ordered list of hosts to reload (one host for ``POST
/api/v1/hosts/{h}/reload``, every live host by name for ``POST /api/v1/reload``). The manager
asks a host by sending it a new ``Assignment.reload_id``; the host's master reports the id it
acted on and its reload state in ``HostReport.code``. :func:`advance` takes the rollout and
what the hosts last reported, and says what happens next:

* the host asked shows ``code.reload_id == its id`` and state ``idle``: it **took** the new
  code; the next host is asked;
* it shows ``failed``: the rollout **stops** (the remaining hosts keep the old code);
* it stopped reporting, or did not show the id within ``take_up_s`` of being asked (a master
  without reload, or one that restarted and never saw it): **skipped**, with the reason; the
  next host is asked;
* a host whose turn comes while it is not reporting is skipped the same way.

So at most one host of a rollout is reloading at any time. The service's reload driver
(``manager/reloads/driver.py``) calls :func:`advance` at every planning round and when a
rollout starts, sends each host its id from :attr:`ReloadBook.ids`, and logs the reasons
as decisions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from qcluster.messages import CodeInfo

#: Seconds a host has to show the id it was sent before it is skipped, at least (a few report
#: intervals: the id goes out with its next reply, the answer comes with the report after).
TAKE_UP_S = 30.0
#: ... and at least this many report intervals (masters report every [manager] interval_s,
#: up to 60 s: a fixed 30 s skipped every host of a 40 s cluster, which then reloaded anyway).
TAKE_UP_INTERVALS = 3


def take_up_s(report_interval_s: float) -> float:
    """How long a host asked to reload has to show the id before it is skipped."""
    return max(TAKE_UP_S, TAKE_UP_INTERVALS * report_interval_s)

StepState = Literal["waiting", "asked", "took", "failed", "skipped"]
RolloutState = Literal["running", "done", "stopped"]


@dataclass(frozen=True)
class Step:
    """One host of a rollout."""

    host: str
    state: StepState = "waiting"
    reload_id: str = ""
    """The id sent to the host (empty until it is asked)."""
    asked_at: float | None = None
    ended_at: float | None = None
    version_before: str = ""
    note: str = ""
    """What happened: 'version a -> b, generation 1', the error, or why it was skipped."""


@dataclass(frozen=True)
class Rollout:
    id: str
    by: str
    """The name of the token that asked for it."""
    started_at: float
    steps: tuple[Step, ...]
    state: RolloutState = "running"
    ended_at: float | None = None
    note: str = ""
    """Why it stopped, or its summary once done."""

    @property
    def running(self) -> bool:
        return self.state == "running"

    def view(self) -> dict[str, Any]:
        """The JSON ``GET /api/v1/cluster`` shows as ``reload`` (and the admin page reads)."""
        return {
            "id": self.id, "by": self.by, "state": self.state, "started_at": self.started_at,
            "ended_at": self.ended_at, "note": self.note,
            "hosts": [{"host": s.host, "state": s.state, "reload_id": s.reload_id,
                       "asked_at": s.asked_at, "ended_at": s.ended_at, "note": s.note}
                      for s in self.steps],
        }


@dataclass(frozen=True)
class HostSeen:
    """A host as its last report shows it."""

    reporting: bool
    """Its last report is recent (the manager's host expiry; drained hosts count)."""
    code: CodeInfo = field(default_factory=CodeInfo)


@dataclass(frozen=True)
class Advanced:
    rollout: Rollout
    asks: tuple[tuple[str, str], ...] = ()
    """(host, reload id) to send from now on."""
    reasons: tuple[str, ...] = ()
    """What happened, in order, for the decision log."""


@dataclass
class ReloadBook:
    """The manager's reload memory: the id each host is sent and the current (or last)
    rollout. Forgotten on a restart: every host is then sent "" (nothing to do)."""

    ids: dict[str, str] = field(default_factory=dict)
    rollout: Rollout | None = None


def start(rollout_id: str, by: str, hosts: list[str], now: float) -> Rollout:
    """A rollout over ``hosts`` in the order given, nobody asked yet (:func:`advance` asks)."""
    return Rollout(id=rollout_id, by=by, started_at=now,
                   steps=tuple(Step(host=host) for host in hosts))


def advance(rollout: Rollout, hosts: Mapping[str, HostSeen], now: float,
            take_up_s: float = TAKE_UP_S) -> Advanced:
    """The rollout after what ``hosts`` report at ``now``: the step asked ends or waits; once
    it ended, the next waiting host is asked (or skipped), until one is waiting on or none is
    left."""
    if not rollout.running:
        return Advanced(rollout)
    steps = list(rollout.steps)
    asks: list[tuple[str, str]] = []
    reasons: list[str] = []
    for index, step in enumerate(steps):
        if step.state == "asked":
            steps[index] = _follow(step, hosts.get(step.host), now, take_up_s)
            if steps[index].state == "asked":
                return Advanced(replace(rollout, steps=tuple(steps)), (), ())
            if steps[index].state == "skipped":
                asks.append((step.host, ""))  # withdrawn: a late master must not reload now
            reasons.append(_reason(steps[index]))
            if steps[index].state == "failed":
                note = f"reload stopped: {step.host} failed: {steps[index].note}{_left(steps)}"
                reasons.append(note)
                return Advanced(replace(rollout, steps=tuple(steps), state="stopped",
                                        ended_at=now, note=note), tuple(asks), tuple(reasons))
        elif step.state == "waiting":
            seen = hosts.get(step.host)
            if seen is None or not seen.reporting:
                steps[index] = replace(step, state="skipped", ended_at=now,
                                       note="not reporting when its turn came")
                reasons.append(_reason(steps[index]))
                continue
            reload_id = f"{rollout.id}-{index + 1}"
            steps[index] = replace(step, state="asked", reload_id=reload_id, asked_at=now,
                                   version_before=seen.code.version)
            asks.append((step.host, reload_id))
            reasons.append(_reason(steps[index]))
            return Advanced(replace(rollout, steps=tuple(steps)), tuple(asks), tuple(reasons))
    note = _summary(steps)
    reasons.append(note)
    return Advanced(replace(rollout, steps=tuple(steps), state="done", ended_at=now, note=note),
                    tuple(asks), tuple(reasons))


def _follow(step: Step, seen: HostSeen | None, now: float, take_up_s: float) -> Step:
    """The asked step after the host's last report: still asked, took, failed or skipped."""
    if seen is None or not seen.reporting:
        return replace(step, state="skipped", ended_at=now, note="stopped reporting")
    code = seen.code
    if code.reload_id == step.reload_id:
        if code.state == "idle":
            return replace(step, state="took", ended_at=now,
                           note=f"version {step.version_before or '?'} -> "
                                f"{code.version or '?'}, generation {code.generation}")
        if code.state == "failed":
            return replace(step, state="failed", ended_at=now,
                           note=code.error or "no error given")
        return step  # loading or rolling: wait as long as it reports
    asked_at = step.asked_at if step.asked_at is not None else now
    if now - asked_at > take_up_s:
        return replace(step, state="skipped", ended_at=now,
                       note=f"did not take up the reload within {take_up_s:.0f} s "
                            "(a master without reload, or one that restarted)")
    return step


def _reason(step: Step) -> str:
    if step.state == "asked":
        return f"reload {step.host}: asked"
    return f"reload {step.host}: {step.state}, {step.note}"


def _left(steps: list[Step]) -> str:
    waiting = [s.host for s in steps if s.state == "waiting"]
    return f"; not asked, still on the old code: {', '.join(waiting)}" if waiting else ""


def _summary(steps: list[Step]) -> str:
    took = sum(s.state == "took" for s in steps)
    skipped = [s.host for s in steps if s.state == "skipped"]
    text = f"reload done: {took} of {len(steps)} host(s) took the new code"
    return text + (f", skipped: {', '.join(skipped)}" if skipped else "")

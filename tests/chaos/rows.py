"""One chaos row's result: the issue's JSON line, printed and (under ``make chaos``) kept.

``emit(result)`` prints the line and, when ``QC_CHAOS_RESULTS=1``, appends it to
``tests/chaos/results/latest.jsonl`` (``tests/chaos/report.py`` turns that file into the
Markdown table). A row's fault schedule comes from its seed (``--chaos-seed`` or
``QC_CHAOS_SEED``; random otherwise, and always printed): rerun with the same seed to
replay a failure's schedule.

Profiles: ``QC_CHAOS_PROFILE=short`` (the default, inside ``make test``: a few faults per
row) or ``full`` (``make chaos``: the issue's periods and counts). The thresholds are the
same in both.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos.ledger import LedgerReport

RESULTS_DIR = Path(__file__).resolve().parent / "results"
LATEST = RESULTS_DIR / "latest.jsonl"
PROFILE_ENV = "QC_CHAOS_PROFILE"
RESULTS_ENV = "QC_CHAOS_RESULTS"
SEED_ENV = "QC_CHAOS_SEED"
RUN_ENV = "QC_CHAOS_RUN"
#: Which run a line comes from (latest.jsonl may merge a row re-run alone into a whole run):
#: ``QC_CHAOS_RUN`` if set, else this session's start (UTC).
RUN = os.environ.get(RUN_ENV, "") or time.strftime("pytest %Y-%m-%dT%H:%MZ", time.gmtime())

#: Every row result printed in this session (for the terminal summary).
EMITTED: list[RowResult] = []


def profile() -> str:
    return "full" if os.environ.get(PROFILE_ENV, "short").strip().lower() == "full" else "short"


def full() -> bool:
    return profile() == "full"


def by_profile(short: Any, full_value: Any) -> Any:
    """``short`` under make test, ``full_value`` under make chaos."""
    return full_value if full() else short


def new_seed(option: str | int | None = None) -> int:
    """The seed given (option, else ``QC_CHAOS_SEED``), else a random one."""
    given = option if option not in (None, "") else os.environ.get(SEED_ENV, "")
    if given not in (None, ""):
        return int(str(given))
    return random.SystemRandom().randrange(1, 10**9)


@dataclass
class RowResult:
    """The issue's fields, in its order."""

    row: str
    broker: str
    seed: int
    attempted: int = 0
    acknowledged: int = 0
    completed: int = 0
    lost: int = 0
    unexpected: int = 0
    dup_exec: int = 0
    dead: int = 0
    faults: int = 0
    recovery_p99_s: float | None = None
    throughput_jobs_s: float | None = None
    p99_latency_s: float | None = None
    residue: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    #: Not part of the JSON line's fixed fields: row-specific figures and the profile,
    #: printed after them under "extra" (the report shows them as notes).
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_report(cls, row: str, broker: str, seed: int, report: LedgerReport, *,
                    faults: int, residue: dict[str, int], wall_s: float,
                    **extra: Any) -> RowResult:
        return cls(row=row, broker=broker, seed=seed, attempted=report.attempted,
                   acknowledged=report.acknowledged, completed=report.completed,
                   lost=report.lost, unexpected=report.unexpected, dup_exec=report.dup_exec,
                   dead=report.dead, faults=faults, recovery_p99_s=report.recovery_p99_s,
                   throughput_jobs_s=report.throughput_jobs_s,
                   p99_latency_s=report.p99_latency_s, residue=dict(residue),
                   wall_s=round(wall_s, 2), extra=dict(extra))

    @property
    def residue_total(self) -> int:
        return sum(self.residue.values())

    def line(self) -> str:
        data = asdict(self)
        extra = data.pop("extra")
        data["profile"] = profile()
        data["run"] = RUN
        if extra:
            data["extra"] = extra
        return json.dumps(data, separators=(", ", ": "), default=str)


def emit(result: RowResult) -> str:
    """Print the row's JSON line (captured with the test's output, and repeated in the
    session's terminal summary by tests/chaos/conftest.py) and keep it in latest.jsonl
    under ``QC_CHAOS_RESULTS=1``; returns the line."""
    text = result.line()
    EMITTED.append(result)
    print(f"CHAOS {text}")
    if os.environ.get(RESULTS_ENV, "") == "1":
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        with LATEST.open("a") as out:
            out.write(text + "\n")
    return text

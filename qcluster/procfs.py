"""Process memory from /proc: a thin reader and a pure parser.

PSS (proportional set size) divides each shared page among the processes that map
it, so summing PSS over a master and its forked slots gives the real memory they
use; RSS would count the copy-on-write shared image once per slot. Private_Dirty is
what a slot has written on its own: the part that grows when a handler leaks.
``smaps_rollup`` (Linux 4.14+) gives the totals in one small read; ``smaps`` is the
slow fallback (one entry per mapping).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

_FIELDS = {
    "Rss:": "rss_bytes",
    "Pss:": "pss_bytes",
    "Private_Clean:": "private_clean_bytes",
    "Private_Dirty:": "private_dirty_bytes",
    "Swap:": "swap_bytes",
}


@dataclass(frozen=True, slots=True)
class MemorySample:
    rss_bytes: int = 0
    pss_bytes: int = 0
    private_clean_bytes: int = 0
    private_dirty_bytes: int = 0
    swap_bytes: int = 0

    @property
    def uss_bytes(self) -> int:
        """Unique set size: memory freed if the process exited."""
        return self.private_clean_bytes + self.private_dirty_bytes


def parse_smaps(text: str) -> MemorySample:
    """Sum the fields of ``smaps_rollup`` (one block) or ``smaps`` (many blocks)."""
    totals = dict.fromkeys(_FIELDS.values(), 0)
    for line in text.splitlines():
        key, _, rest = line.partition(" ")
        name = _FIELDS.get(key)
        if name is not None:
            totals[name] += int(rest.split()[0]) * 1024  # values are in kB
    return MemorySample(**totals)


def read_memory(pid: int | str = "self") -> MemorySample | None:
    """Memory of ``pid``; None if the process is gone or not readable."""
    for name in ("smaps_rollup", "smaps"):
        try:
            with open(f"/proc/{pid}/{name}") as file:
                return parse_smaps(file.read())
        except FileNotFoundError:
            if name == "smaps" or not _process_exists(pid):
                return None
        except (ProcessLookupError, PermissionError):
            return None
    return None


def _process_exists(pid: int | str) -> bool:
    try:
        with open(f"/proc/{pid}/stat"):
            return True
    except OSError:
        return False


def total_pss_bytes(master_pss_bytes: int, slot_pss_bytes: Iterable[int]) -> int:
    """What a master and its slots use together: their PSS summed (each shared page is
    divided among the processes mapping it, so nothing is counted twice). The one place
    the host's total is computed (capacity, /metrics, /api/v1/host, the host report)."""
    return master_pss_bytes + sum(slot_pss_bytes)

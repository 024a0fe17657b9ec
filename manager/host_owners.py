"""Which master reports under each host name.

Two masters under one name (two machines with one hostname, two containers on the host's
network, a copied unit without ``--host-name``) would overwrite each other's reports every
few seconds, and the manager would plan one host from two alternating pictures. Each
master names itself in its reports (``HostReport.master``: its PID, machine and start);
the newest master of a name holds it, as a restarted master does, and one it replaced that
still reports is a second master: its reports are refused (409) with the other one named.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

#: A replaced master's id is remembered this long (a second master reports every few
#: seconds; a restarted master's predecessor never again).
FORGET_S = 600.0


@dataclass
class _Holder:
    master: str
    last_at: float
    replaced: dict[str, float] = field(default_factory=dict)
    """The ids this name had before, with when a newer master took it over."""


class HostOwners:
    """The master holding each host name. Thread-safe: reports are read on the event loop
    and in the pool's threads."""

    def __init__(self) -> None:
        self._names: dict[str, _Holder] = {}
        self._lock = threading.Lock()

    def refusal(self, host: str, master: str, now: float, stale_s: float) -> str | None:
        """None when ``master`` may report as ``host``; else why not, in one line. A holder
        silent for ``stale_s`` (its host expired) gives the name back to whoever reports."""
        if not master:
            return None  # an older master names no one: nothing to compare
        with self._lock:
            holder = self._names.get(host)
            if holder is None:
                self._names[host] = _Holder(master, now)
                return None
            if master == holder.master:
                holder.last_at = now
                return None
            since = holder.replaced.get(master)
            if since is None or now - holder.last_at > stale_s:
                self._take_over(holder, master, now)
                return None
            if now - since <= stale_s and holder.last_at <= since:
                return None  # its report was in flight when the new one took over
            return (f"host name {host!r} is reported by two masters: {holder.master} "
                    f"holds it, and this one is {master}; give each master its own "
                    "--host-name")

    def forget(self, host: str) -> None:
        """A master that left: whoever reports the name next holds it."""
        with self._lock:
            self._names.pop(host, None)

    @staticmethod
    def _take_over(holder: _Holder, master: str, now: float) -> None:
        holder.replaced = {m: at for m, at in holder.replaced.items()
                           if now - at <= FORGET_S and m != master}
        holder.replaced[holder.master] = now
        holder.master, holder.last_at = master, now

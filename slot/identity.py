"""Who this process is: its host's name, its code generation, its process title.

Set by the master (and a reload template) before it forks; a forked slot inherits them.
The title is what ``ps`` and ``top`` show (``qcluster slot emails (host-a, gen 2)``),
set with setproctitle; the short kernel name (``qc-slot``, ``/proc/PID/comm``) is set
apart, by the master's fork path.
"""

from __future__ import annotations

import contextlib
import socket

host = socket.gethostname()
"""The host's name as the manager knows it (``--host-name``; default the machine's)."""
generation = 0
"""The code generation slots are forked from: 0 the master's own import, 1, 2... each
reload's template."""


def set_identity(host_name: str, code_generation: int = 0) -> None:
    global host, generation
    host, generation = host_name or host, code_generation


def set_title(role: str, detail: str = "", *, with_generation: bool = True) -> None:
    """``qcluster ROLE [DETAIL] (HOST, gen N)`` as this process's title (no-op when
    setproctitle cannot be imported). A master's title names no generation: it serves
    several in turn."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # pragma: no cover - a declared dependency
        return
    what = f"{role} {detail}" if detail else role
    comm = _comm()
    gen = f", gen {generation}" if with_generation else ""
    setproctitle(f"qcluster {what} ({host}{gen})")
    if comm:  # setproctitle renames /proc/PID/comm too: keep the short name (qc-slot)
        _set_comm(comm)


def _comm() -> str:
    try:
        with open("/proc/self/comm", "rb") as file:
            return file.read().strip().decode(errors="replace")
    except OSError:
        return ""


def _set_comm(name: str) -> None:
    with contextlib.suppress(OSError), open("/proc/self/comm", "wb") as file:
        file.write(name.encode()[:15])

"""Process faults for the process-fault chaos rows (tests/chaos/test_process_faults.py):
what is killed and how its end is seen, orphans, embedded servers, libfaketime.

Everything here reads /proc: a killed master's slots are no children of the test, so they
are found by their session (a master is started in a session of its own and its slots
inherit it), and their end is seen through a pidfd, which works for any process.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from pathlib import Path

#: Where Debian's ``faketime`` package puts libfaketime (row F12).
FAKETIME_DIR = Path("/usr/lib/x86_64-linux-gnu/faketime")


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name: state, ppid, pgrp, session, ..."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a master started with start_new_session=True and
    every slot it forked, whoever their parent is now)."""
    members = []
    for pid in _pids():
        fields = _stat_fields(pid)
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[3]) == sid:
            members.append(pid)
    return members


def wait_exit(pid: int, timeout_s: float) -> float | None:
    """Block until ``pid`` ends (any process: pidfd, not waitpid); the monotonic time it was
    seen to end, or None if it still runs after ``timeout_s``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return time.monotonic()
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if poller.poll(min(left, 1.0) * 1000):
                return time.monotonic()
    finally:
        os.close(fd)


def stop_process(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)


def kill_session(sid: int) -> None:
    """SIGKILL whatever is left of a session (cleanup after a row)."""
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def redis_servers(data_dir: Path) -> list[int]:
    """PIDs of the redis-servers serving ``data_dir``: a redis-server chdirs to its ``--dir``,
    so its cwd names the data directory it writes."""
    target = data_dir.resolve()
    found = []
    for pid in _pids():
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if (os.path.basename(exe).startswith("redis-server") and Path(cwd) == target
                and alive(pid)):
            found.append(pid)
    return found


def faketime_library() -> Path | None:
    """libfaketime's shared object, or None when the ``faketime`` package is missing."""
    for name in ("libfaketime.so.1", "libfaketimeMT.so.1"):
        path = FAKETIME_DIR / name
        if path.exists():
            return path
    return None


#: libfaketime 0.9.10 (Debian bookworm) with FAKETIME_DONT_FAKE_MONOTONIC breaks Python
#: 3.11's time.sleep, which sleeps with clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME):
#: libfaketime hands the kernel a negative time and sleep raises EINVAL (libfaketime issue
#: #426; with the monotonic clock faked too, sleep never returns). Every other wait (select,
#: poll, locks, events, queues) works, so the skewed processes get this sitecustomize: the
#: same sleep through select(), which libfaketime leaves alone.
SLEEP_WORKAROUND = '''\
import select
import time


def _sleep(seconds):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        select.select([], [], [], left)


time.sleep = _sleep
'''


def faketime_env(library: str | Path, skew_h: int, workdir: Path,
                 pythonpath: str) -> dict[str, str]:
    """Environment of a process whose wall clock is ``skew_h`` hours off (its monotonic
    clock is left alone: deadlines and the ledger's times stay comparable)."""
    site = workdir / "faketime-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SLEEP_WORKAROUND)
    return {"LD_PRELOAD": str(library), "FAKETIME": f"{skew_h:+d}h",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(site), pythonpath]))}

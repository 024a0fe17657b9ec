"""Running one test body in several threads at once, for the tests of what a shared object
or a shared broker does under concurrent callers."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_threads(body: Callable[[], object], count: int,
                   timeout_s: float) -> list[BaseException]:
    """``body`` run by ``count`` threads at once, each joined within ``timeout_s``; what
    they raised (a test asserts it is empty, in its own thread, where pytest sees it)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as exc:  # returned to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    errors.extend(TimeoutError(f"{thread.name} still runs after {timeout_s} s")
                  for thread in threads if thread.is_alive())
    return errors

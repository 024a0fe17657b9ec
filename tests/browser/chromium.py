"""A real headless Chromium (Debian's package), driven by Playwright; never a downloaded browser.

The fixtures are registered once, by the root conftest (tests/conftest.py), so the browser
tests and the end-to-end tests that open a page share one session's Chromium: two
Playwright sessions cannot run in one thread.

Playwright's sync API runs its event loop in a greenlet of the calling thread, and marks
that loop running in the thread for as long as the Playwright session lives. One session
for the whole test session would leave it marked in the worker's main thread after the
first test that opens a page, and every later test there that runs an event loop of its own
(``asyncio.run``, a slot's ``asyncio.Runner``) would fail: "cannot be called from a running
event loop". So the loop is marked running only during a test that asks for ``browser`` or
``page`` (:meth:`Chromium.lent`).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect

CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]
# The repository's root, not tests.conftest's ROOT: that conftest imports this module.
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"

PAGE_WAIT_MS = 15_000
"""How long an ``expect()`` waits unless its test gives its own timeout:
a page that refreshes every 2 s, served by a manager on a loaded 2-core CI machine, can
take a few refreshes to show a change (Playwright's own default is 5 s)."""


@dataclass(frozen=True)
class Chromium:
    """The session's Chromium and the event loop of its Playwright session."""

    browser: Browser
    loop: asyncio.AbstractEventLoop

    @contextmanager
    def lent(self) -> Iterator[Browser]:
        """The browser, for one test: Playwright's loop marked running in this thread while
        the test may call Playwright (a call without the mark ends the Playwright session),
        and not after it."""
        asyncio.events._set_running_loop(self.loop)
        try:
            yield self.browser
        finally:
            asyncio.events._set_running_loop(None)


@pytest.fixture(scope="session")
def chromium() -> Iterator[Chromium]:
    """One Playwright session and Chromium per test session: a launch takes seconds."""
    executable = shutil.which("chromium")
    if executable is None:
        # A failure, not a skip: make test installs it.
        pytest.fail("Debian's chromium is not installed (make sysdeps installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        expect.set_options(timeout=PAGE_WAIT_MS)
        session = Chromium(launched, asyncio.get_running_loop())
        asyncio.events._set_running_loop(None)  # until a test asks for the browser
        yield session
        # Marked running again to close: leaving the with block unmarks it.
        asyncio.events._set_running_loop(session.loop)
        launched.close()


@pytest.fixture
def browser(chromium: Chromium) -> Iterator[Browser]:
    with chromium.lent() as lent:
        yield lent


@pytest.fixture
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    opened = context.new_page()
    yield opened
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    opened.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
    context.close()


def screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path

"""A real headless Chromium (Debian's package), driven by Playwright; never a downloaded browser.

The fixtures are registered once, by the root conftest (tests/conftest.py), so the browser
tests and the end-to-end tests that open a page share one session's Chromium: two
Playwright sessions cannot run in one thread.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.conftest import ROOT

CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]
ARTIFACTS = ROOT / "test-artifacts" / "browser"

PAGE_WAIT_MS = 15_000
"""How long an ``expect()`` waits unless its test gives its own timeout:
a page that refreshes every 2 s, served by a manager on a loaded 2-core CI machine, can
take a few refreshes to show a change (Playwright's own default is 5 s)."""


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    executable = shutil.which("chromium")
    if executable is None:
        # A failure, not a skip: make test installs it.
        pytest.fail("Debian's chromium is not installed (make sysdeps installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        expect.set_options(timeout=PAGE_WAIT_MS)
        yield launched
        launched.close()


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

"""The session's Chromium leaves no event loop running between tests: a test after one that
opened a page, in the same process, can run an event loop of its own (as a slot in-process
does with ``asyncio.Runner``). Run as a pytest session of its own, in order, so that the two
tests share one process whatever the worker split of the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.browser

INNER_TESTS = '''
import asyncio

from playwright.sync_api import Page


def test_a_page(page: Page) -> None:
    page.set_content("<p>drawn</p>")
    assert page.inner_text("p") == "drawn"


def test_then_a_loop_of_its_own() -> None:
    assert asyncio.run(asyncio.sleep(0, result="ran")) == "ran"


def test_then_the_page_again(page: Page) -> None:
    page.set_content("<p>again</p>")
    assert page.inner_text("p") == "again"
'''


def inner_environment() -> dict[str, str]:
    """This environment for the inner session, without the outer session's PYTEST_ADDOPTS:
    a --basetemp there (.ci/fresh-check sets one) holds this test's folder, which pytest
    refuses as the inner session's working directory."""
    inherited = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return {**inherited, "PYTHONPATH": str(ROOT)}


def test_a_test_after_a_page_test_can_run_its_own_event_loop(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.browser.chromium"]\n')
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
        cwd=tmp_path, env=inner_environment(),
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout + done.stderr

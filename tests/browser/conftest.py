"""The browser tests' helpers; the Chromium fixtures (``browser``, ``page``) live in
tests/browser/chromium.py and are registered by the root conftest, once for every test."""

from __future__ import annotations

from tests.browser.chromium import ARTIFACTS, CHROMIUM_ARGS, screenshot

__all__ = ["ARTIFACTS", "CHROMIUM_ARGS", "screenshot"]

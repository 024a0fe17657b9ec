"""The cluster identity a broker carries: written once by the first process, read back by
every later one; a backend without a controls store has none (no refusal, a warning)."""

from __future__ import annotations

import logging
from typing import cast

import pytest

from qcluster.broker.base import Broker
from qcluster.cluster_identity import IDENTITY_KEY, claim


class Store:
    """A broker's controls store, and nothing else of a broker."""

    safe_url = "redis://127.0.0.1:6379/0"

    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}

    def read_controls(self) -> dict[str, bytes]:
        return dict(self.stored)

    def write_control(self, key: str, value: bytes | None) -> None:
        assert value is not None
        self.stored[key] = value


class NoStore(Store):
    """A backend that cannot store controls (the Broker contract's default)."""

    def read_controls(self) -> dict[str, bytes]:
        raise NotImplementedError("NoStore cannot store controls")


def no_sleep(_seconds: float) -> None:
    return None


def test_the_first_process_writes_the_identity_and_the_next_reads_it() -> None:
    store = Store()
    first = claim(cast(Broker, store), sleep=no_sleep)
    assert first is not None and first.broker == Store.safe_url
    assert store.stored[IDENTITY_KEY].decode() == first.id
    assert claim(cast(Broker, store), sleep=no_sleep) == first


def test_a_broker_without_a_controls_store_has_no_identity(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert claim(cast(Broker, NoStore()), sleep=no_sleep) is None
    assert "cannot read the cluster identity" in caplog.text

"""The service changes controls in one place, and the planning loop's read never undoes a
change it did not see (the read and its apply hold the broker lock, as a change does)."""

from __future__ import annotations

import threading
import time
from typing import cast

from qcluster.broker.base import Broker
from qcluster.config import load_settings
from qcluster.manager.service import ManagerService
from qcluster.manager.state import ClusterState


class SlowControls:
    """A broker whose controls read takes its snapshot first and answers later (a slow
    round trip), so a change can land in between."""

    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}
        self.reading = threading.Event()

    def read_controls(self) -> dict[str, bytes]:
        snapshot = dict(self.stored)
        self.reading.set()
        time.sleep(0.3)
        return snapshot

    def write_control(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.stored.pop(key, None)
        else:
            self.stored[key] = value


def test_a_pause_during_a_rounds_read_of_the_controls_is_kept() -> None:
    broker = SlowControls()
    service = ManagerService(ClusterState(load_settings(None)), cast(Broker, broker), "s3cret")
    reader = threading.Thread(target=service.read_controls)
    reader.start()
    assert broker.reading.wait(30)
    service.pause("mail", by="alice")  # while the read's stale answer is on its way
    reader.join(30)
    assert "mail" in service.state.paused
    assert [(c.kind, c.name, c.by) for c in service.controls()] == [("pause", "mail", "alice")]
    service.read_controls()
    assert "mail" in service.state.paused


def test_resume_and_undrain_lift_only_their_own_control() -> None:
    broker = SlowControls()
    service = ManagerService(ClusterState(load_settings(None)), cast(Broker, broker), "s3cret")
    service.pause("mail")
    service.drain("mail")  # a host may share a queue's name: a different control
    service.resume("mail")
    assert [(c.kind, c.name) for c in service.controls()] == [("drain", "mail")]
    assert service.state.drained == {"mail"} and not service.state.paused
    service.undrain("mail")
    assert service.controls() == [] and broker.stored == {}

"""Pause and drain as the service changes them: the broker first, then the state.

The broker keeps them (``manager/controls/store.py``: a restarted manager keeps them); the state
holds what the last read or change said, which the next round plans with.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from qcluster.controls import Control, ControlKind
from qcluster.errors import BrokerError
from qcluster.manager.controls.store import ControlStore
from qcluster.manager.state import ClusterState

#: The service's name in the log, as before the service was split.
logger = logging.getLogger(__name__)


class ControlDesk:
    """The only place controls change. A change holds the broker lock while the state
    follows, so a round's read of the broker's controls cannot interleave with it."""

    def __init__(self, state: ClusterState, store: ControlStore, lock: threading.RLock,
                 broker_lock: threading.Lock, clock: Callable[[], float]) -> None:
        self.state = state
        self.store = store
        """Pause and drain, kept in the broker (``manager/controls/store.py``)."""
        self.lock = lock
        """The service's state lock."""
        self.broker_lock = broker_lock
        self.clock = clock

    def set(self, kind: ControlKind, name: str, by: str) -> Control:
        """Store the control, then plan with it. Raises BrokerError when the broker
        cannot store it (nothing changes then)."""
        control = Control(kind=kind, name=name, by=by, at=self.clock())
        with self.broker_lock:  # held while the state follows: a round's read cannot interleave
            self.store.set(control)
            with self.lock:
                self.state.add_control(control)
        logger.info("%s %s by %s", kind, name, by)
        return control

    def clear(self, kind: ControlKind, name: str) -> None:
        with self.broker_lock:
            self.store.clear(kind, name)
            with self.lock:
                self.state.remove_control(kind, name)
        logger.info("%s %s", "resume" if kind == "pause" else "undrain", name)

    def in_force(self) -> list[Control]:
        """The pauses and drains in force, with who set them and when (by kind, name)."""
        with self.lock:
            return sorted(self.state.controls.values(), key=lambda c: (c.kind, c.name))

    def read(self) -> None:
        """The broker's controls replace the state's (a restart, or a second manager's
        change, is seen within a round); a failed read keeps the ones held."""
        with self.broker_lock:
            try:
                controls = self.store.read()
            except BrokerError as exc:
                logger.warning("reading the controls failed: %s", exc)
                return
            if controls is not None:
                with self.lock:
                    self.state.set_controls(controls)

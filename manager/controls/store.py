"""Where the manager keeps pause and drain: in the broker, so that they survive it.

Every control is written to the broker when it is set (``Broker.write_control``) and the
planning loop reads them all back each round (``Broker.read_controls``): a restarted
manager, or a second one started by mistake, plans with the same pauses and drains within
a round. The service's control desk (``manager/controls/desk.py``) is the only caller;
the state keeps what the last read said (``ClusterState.set_controls``).
"""

from __future__ import annotations

import logging

from qcluster.broker.base import Broker
from qcluster.cluster_identity import RESERVED_PREFIX
from qcluster.controls import Control, ControlKind, control_key, parse_stored

logger = logging.getLogger(__name__)


class ControlStore:
    """The broker's controls, read and written as :class:`~qcluster.controls.Control`."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.warned: set[str] = set()
        """Stored entries that are no control, warned once each (the loop reads every round)."""

    def read(self) -> dict[str, Control] | None:
        """Every control in force by key; None: not readable just now (keep the last).
        Raises BrokerError when the broker does not answer."""
        stored = self.broker.read_controls()
        if stored is None:
            return None
        controls = {}
        for key, value in stored.items():
            if key.startswith(RESERVED_PREFIX):  # the cluster identity: no control
                continue
            control = parse_stored(key, value)
            if control is None:
                if key not in self.warned:
                    self.warned.add(key)
                    logger.warning("ignoring the stored control %r: not a control", key[:100])
            else:
                controls[control.key] = control
        return controls

    def set(self, control: Control) -> None:
        self.broker.write_control(control.key, control.stored())

    def clear(self, kind: ControlKind, name: str) -> None:
        self.broker.write_control(control_key(kind, name), None)

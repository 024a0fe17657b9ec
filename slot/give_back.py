"""Settling what a slot of the same master held when it died: the master has no broker
connection, so it asks a live slot (messages.GiveBack, read from the dead slot's
TakeProgress)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from qcluster.app import App
from qcluster.broker import Broker
from qcluster.failures import JobError
from qcluster.job import Delivery, LockToken
from qcluster.messages import GiveBack
from qcluster.slot import identity
from qcluster.slot.settle import DIED, give_back_settlement

logger = logging.getLogger(__name__)


def give_back(broker: Broker, app: App, command: GiveBack, *, rand: Callable[[], float],
              slot_label: str) -> None:
    """Settle the dead slot's jobs by how far it got with each; a failure leaves them to
    their lock expiry (never raises)."""
    try:
        now = time.time()

        message = f"{DIED}: {command.died}" if command.died else DIED

        def died(delivery: Delivery) -> JobError:  # what is known: its slot died running it
            return JobError.bounded(type="SlotDied", message=message, traceback="",
                                    host=identity.host, slot=command.slot,
                                    attempt=delivery.attempts, at=now)

        settlement = give_back_settlement(
            command.jobs, LockToken(command.receipt), app.spec(command.queue).policy,
            rand=rand, now=now, died=died)
        broker.settle(command.queue, settlement)
    except Exception as exc:  # never die of it: the locks expire
        logger.warning("slot %s: could not give back a dead slot's %d jobs of %s: %s",
                       slot_label, len(command.jobs), command.queue, exc)
        return
    logger.info("slot %s: gave back a dead slot's jobs of %s: %d unstarted, %d "
                "crashed, %d dead, %d acked, %d retried", slot_label, command.queue,
                len(settlement.release), len(settlement.crashed), len(settlement.dead),
                len(settlement.ack_held), len(settlement.postpone))

"""A broker error no retry can fix: the slot says why once and stops."""

from __future__ import annotations

from qcluster.errors import BrokerError

#: Errors of the broker's client that no retry can fix: RabbitMQ's ACCESS_REFUSED (403)
#: and NOT_ALLOWED (530), PRECONDITION_FAILED (406) to an exchange or queue method (a
#: declaration or binding; not an ack, which may fail after a reconnect); Redis's NOPERM.
_REFUSALS = frozenset({"AccessRefused", "NotAllowed", "NoPermissionError"})
_AMQP_TOPOLOGY_CLASSES = (40, 50)  # exchange.*, queue.*


def refused_for_good(exc: BrokerError) -> bool:
    """A broker error that no retry can fix: the queue exists with another type
    (QueueTypeMismatch), or the broker refused a declaration or a permission."""
    if any(kind.__name__ == "QueueTypeMismatch" for kind in type(exc).__mro__):
        return True
    cause = exc.__cause__
    if cause is None:
        return False
    names = {kind.__name__ for kind in type(cause).__mro__}
    if names & _REFUSALS:
        return True
    method = getattr(cause, "method_sig", None) or (0, 0)
    return "PreconditionFailed" in names and method[0] in _AMQP_TOPOLOGY_CLASSES


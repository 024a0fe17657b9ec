"""The qcluster error hierarchy.

Retryable conditions (the broker is away) and fatal ones (bad configuration) are
distinct classes so that loops can decide at one boundary what to do with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class QClusterError(Exception):
    """Base class of every error qcluster raises on purpose."""


class ConfigError(QClusterError):
    """Configuration is invalid; the process must not start."""


class BrokerError(QClusterError):
    """The broker refused or failed an operation."""


class BrokerUnavailable(BrokerError):
    """The broker cannot be reached (after the configured retries)."""


class ReplicationUnconfirmed(BrokerUnavailable):
    """A publish reached the master but too few replicas confirmed it in time: the jobs
    are stored (a failover could still lose them). A caller that must not publish the same
    thing twice under a new identity (the periodic ticker) keeps its claim on this one."""


class EnvelopeError(QClusterError):
    """A message is not a valid job envelope (malformed, wrong content type, too big)."""


class InvalidQueueName(QClusterError, ValueError):
    """A queue name breaks the rule of :mod:`qcluster.names`."""


class InvalidJobId(QClusterError, ValueError):
    """A job id that no job can have: empty, blank or over MAX_JOB_ID_CHARS."""


class ClientClosed(QClusterError, RuntimeError):
    """A call on a :class:`~qcluster.client.Client` after its ``close()``."""


class InvalidDelay(QClusterError, ValueError):
    """A delay that is not a finite number of seconds in [0, MAX_DELAY_S]."""


class HandlerNotFound(QClusterError):
    """No handler is registered for the queue a slot was asked to serve."""


class AppImportError(QClusterError):
    """The application module named by --app could not be imported."""


def field_reasons(errors: Iterable[Mapping[str, Any]], *, prefix: str = "",
                  whole: str = "policy", known: Iterable[str] = ()) -> str:
    """pydantic's ``ValidationError.errors()`` as one line: ``field: reason; field: reason``.

    ``prefix`` goes before each field (``queues.mail.``); ``whole`` names an error that is
    about no single field (a model validator's). The ``Value error, `` pydantic puts before
    a validator's message is dropped. A key that is not one of ``known`` names the closest
    that is.
    """
    from qcluster.names import closest  # qcluster.names raises this module's errors

    reasons = []
    for error in errors:
        loc = error.get("loc", ())
        where = ".".join(str(part) for part in loc) or whole
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden" and known and len(loc) == 1:
            like = closest(str(loc[0]), known)
            message = f"unknown key (did you mean {like!r}?)" if like else "unknown key"
        reasons.append(f"{prefix}{where}: {message}")
    return "; ".join(reasons)

"""The qcluster error hierarchy.

Retryable conditions (the broker is away) and fatal ones (bad configuration) are
distinct classes so that loops can decide at one boundary what to do with them.
"""

from __future__ import annotations


class QClusterError(Exception):
    """Base class of every error qcluster raises on purpose."""


class ConfigError(QClusterError):
    """Configuration is invalid; the process must not start."""


class BrokerError(QClusterError):
    """The broker refused or failed an operation."""


class BrokerUnavailable(BrokerError):
    """The broker cannot be reached (after the configured retries)."""


class EnvelopeError(QClusterError):
    """A message is not a valid job envelope (malformed, wrong content type, too big)."""


class InvalidQueueName(QClusterError, ValueError):
    """A queue name breaks the rule of :mod:`qcluster.names`."""


class InvalidDelay(QClusterError, ValueError):
    """A delay that is not a finite number of seconds in [0, MAX_DELAY_S]."""


class HandlerNotFound(QClusterError):
    """No handler is registered for the queue a slot was asked to serve."""


class AppImportError(QClusterError):
    """The application module named by --app could not be imported."""


class HaltProcess(BaseException):
    """This process must exit with ``code``.

    A BaseException so that ``except Exception`` in handler code cannot swallow it.
    """

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason

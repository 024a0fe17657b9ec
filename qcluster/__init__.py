"""qcluster: a self-managing queue-processing cluster.

Public API: :class:`App` (declare queues and handlers), :class:`Job` (what a handler
gets), :class:`Client` (enqueue, stats, dead letters).
"""

from __future__ import annotations

from qcluster.app import App
from qcluster.client import Client
from qcluster.job import Job
from qcluster.policy import QueuePolicy

__version__ = "0.1.0"
__all__ = ["App", "Client", "Job", "QueuePolicy", "__version__"]

"""What the admin pages read and do, as a protocol the manager's service implements.

The admin UI never imports the manager: the manager passes an object with these
methods to :func:`admin_ui.router.install`. Tests pass a fake.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from qcluster.broker.base import DeadJob
from qcluster.broker.health import BrokerHealth
from qcluster.controls import Control
from qcluster.jobs import JobInfo, JobPage
from qcluster.messages import ClusterView, HistoryPoint
from qcluster.periodic import PeriodicJobView


class ClusterSource(Protocol):
    """The manager's public read (and guarded write) surface for the admin pages."""

    def cluster_view(self) -> ClusterView:
        """The current picture: queues, hosts, slot map, decisions (newest first)."""
        ...

    def queue_history(self, queue: str) -> list[HistoryPoint]:
        """The queue's points over the last hour, oldest first (one per planning round)."""
        ...

    def dead_jobs(self, queue: str, limit: int = 50) -> list[DeadJob]:
        """The queue's dead-letter jobs, newest first."""
        ...

    def requeue_dead(self, queue: str) -> int:
        """Move the queue's dead jobs back to ready; returns how many. Caller checks the token."""
        ...

    def check_token(self, token: str | None) -> bool:
        """True when ``token`` authorises a state change (False when no token is configured)."""
        ...


@runtime_checkable
class ControlSource(Protocol):
    """A source that also has operator controls (the manager does; a page test's fake
    may not, and then no control is shown)."""

    def controls(self) -> list[Control]:
        """Pauses and drains in force, each with who (the token's name) and when."""
        ...


@runtime_checkable
class PeriodicSource(Protocol):
    """A source that runs periodic jobs (the manager does; a fake may not, and then the
    overview has no periodic section)."""

    def periodic_jobs(self) -> list[PeriodicJobView]:
        """Each periodic job with its last enqueued tick and its next one."""
        ...


@runtime_checkable
class BrokerNodesSource(Protocol):
    """A source that reads its broker's per-node health (the manager does; a fake may
    not, and then the overview has no broker table)."""

    def broker_nodes(self) -> BrokerHealth | None:
        """The broker's nodes and each queue's node, as last read (None: not read yet)."""
        ...


@runtime_checkable
class ActionSource(Protocol):
    """A source whose page has buttons: pause and resume a queue, drain and undrain a host,
    reload one host's code or every host's (the manager; a fake may not, and then the page
    shows no button). The router checks the token (``token_name``) before calling one."""

    def token_name(self, token: str | None) -> str | None:
        """The name of the token ``token`` is (who acts); None: not a valid token."""
        ...

    def pause(self, queue: str, by: str) -> object:
        """Plan no slot for ``queue`` until resumed, as ``by``. Raises BrokerError when the
        broker does not store it."""
        ...

    def drain(self, host: str, by: str) -> object:
        """Plan no slot on ``host`` until undrained, as ``by``. Raises BrokerError."""
        ...

    def resume(self, queue: str) -> None:
        """Plan slots for a paused queue again. Raises BrokerError when not stored."""
        ...

    def undrain(self, host: str) -> None:
        """Plan slots on a drained host again. Raises BrokerError when not stored."""
        ...

    def reload(self, host: str | None, by: str) -> dict[str, Any]:
        """Start a rolling reload of ``host`` (None: every reporting host, one at a time);
        returns the rollout. Raises ValueError with ``status`` (404 an unknown host, 409
        a reload running or nobody to reload) when refused."""
        ...

    def reload_status(self) -> dict[str, Any] | None:
        """The rollout running or the last one: ``{id, by, state, note, hosts: [{host,
        state, note, ...}]}`` (docs/manager.md); None: none yet."""
        ...


@runtime_checkable
class JobSource(Protocol):
    """A source that finds jobs and lists a queue's jobs by state (the manager: the same
    broker calls as its job routes, docs/api.md). Without it the pages have no job browser."""

    def find_job(self, job_id: str) -> JobInfo | None:
        """Where the job is and since when; None when no queue holds it. Raises BrokerError."""
        ...

    def job_page(self, queue: str, state: str, offset: int, limit: int) -> JobPage:
        """A page of the queue's running, delayed, retrying or dead jobs (dead: newest
        first). Raises BrokerError; NotImplementedError when the backend cannot list."""
        ...

    def requeue_dead_jobs(self, queue: str, ids: list[str]) -> int:
        """Requeue these dead letters (caller checks the token); returns how many."""
        ...

    def delete_dead_jobs(self, queue: str, ids: list[str]) -> int:
        """Delete these dead letters (caller checks the token); returns how many."""
        ...

    def check_token(self, token: str | None) -> bool:
        """As :meth:`ClusterSource.check_token`."""
        ...

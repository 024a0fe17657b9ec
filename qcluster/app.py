"""The application registry: ``@app.queue(...)`` binds batch handlers to queues."""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from qcluster.errors import (
    AppImportError,
    ConfigError,
    HandlerNotFound,
    InvalidQueueName,
    field_reasons,
)
from qcluster.job import Job
from qcluster.names import check_queue_name
from qcluster.policy import QueuePolicy

BatchHandler = Callable[[list[Job]], Any]


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """A queue as declared in code: its handler and its default policy."""

    name: str
    handler: BatchHandler
    policy: QueuePolicy


class App:
    """A set of queues and their handlers.

    >>> app = App()
    >>> @app.queue("resize_photo", batch_size=20, priority=5)
    ... def resize_photo(jobs): ...
    """

    def __init__(self, name: str = "qcluster-app") -> None:
        self.name = name
        self.queues: dict[str, QueueSpec] = {}

    def queue(self, name: str, **policy: Any) -> Callable[[BatchHandler], BatchHandler]:
        """Decorator binding a batch handler ``def handler(jobs: list[Job])`` to ``name``.

        Keyword arguments are :class:`~qcluster.policy.QueuePolicy` fields. The name
        follows :mod:`qcluster.names`; ``async def`` handlers are refused (not supported).
        """
        try:
            check_queue_name(name)
        except InvalidQueueName as exc:
            raise ConfigError(str(exc)) from None
        try:
            queue_policy = QueuePolicy(**policy)
        except ValidationError as exc:
            raise ConfigError(f"queue {name!r}: {field_reasons(exc.errors())}") from None

        def bind(handler: BatchHandler) -> BatchHandler:
            _refuse_async(name, handler)
            if name in self.queues:
                raise ConfigError(f"queue {name!r} is declared twice")
            self.queues[name] = QueueSpec(name, handler, queue_policy)
            return handler

        return bind

    def job_queue(self, name: str, **policy: Any) -> Callable[[Callable[[Job], Any]], Any]:
        """Per-job convenience: ``def handler(job: Job)`` is called once per job.

        An exception from one job retries (or locks) that job only; the others of the
        batch are settled by their own outcome.
        """

        def bind(handler: Callable[[Job], Any]) -> Callable[[Job], Any]:
            _refuse_async(name, handler)

            def run_each(jobs: list[Job]) -> None:
                for job in jobs:
                    try:
                        handler(job)
                    except Exception as exc:  # one job's failure must not fail the batch
                        job.mark_error(exc)

            run_each.__name__ = getattr(handler, "__name__", "handler")
            self.queue(name, **policy)(run_each)
            return handler

        return bind

    def spec(self, name: str) -> QueueSpec:
        try:
            return self.queues[name]
        except KeyError:
            known = ", ".join(sorted(self.queues)) or "none"
            raise HandlerNotFound(
                f"no handler for queue {name!r} in app {self.name!r} (known: {known})"
            ) from None

    def with_overrides(self, overrides: dict[str, dict[str, Any]]) -> App:
        """A copy whose policies have ``overrides`` (from qcluster.toml) applied."""
        merged = App(self.name)
        for name, spec in self.queues.items():
            extra = overrides.get(name, {})
            try:
                policy = spec.policy.merged(extra) if extra else spec.policy
            except ValidationError as exc:
                raise ConfigError(f"[queues.{name}] in the configuration: {exc}") from exc
            merged.queues[name] = QueueSpec(name, spec.handler, policy)
        return merged


def _refuse_async(queue: str, handler: Callable[..., Any]) -> None:
    """The slot calls handlers synchronously: an ``async def`` handler would return a
    coroutine that never runs while its jobs are acked. Refused until async is supported."""
    call = getattr(handler, "__call__", None)  # noqa: B004 - an object with async __call__
    if any(inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f)
           for f in (handler, call) if f is not None):
        name = getattr(handler, "__name__", type(handler).__name__)
        raise ConfigError(
            f"queue {queue!r}: handler {name} is async; qcluster calls handlers "
            "synchronously (write a plain def, e.g. calling asyncio.run inside)"
        )


def load_app(target: str) -> App:
    """Import ``MODULE`` or ``MODULE:ATTR`` and return its :class:`App` (attribute ``app``)."""
    module_name, _, attr = target.partition(":")
    attr = attr or "app"
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the current directory is importable
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AppImportError(f"cannot import app module {module_name!r}: {exc}") from exc
    app = getattr(module, attr, None)
    if not isinstance(app, App):
        raise AppImportError(
            f"{module_name}:{attr} is {type(app).__name__}, expected a qcluster.App"
        )
    return app

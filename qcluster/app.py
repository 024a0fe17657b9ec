"""The application registry: ``@app.queue(...)`` binds batch handlers to queues.

Handlers are plain ``def`` or ``async def``; the slot awaits async ones on its own event
loop (qcluster.slot.aio).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import inspect
import logging
import math
import sys
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qcluster.errors import (
    AppImportError,
    ConfigError,
    HandlerNotFound,
    InvalidQueueName,
    field_reasons,
)
from qcluster.hooks import DEFAULT_HOOK_TIMEOUT_S, FailureHook, HookSpec
from qcluster.job import Job
from qcluster.names import check_queue_name, closest
from qcluster.periodic import CatchUp, PeriodicSpec, periodic_spec
from qcluster.policy import QueuePolicy

logger = logging.getLogger(__name__)

BatchHandler = Callable[[list[Job]], Any]
AsyncJobHandler = Callable[[Job], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """A queue as declared in code: its handler and its default policy."""

    name: str
    handler: BatchHandler
    policy: QueuePolicy
    is_async: bool = False
    """``handler`` is a coroutine function: the slot awaits it on its event loop."""
    job_handler: AsyncJobHandler | None = None
    """An async per-job handler (``app.job_queue``); ``handler`` then awaits it for each
    job of a batch, ``policy.concurrency`` at a time."""
    per_job: bool = False
    """Declared with ``app.job_queue`` (sync or async): ``handler`` takes the batch's jobs
    one by one, iterating the list it is given (a sync one in order, an async one as its
    workers take them), and an exception fails only its own job."""


#: Every App of this process, so that a ``Client`` made without ``app=`` in a process that
#: imported the app declares its queues as the app's policies say (qcluster.client).
LIVE_APPS: weakref.WeakSet[App] = weakref.WeakSet()


class App:
    """A set of queues and their handlers.

    >>> app = App()
    >>> @app.queue("resize_photo", batch_size=20, priority=5)
    ... def resize_photo(jobs): ...
    """

    def __init__(self, name: str = "qcluster-app", *, version: str | None = None) -> None:
        self.name = name
        self.version = version
        """The code's version as the user names it (e.g. from an environment variable or
        a file the deploy writes); None: a hash of the app's files (:func:`code_version`)."""
        self.queues: dict[str, QueueSpec] = {}
        self.periodic_jobs: dict[str, PeriodicSpec] = {}
        """``@app.periodic`` declarations by name; the manager enqueues their ticks."""
        self.failure_hooks: list[HookSpec] = []
        """``@app.on_failure`` hooks, called in order (qcluster.hooks)."""
        LIVE_APPS.add(self)

    def on_failure(self, hook: FailureHook | None = None, *,
                   timeout: float = DEFAULT_HOOK_TIMEOUT_S) -> Any:
        """Decorator: call ``hook(failure)`` in the slot each time a handler raises,
        with a :class:`~qcluster.hooks.Failure` (the queue, the jobs, the exception and
        what happens next: ``retry`` at ``retry_at``, ``dead`` or ``locked``)::

            @app.on_failure
            def report(failure): sentry_sdk.capture_exception(failure.exception)

        ``@app.on_failure(timeout=2.0)`` bounds the hook's time (default 5 s; never
        longer than the batch's lock has left). A hook that raises is logged and
        ignored; one that runs too long is left behind: the jobs' outcome never waits
        for a hook and never depends on one.
        """
        if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                or not math.isfinite(timeout) or timeout <= 0):
            raise ConfigError(f"on_failure: timeout must be a finite number of seconds > 0, "
                              f"not {timeout!r}")

        def bind(target: FailureHook) -> FailureHook:
            _check_hook(target)
            self.failure_hooks.append(HookSpec(target, float(timeout)))
            return target

        return bind(hook) if hook is not None else bind

    def queue(self, name: str, **policy: Any) -> Callable[[BatchHandler], BatchHandler]:
        """Decorator binding a batch handler ``def handler(jobs: list[Job])`` (or
        ``async def handler(jobs)``) to ``name``.

        Keyword arguments are :class:`~qcluster.policy.QueuePolicy` fields. The name
        follows :mod:`qcluster.names`.
        """
        queue_policy = _checked_policy(name, policy)

        def bind(handler: BatchHandler) -> BatchHandler:
            is_async = _is_async(name, handler)
            _check_call(name, handler, per_job=False)
            self._add(_with_policy(QueueSpec(name, handler, queue_policy, is_async)))
            return handler

        return bind

    def _add(self, spec: QueueSpec) -> None:
        if spec.name in self.queues:
            raise ConfigError(f"queue {spec.name!r} is declared twice")
        self.queues[spec.name] = spec

    def job_queue(self, name: str, **policy: Any) -> Callable[[Callable[[Job], Any]], Any]:
        """Per-job convenience: ``def handler(job: Job)`` is called once per job.

        An exception from one job retries (or locks) that job only; the others of the
        batch are settled by their own outcome. ``async def handler(job)`` is awaited
        for the batch's jobs concurrently, at most ``concurrency`` at once (default: the
        whole batch).
        """

        def bind(handler: Callable[[Job], Any]) -> Callable[[Job], Any]:
            is_async = _is_async(name, handler)
            _check_call(name, handler, per_job=True)
            if is_async:
                queue_policy = _checked_policy(name, policy)
                self._add(_with_policy(QueueSpec(
                    name, _each_concurrently(handler, None), queue_policy, is_async=True,
                    job_handler=handler, per_job=True)))
                return handler

            def run_each(jobs: list[Job]) -> None:
                for job in jobs:
                    try:
                        result = handler(job)
                        if is_unrun_work(result):
                            refuse_result(result)
                    except Exception as exc:  # one job's failure must not fail the batch
                        job.mark_error(exc)

            run_each.__name__ = getattr(handler, "__name__", "handler")
            self._add(_with_policy(QueueSpec(
                name, run_each, _checked_policy(name, policy), per_job=True)))
            return handler

        return bind

    def periodic(
        self, cron: str | None = None, *, queue: str, payload: Any = None,
        every: float | None = None, catch_up: CatchUp = "skip", name: str | None = None,
        missed_after: float | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator declaring a periodic job: the manager enqueues ``payload`` (default
        ``{}``) to ``queue`` at each tick of ``cron`` (5 fields, or 6 with seconds first;
        UTC) or ``every`` seconds, once per tick across managers. ``catch_up``: what
        happens to ticks missed while no manager ran ("skip", "latest" or the newest N);
        a tick is missed once ``missed_after`` seconds (default 60) passed unenqueued.
        The job is named ``name`` or after the decorated function, which is returned as
        it is (it is not called: the queue's handler runs the jobs)::

            @app.periodic("*/5 * * * *", queue="report", payload={"kind": "daily"})
            @app.queue("report")
            def report(jobs): ...

        A bad declaration is a ConfigError naming the job and the field, at import.
        """
        fields: dict[str, Any] = {"queue": queue, "cron": cron, "every": every,
                                  "catch_up": catch_up}
        if payload is not None:
            fields["payload"] = payload
        if missed_after is not None:
            fields["missed_after"] = missed_after

        def bind(target: Callable[..., Any]) -> Callable[..., Any]:
            job = str(name or getattr(target, "__name__", ""))
            if job in self.periodic_jobs:
                raise ConfigError(f"periodic job {job!r} is declared twice")
            self.periodic_jobs[job] = periodic_spec(job, fields, where="@app.periodic")
            return target

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
        merged = App(self.name, version=self.version)
        merged.periodic_jobs = dict(self.periodic_jobs)
        merged.failure_hooks = list(self.failure_hooks)
        for name, spec in self.queues.items():
            extra = overrides.get(name, {})
            try:
                policy = spec.policy.merged(extra) if extra else spec.policy
            except ValidationError as exc:
                reasons = field_reasons(exc.errors(), known=QueuePolicy.model_fields)
                raise ConfigError(f"[queues.{name}] in the configuration: {reasons}") from None
            merged.queues[name] = _with_policy(spec, policy, where=f"[queues.{name}]")
        for name in sorted(set(overrides) - set(self.queues)):
            # Another app's queue is fine (one file may serve several apps, and the
            # manager's planning reads it too); a near miss is a typo whose settings
            # apply to nothing.
            close = closest(name, self.queues, cutoff=0.7)
            if close:
                logger.warning("[queues.%s] in the configuration: app %r declares no such "
                               "queue (did you mean %s?): its settings apply to no slot",
                               name, self.name, close)
        return merged


def _checked_policy(name: str, policy: dict[str, Any]) -> QueuePolicy:
    try:
        check_queue_name(name)
    except InvalidQueueName as exc:
        raise ConfigError(str(exc)) from None
    try:
        return QueuePolicy(**policy)
    except ValidationError as exc:
        reasons = field_reasons(exc.errors(), known=QueuePolicy.model_fields)
        raise ConfigError(f"queue {name!r}: {reasons}") from None


def _with_policy(spec: QueueSpec, policy: QueuePolicy | None = None, *,
                 where: str = "") -> QueueSpec:
    """``spec`` under ``policy`` (default: its own). An async per-job handler gets its
    batch wrapper built for the policy's concurrency; on any other handler a
    ``concurrency`` is refused (it would silently do nothing)."""
    policy = policy or spec.policy
    if spec.job_handler is None:
        if policy.concurrency is not None:
            raise ConfigError(
                f"{where or f'queue {spec.name!r}'}: concurrency applies only to async "
                "per-job handlers (app.job_queue with async def)")
        return replace(spec, policy=policy)
    handler = _each_concurrently(spec.job_handler, policy.concurrency)
    return replace(spec, handler=handler, policy=policy)


def _each_concurrently(handler: AsyncJobHandler, concurrency: int | None) -> BatchHandler:
    """An async batch handler awaiting ``handler`` for each job, ``concurrency`` at once
    (None: all). An exception marks its own job only; a job that returns without an
    outcome is marked done, so that a cancelled batch can tell it from an unfinished one."""

    async def run_one(job: Job) -> None:
        try:
            result = await handler(job)
            if is_unrun_work(result):
                refuse_result(result)
        except Exception as exc:  # one job's failure must not fail the batch
            job.mark_error(exc)
        else:
            # A handler that swallowed the deadline's cancel and returned is not done:
            # the batch settles it as timed out (slot/aio.py).
            if job.outcome is None and not _cancelling():
                job.outcome = "done"

    async def run_each(jobs: list[Job]) -> None:
        pending = iter(jobs)  # shared by the workers: each job is taken once

        async def worker() -> None:
            for job in pending:
                await run_one(job)

        workers = min(concurrency or len(jobs), len(jobs))
        await asyncio.gather(*(worker() for _ in range(workers)))

    run_each.__name__ = getattr(handler, "__name__", "handler")
    return run_each


def is_unrun_work(result: object) -> bool:
    """A coroutine or generator: work created and never run. A per-job handler may return
    a value (it is not used); returning one of these means its job's work did not happen."""
    return inspect.iscoroutine(result) or inspect.isgenerator(result)


def refuse_result(result: object) -> None:
    """A handler returns None. Anything else means the work may not have happened: a
    coroutine or generator was created and never run (a sync handler returning one, an
    async one returning another coroutine without awaiting it). Close it (no "never
    awaited" warning) and raise, so that the jobs fail (retried, then dead-lettered)
    instead of being acked without having run."""
    if inspect.iscoroutine(result) or inspect.isgenerator(result):
        with contextlib.suppress(Exception):
            result.close()
    raise TypeError(
        f"the handler returned {type(result).__name__}, not None: a handler must do its "
        "work before returning (declare it async def to have it awaited; a generator is "
        "never run)"
    )


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _is_async(queue: str, handler: Callable[..., Any]) -> bool:
    """True for ``async def`` handlers (or objects with an async ``__call__``); async
    generators are refused: there is no one coroutine to await."""
    call = getattr(handler, "__call__", None)  # noqa: B004 - an object with async __call__
    candidates = [f for f in (handler, call) if f is not None]
    if any(inspect.isasyncgenfunction(f) for f in candidates):
        name = getattr(handler, "__name__", type(handler).__name__)
        raise ConfigError(
            f"queue {queue!r}: handler {name} is an async generator (it yields); a handler "
            "must do its work and return (write an async def without yield)")
    return any(inspect.iscoroutinefunction(f) for f in candidates)


def _check_call(queue: str, handler: Callable[..., Any], *, per_job: bool) -> None:
    """Refuse at import a handler the slot cannot call as declared: the slot passes one
    argument (the batch's list of jobs, or one job with ``job_queue``), and a handler that
    cannot take it, or whose annotation says the other form, would fail every job until
    its attempts ran out and it was dead-lettered."""
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # some builtins and C callables: nothing to read
        return
    name = getattr(handler, "__name__", type(handler).__name__)
    decorator, given = ("job_queue", "one job") if per_job else ("queue", "a list of jobs")
    try:
        signature.bind(None)
    except TypeError as exc:
        raise ConfigError(
            f"queue {queue!r}: handler {name}{signature} cannot be called with {given}, "
            f"as @app.{decorator} calls it ({exc}): declare it as def {name}("
            f"{'job' if per_job else 'jobs'})") from None
    first = next(iter(signature.parameters.values()), None)
    if first is None or first.kind is first.VAR_POSITIONAL:
        return
    annotated = _annotation_text(first.annotation)
    wants_one = annotated in ("Job", "qcluster.Job", "qcluster.job.Job")
    wants_list = annotated.startswith(("list[", "List[", "typing.List[", "Sequence[",
                                       "collections.abc.Sequence["))
    if (wants_one and not per_job) or (wants_list and per_job):
        other = "app.queue (a list of jobs per call)" if per_job else \
            "app.job_queue (one job per call)"
        raise ConfigError(
            f"queue {queue!r}: handler {name} takes {first.name}: {annotated}, but "
            f"@app.{decorator} calls it with {given}: use @{other}")


def _check_hook(hook: Callable[..., Any]) -> None:
    """Refuse at import a failure hook that cannot take the one Failure it is called with:
    it would raise, logged and ignored, at every failure instead of reporting it."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None)
    except TypeError as exc:
        name = getattr(hook, "__name__", type(hook).__name__)
        raise ConfigError(f"on_failure: hook {name}{signature} cannot be called with the "
                          f"failure ({exc}): declare it as def {name}(failure)") from None


def _annotation_text(annotation: Any) -> str:
    """An annotation as written (``from __future__ import annotations`` keeps it a
    string), without whitespace or quotes; '' when there is none."""
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):
        text = annotation
    elif annotation is Job:
        text = "Job"
    else:
        text = repr(annotation).replace("qcluster.job.Job", "Job")
    return "".join(text.split()).replace("'", "").replace('"', "")


#: Hex digits of a code version computed from the app's files.
VERSION_HEX_DIGITS = 12


def code_version(app: App, target: str) -> str:
    """``app.version`` when the user gave one, else a short hash of the app's source: the
    ``.py`` files of the app module's top-level package (sorted by path, names and
    contents), or the module's own file when it is not in a package."""
    if app.version:
        return app.version[:128]
    module = sys.modules.get(target.partition(":")[0])
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return ""
    top = (module.__package__ or "").partition(".")[0]
    root = Path(path).resolve().parent
    for _ in range(module.__name__.count(".") - (0 if hasattr(module, "__path__") else 1)):
        root = root.parent  # from the module's own package up to the top-level one
    files = sorted(root.rglob("*.py")) if top else [Path(path).resolve()]
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(root.parent)).encode() + b"\0")
        digest.update(file.read_bytes() + b"\0")
    return digest.hexdigest()[:VERSION_HEX_DIGITS]


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

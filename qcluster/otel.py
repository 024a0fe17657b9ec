"""OpenTelemetry tracing, when ``opentelemetry-api`` is installed (``pip install
qcluster[otel]``); nothing at all otherwise (one module-level check).

* ``Client.enqueue``/``enqueue_many`` runs in a PRODUCER span ``qcluster enqueue QUEUE``
  and puts its context in the jobs' headers (W3C ``traceparent``/``tracestate``, by the
  globally configured propagator).
* A slot runs each batch in a span ``qcluster batch QUEUE`` (linked to each job's trace)
  and each job in a CONSUMER span ``qcluster job QUEUE``, a child of its enqueue span: one
  trace goes from the producer to the handler. While the handler runs, the current span
  is the job's when the batch holds one job (a span the handler starts is its child), the
  batch's otherwise. A job whose handler raised gets the exception and an error status.

Where spans go is the application's choice (an SDK ``TracerProvider`` and exporter set up
at import of the app module, so that forked slots inherit it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # the extra is not installed: tracing costs nothing
    trace = None  # type: ignore[assignment]

from qcluster.job import Job

ENABLED = trace is not None
"""opentelemetry-api is importable: producers and slots may trace (see :func:`active`)."""
TRACER_NAME = "qcluster"
#: Calls between two looks at the global tracer provider while none is set.
RECHECK_EVERY = 1024

_active = False
_until_recheck = 0


def active() -> bool:
    """A tracer provider is set (an SDK's, or an auto-instrumentation's): spans go
    somewhere. Until then nothing is traced: with the API alone every span would be a
    no-op that still costs a slot a third more CPU per job. The provider is looked up
    again every RECHECK_EVERY calls while none is set; once one is, it stays."""
    global _active, _until_recheck
    if _active:
        return True
    if _until_recheck > 0:
        _until_recheck -= 1
        return False
    _until_recheck = RECHECK_EVERY
    provider = trace.get_tracer_provider()
    _active = not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
    return _active


@contextmanager
def enqueue_span(queue: str, headers: dict[str, str] | None) -> Iterator[dict[str, str]]:
    """A producer span around a publish; yields ``headers`` with the trace context added."""
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        f"qcluster enqueue {queue}", kind=trace.SpanKind.PRODUCER,
        attributes={"messaging.system": "qcluster", "messaging.destination.name": queue},
    ):
        carrier = dict(headers or {})
        propagate.inject(carrier)
        yield carrier


def run_traced(queue: str, jobs: list[Job], run: Callable[[], float]) -> float:
    """Run a batch (``run``: the slot's handler call, returning its busy seconds) in a
    batch span with a span per job."""
    tracer = trace.get_tracer(TRACER_NAME)
    parents = [propagate.extract(job.headers) for job in jobs]
    links = [trace.Link(ctx) for ctx in (trace.get_current_span(p).get_span_context()
                                         for p in parents) if ctx.is_valid]
    with tracer.start_as_current_span(
        f"qcluster batch {queue}", links=links,
        attributes={"messaging.system": "qcluster", "messaging.destination.name": queue,
                    "messaging.batch.message_count": len(jobs)},
    ) as batch:
        spans = [tracer.start_span(
            f"qcluster job {queue}", context=parent, kind=trace.SpanKind.CONSUMER,
            attributes={"messaging.system": "qcluster", "messaging.destination.name": queue,
                        "messaging.message.id": job.id, "qcluster.attempt": job.attempts},
        ) for job, parent in zip(jobs, parents, strict=True)]
        token = None
        if len(spans) == 1:  # the handler's own spans are the job's children
            token = otel_context.attach(trace.set_span_in_context(spans[0]))
        try:
            busy_s = run()
        finally:
            if token is not None:
                otel_context.detach(token)
            _end(spans, jobs)
        if any(job.outcome == "error" for job in jobs):
            batch.set_status(trace.Status(trace.StatusCode.ERROR))
    return busy_s


def _end(spans: list[Any], jobs: list[Job]) -> None:
    for span, job in zip(spans, jobs, strict=True):
        if job.outcome == "error":
            if job.exception is not None:
                span.record_exception(job.exception)
            span.set_status(trace.Status(trace.StatusCode.ERROR, job.error))
        elif job.outcome is not None:
            span.set_attribute("qcluster.outcome", job.outcome)
        span.end()

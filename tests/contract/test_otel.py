"""OpenTelemetry: one trace from ``Client.enqueue`` to the handler's own span, through the
job's headers and a real broker (the SDK's in-memory exporter collects the spans)."""

from __future__ import annotations

import pytest

from qcluster import App, Client, Job, otel
from tests.contract.test_async_outcomes import make_runner, run_until

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
export = pytest.importorskip("opentelemetry.sdk.trace.export")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")


@pytest.fixture(scope="module")
def exporter() -> object:
    spans = in_memory.InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(spans))
    trace.set_tracer_provider(provider)  # once per process: the global provider
    otel._until_recheck = 0  # an earlier test of this process may have looked already
    return spans


def test_one_trace_from_enqueue_to_the_handlers_span(
    exporter: object, redis_url: str, queue_name: str
) -> None:
    app = App()
    tracer = trace.get_tracer("test")

    @app.queue(queue_name, batch_size=1, max_attempts=2, retry_base_delay=0.01,
               retry_max_delay=0.01)
    def handle(jobs: list[Job]) -> None:
        with tracer.start_as_current_span("inside the handler"):
            if jobs[0].attempts == 1:
                raise ValueError("first attempt fails")

    client = Client(redis_url)
    with tracer.start_as_current_span("web request"):
        job_id = client.enqueue(queue_name, {"to": "a@example.com"})
    runner = make_runner(app, queue_name, redis_url)
    run_until(runner, lambda: len(_named(exporter, "inside the handler")) == 2)

    (request,) = _named(exporter, "web request")
    (enqueue,) = _named(exporter, f"qcluster enqueue {queue_name}")
    jobs = _named(exporter, f"qcluster job {queue_name}")
    inside = _named(exporter, "inside the handler")
    batches = _named(exporter, f"qcluster batch {queue_name}")
    trace_id = request.context.trace_id
    assert {s.context.trace_id for s in [enqueue, *jobs, *inside]} == {trace_id}
    assert enqueue.parent.span_id == request.context.span_id
    assert enqueue.kind == trace.SpanKind.PRODUCER
    assert [s.parent.span_id for s in jobs] == [enqueue.context.span_id] * 2
    assert [s.attributes["messaging.message.id"] for s in jobs] == [job_id] * 2
    assert sorted(s.parent.span_id for s in inside) == sorted(s.context.span_id for s in jobs)
    first, second = sorted(jobs, key=lambda s: s.attributes["qcluster.attempt"])
    assert first.status.status_code == trace.StatusCode.ERROR
    assert [e.name for e in first.events] == ["exception"]
    assert second.status.status_code == trace.StatusCode.UNSET
    assert all(b.links[0].context.trace_id == trace_id for b in batches)


def _named(exporter: object, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]  # type: ignore[attr-defined]

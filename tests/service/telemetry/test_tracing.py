"""Traces end to end: a real OTLP/gRPC receiver in-process, the server's
exporter pointed at it through ``OTEL_EXPORTER_OTLP_ENDPOINT``, requests
sent over real gRPC with a W3C ``traceparent``. The KV pool is tiny
(4-token blocks) so preemption and queueing happen on demand."""

from __future__ import annotations

import io
import json
import logging
import os
import secrets
from collections.abc import Iterator

import pytest
import structlog
from server_thread import ServerThread

from slipstream.clients import Client
from slipstream.service.bench.otlp_receiver import OtlpReceiver, attributes
from slipstream.service.engine.config import EngineConfig
from slipstream.service.telemetry.tracing import Telemetry, is_tracing_configured, tracer_provider

CONFIG = EngineConfig(
    model="tiny",
    dtype="float32",
    block_size=4,
    num_device_blocks=16,  # 64 tokens: three 50-token requests cannot all stay resident
    num_host_blocks=8,
    max_model_len=64,
    max_num_batched_tokens=8,  # 20-token prompts prefill in chunks
)
TOKEN_ATTRIBUTES = {
    "slipstream.token.index",
    "slipstream.batch.id",
    "slipstream.batch.size",
    "slipstream.step",
    "slipstream.queue.wait_ms",
}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    rec = OtlpReceiver().start()
    yield rec
    rec.stop()


@pytest.fixture(scope="module")
def server(receiver: OtlpReceiver, engine: object) -> Iterator[ServerThread]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: export promptly
        env.delenv("OTEL_TRACES_EXPORTER", raising=False)
        env.delenv("OTEL_SDK_DISABLED", raising=False)
        telemetry = Telemetry(tracer_provider(os.environ))
    assert telemetry.provider is not None
    srv = ServerThread(engine, telemetry=telemetry)
    yield srv
    srv.stop()
    telemetry.shutdown()


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target) as c:
        yield c


def caller_context() -> tuple[str, str, dict[str, str]]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def request_spans(receiver: OtlpReceiver, trace_id: str, count: int) -> list:
    """The ``count`` request spans of a trace, once exported."""

    def mine(spans: list) -> list:
        return [
            s
            for s in spans
            if s.trace_id.hex() == trace_id and s.name.startswith("text_completion ")
        ]

    receiver.wait_for(lambda spans: len(mine(spans)) >= count)
    return mine(receiver.spans())


def children(receiver: OtlpReceiver, span: object, name: str) -> list:
    span_id = span.span_id  # type: ignore[attr-defined]
    return [s for s in receiver.spans() if s.parent_span_id == span_id and s.name == name]


def token_events(span: object) -> list[dict[str, object]]:
    events = [e for e in span.events if e.name == "slipstream.token"]  # type: ignore[attr-defined]
    return [attributes(e) for e in events]


def test_request_span_is_in_the_callers_trace_with_one_event_per_token(
    client: Client, receiver: OtlpReceiver
) -> None:
    trace_id, parent_id, metadata = caller_context()
    prompt = list(range(5, 25))  # 20 tokens: three prefill chunks at 8 tokens/step
    result = client.generate(
        prompt, metadata=metadata, max_tokens=12, ignore_eos=True, seed=7, priority=2
    ).result(timeout=60)
    assert result.output_tokens == 12

    (span,) = request_spans(receiver, trace_id, 1)
    assert span.parent_span_id.hex() == parent_id
    attrs = attributes(span)
    assert span.name == "text_completion tiny"
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 12
    assert attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.usage.input_tokens"] == 20
    assert attrs["gen_ai.usage.output_tokens"] == 12
    assert attrs["gen_ai.response.finish_reasons"] == ["max_tokens"]
    assert attrs["slipstream.request.priority"] == 2

    tokens = token_events(span)
    assert len(tokens) == 12, "exactly one slipstream.token event per generated token"
    assert [t["slipstream.token.index"] for t in tokens] == list(range(12))
    for t in tokens:
        assert set(t) == TOKEN_ATTRIBUTES
        assert t["slipstream.batch.id"] == t["slipstream.step"]
        assert t["slipstream.batch.size"] >= 1
        assert t["slipstream.queue.wait_ms"] >= 0
    steps = [t["slipstream.step"] for t in tokens]
    assert steps == sorted(steps) and len(set(steps)) == 12, "one token per step, in order"

    prefills = children(receiver, span, "slipstream.prefill")
    assert sum(attributes(p)["slipstream.prefill.num_tokens"] for p in prefills) == 20
    assert len(prefills) == 3
    assert len(children(receiver, span, "slipstream.queue")) == 1
    assert len(children(receiver, span, "slipstream.decode")) == 1


def test_the_submits_own_trace_context_wins_over_the_calls(
    client: Client, receiver: OtlpReceiver
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    caller = TracerProvider().get_tracer("caller")
    _, _, other_metadata = caller_context()  # on the call; the submit carries its own
    with caller.start_as_current_span("handle_user_request") as parent:
        client.generate([5, 6, 7], metadata=other_metadata, max_tokens=3).result(timeout=60)
    context = parent.get_span_context()
    (span,) = request_spans(receiver, trace.format_trace_id(context.trace_id), 1)
    assert span.parent_span_id.hex() == trace.format_span_id(context.span_id)


def test_preemption_and_queueing_are_traced_when_the_kv_pool_is_too_small(
    client: Client, receiver: OtlpReceiver
) -> None:
    trace_id, _, metadata = caller_context()
    stream = client.stream(metadata)
    generations = [
        stream.generate(list(range(5 + i, 15 + i)), max_tokens=40, ignore_eos=True)
        for i in range(3)
    ]
    results = [g.result(timeout=120) for g in generations]
    stream.close()
    spans = request_spans(receiver, trace_id, 3)

    by_id = {attributes(s)["slipstream.request.client_id"]: s for s in spans}
    for result in results:
        span = by_id[result.request_id]
        assert len(token_events(span)) == result.output_tokens == 40
    preempted = [s for s in spans if attributes(s)["slipstream.preemptions"] > 0]
    assert preempted, "a 16-block pool cannot hold three 50-token requests"
    for span in preempted:
        names = [e.name for e in span.events]
        assert "slipstream.preempt" in names and "slipstream.resume" in names
        pauses = children(receiver, span, "slipstream.preempted")
        assert len(pauses) == attributes(span)["slipstream.preemptions"]
        kinds = {attributes(p)["slipstream.preemption.kind"] for p in pauses}
        assert kinds <= {"swap", "recompute"}
        if "swap" in kinds:
            assert attributes(span)["slipstream.swapped_bytes"] > 0
        # The wait while preempted is added to the queue wait of later tokens.
        waits = [t["slipstream.queue.wait_ms"] for t in token_events(span)]
        assert waits == sorted(waits) and waits[-1] > waits[0]
    waits = [
        attributes(e)["slipstream.queue.wait_ms"]
        for s in spans
        for e in s.events
        if e.name == "slipstream.scheduled"
    ]
    assert len(waits) == 3 and max(waits) > 0


def test_a_cancelled_requests_span_ends_with_its_status(
    client: Client, receiver: OtlpReceiver
) -> None:
    trace_id, _, metadata = caller_context()
    stream = client.stream(metadata)
    generation = stream.generate([5, 6, 7, 8], max_tokens=58, ignore_eos=True)
    next(iter(generation))  # running: at least one token out
    generation.cancel()
    result = generation.result(timeout=60)
    stream.close()
    assert result.finish_reason == "cancelled"

    (span,) = request_spans(receiver, trace_id, 1)
    attrs = attributes(span)
    assert attrs["gen_ai.response.finish_reasons"] == ["cancelled"]
    assert attrs["rpc.grpc.status_code"] == 1  # CANCELLED
    assert span.status.code == span.status.STATUS_CODE_ERROR
    assert span.status.message.startswith("CANCELLED")
    assert len(token_events(span)) == result.output_tokens < 58


def test_a_rejected_submit_is_traced_with_its_reason(
    client: Client, receiver: OtlpReceiver
) -> None:
    trace_id, parent_id, metadata = caller_context()
    result = client.generate(list(range(5, 105)), metadata=metadata, max_tokens=4).result(60)
    assert result.finish_reason == "rejected"
    (span,) = request_spans(receiver, trace_id, 1)
    assert span.parent_span_id.hex() == parent_id
    assert attributes(span)["slipstream.rejection.reason"] == "prompt_too_long"
    assert span.status.code == span.status.STATUS_CODE_ERROR


def test_request_log_lines_carry_request_and_trace_ids(
    client: Client, server: ServerThread
) -> None:
    from slipstream.service.telemetry.logs import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    out = io.StringIO()
    configure_logging("info", "json", out)
    try:
        trace_id, _, metadata = caller_context()
        client.generate([5, 6, 7], metadata=metadata, max_tokens=2).result(timeout=60)
        refused = client.generate([5] * 100_000, metadata=metadata, max_tokens=2)
        assert refused.result(timeout=60).reject_reason == "prompt_too_long"
        assert server.telemetry.requests.flush(timeout=10)  # lines are written off-thread
    finally:
        structlog.reset_defaults()
        root.handlers[:], root.level = saved
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    (line,) = [x for x in lines if x["event"] == "request_finished"]
    assert line["trace_id"] == trace_id
    assert len(line["span_id"]) == 16 and line["request_id"].endswith("/r0")
    assert line["level"] == "info" and line["output_tokens"] == 2
    # A refusal's line names the request as a finished one does: the
    # server's stream-scoped id, and the caller's own beside it.
    (line,) = [x for x in lines if x["event"] == "request_rejected"]
    stream, _, request_id = line["request_id"].rpartition("/")
    assert stream and request_id == "r0"
    assert line["client_request_id"] == "r0" and line["trace_id"] == trace_id


@pytest.mark.parametrize(
    ("environ", "enabled"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_is_on_only_when_an_exporter_is_configured(
    environ: dict[str, str], enabled: bool
) -> None:
    assert is_tracing_configured(environ) is enabled
    if not enabled:
        assert tracer_provider(environ) is None

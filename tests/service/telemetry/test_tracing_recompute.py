"""Traces of requests preempted by recompute, end to end on the ``tiny``
model: no host pool, so every preemption drops the request's KV, and its full
blocks stay in the prefix cache for the resume to find."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from server_thread import ServerThread

from slipstream.clients import Client
from slipstream.service.engine.config import EngineConfig
from slipstream.service.telemetry.tracing import Telemetry

CONFIG = EngineConfig(
    model="tiny",
    dtype="float32",
    block_size=4,
    num_device_blocks=16,  # 64 tokens: three 50-token requests cannot all stay resident
    num_host_blocks=0,  # no swapping: every preemption is a recompute
    max_model_len=64,
)


@pytest.fixture(scope="module")
def served(engine: object) -> Iterator[tuple[ServerThread, Telemetry, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(provider)
    srv = ServerThread(engine, telemetry=telemetry)
    yield srv, telemetry, exporter
    srv.stop()
    telemetry.shutdown()


def test_every_recompute_resume_has_a_prefill_span_with_its_cached_tokens(
    served: tuple[ServerThread, Telemetry, InMemorySpanExporter],
) -> None:
    server, telemetry, exporter = served
    with Client(server.target) as client:
        stream = client.stream()
        generations = [
            stream.generate(list(range(5 + i, 15 + i)), max_tokens=40, ignore_eos=True)
            for i in range(3)
        ]
        assert [g.result(timeout=120).output_tokens for g in generations] == [40, 40, 40]
        stream.close()
    assert telemetry.requests.flush(10)
    spans = exporter.get_finished_spans()

    def children(parent: ReadableSpan, name: str) -> list[ReadableSpan]:
        return [
            s
            for s in spans
            if s.name == name
            and s.parent is not None
            and s.parent.span_id == parent.context.span_id
        ]

    requests = [s for s in spans if s.name.startswith("text_completion")]
    assert len(requests) == 3
    resumes = 0
    for request in requests:
        prefills = {s.start_time: s for s in children(request, "slipstream.prefill")}
        first = min(prefills)
        assert prefills[first].attributes["slipstream.prefill.cached_tokens"] == 0  # no prefix
        for pause in children(request, "slipstream.preempted"):
            assert pause.attributes["slipstream.preemption.kind"] == "recompute"
            resumes += 1
            # The resume's prefill starts as the pause ends, however little it computes.
            resume = prefills[pause.end_time].attributes
            cached = resume["slipstream.prefill.cached_tokens"]
            assert cached == resume["slipstream.prefill.start_pos"] and cached % 4 == 0
            assert resume["slipstream.prefill.num_tokens"] >= 1
    assert resumes > 0, "a 16-block pool cannot hold three 50-token requests"

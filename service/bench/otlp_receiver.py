"""A minimal in-process OTLP/gRPC trace receiver on a loopback port, built
from ``opentelemetry-proto``'s collector ``TraceService`` stubs.

It stands in for Jaeger or a collector in tests and in ``bench serve
--trace-overhead``: the exporter talks real OTLP over real gRPC to it.
With ``keep_spans=False`` it only counts, so a long benchmark does not hold
every span in memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

_OPTIONS = [("grpc.max_receive_message_length", 256 * 2**20)]


class _TraceService(tpb_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(
        self, request: tpb.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> tpb.ExportTraceServiceResponse:
        self._receiver.add(request)
        return tpb.ExportTraceServiceResponse()


class OtlpReceiver:
    """``start()`` binds ``127.0.0.1:0``; ``endpoint`` is what
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` should say."""

    def __init__(self, keep_spans: bool = True) -> None:
        self._keep = keep_spans
        self._lock = threading.Condition()
        self._spans: list[Span] = []
        self.num_spans = 0
        self.num_events = 0
        self.event_counts: dict[str, int] = {}  # by event name
        self.num_exports = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=_OPTIONS)
        tpb_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def add(self, request: tpb.ExportTraceServiceRequest) -> None:
        spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        with self._lock:
            self.num_exports += 1
            self.num_spans += len(spans)
            for span in spans:
                self.num_events += len(span.events)
                for event in span.events:
                    self.event_counts[event.name] = self.event_counts.get(event.name, 0) + 1
            if self._keep:
                self._spans.extend(spans)
            self._lock.notify_all()

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, predicate: Callable[[list[Span]], bool], timeout: float = 10.0
    ) -> list[Span]:
        """The spans once ``predicate`` holds for them; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(self._spans):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"spans never matched; have {len(self._spans)}")
                self._lock.wait(remaining)
            return list(self._spans)


def attributes(item: object) -> dict[str, object]:
    """A span's or event's OTLP attributes as a plain dict."""
    out: dict[str, object] = {}
    for kv in item.attributes:  # type: ignore[attr-defined]
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind) if kind else None
    return out

"""Tracing setup from the standard ``OTEL_*`` environment, W3C context
extraction, and ``Telemetry``: what the gRPC layer and the engine share.

Tracing is on when an OTLP endpoint is configured
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)
or ``OTEL_TRACES_EXPORTER`` names ``otlp`` / ``console``; it is off when
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. The SDK itself
reads the rest (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*``, exporter headers and TLS).
Spans go through a ``BatchSpanProcessor``: export never runs on the engine
thread. The provider is Slipstream's own, not the process-global one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import structlog
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)

from slipstream.service.engine.observer import EngineObserver, ObserverGroup
from slipstream.service.telemetry.metrics import ServerMetrics
from slipstream.service.telemetry.request_trace import Refusal, RequestTracer, WireStatus

if TYPE_CHECKING:
    from slipstream.service.engine.engine import Engine
    from slipstream.service.engine.events import FinishEvent, RequestSpec

log = structlog.get_logger(__name__)

# One span event per generated token: the SDK's default cap (128) would drop
# the tail of any longer answer. OTEL_SPAN_EVENT_COUNT_LIMIT still wins.
DEFAULT_MAX_EVENTS = 65536
# Request spans carry one event per token (~100 bytes each in OTLP); smaller
# export batches keep a request under the receivers' usual 4 MiB message cap.
DEFAULT_MAX_EXPORT_BATCH = 32
_ON = ("otlp", "console")


def is_tracing_configured(environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",")}
    if "none" in exporters:
        return False
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return bool(endpoint) or any(e in _ON for e in exporters)


def _exporters(environ: Mapping[str, str]) -> list[SpanExporter]:
    names = {e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    exporters: list[SpanExporter] = []
    if "console" in names:
        exporters.append(ConsoleSpanExporter())
    if "otlp" in names or not exporters:
        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
        )
        if protocol != "grpc":
            log.warning("otlp_protocol_unsupported", protocol=protocol, using="grpc")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    return exporters


def _resource(environ: Mapping[str, str]) -> Resource:
    resource = Resource.create({})
    if "OTEL_SERVICE_NAME" not in environ and str(
        resource.attributes.get(SERVICE_NAME, "")
    ).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "slipstream"}))
    return resource


def tracer_provider(environ: Mapping[str, str]) -> TracerProvider | None:
    """A provider exporting as ``environ`` says, or None when tracing is off."""
    if not is_tracing_configured(environ):
        return None
    limits = SpanLimits(
        max_events=None if "OTEL_SPAN_EVENT_COUNT_LIMIT" in environ else DEFAULT_MAX_EVENTS
    )
    provider = TracerProvider(resource=_resource(environ), span_limits=limits)
    batch = None if "OTEL_BSP_MAX_EXPORT_BATCH_SIZE" in environ else DEFAULT_MAX_EXPORT_BATCH
    for exporter in _exporters(environ):
        provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=batch))
    return provider


def extract_context(
    metadata: Iterable[tuple[str, str | bytes]], trace_context: Mapping[str, str]
) -> Context:
    """The caller's context: the submit's own ``trace_context`` when it has
    a ``traceparent``, else the call metadata's (W3C, via the configured
    propagators)."""
    if "traceparent" in trace_context:
        return propagate.extract(dict(trace_context))
    carrier = {k.lower(): v for k, v in metadata if isinstance(v, str)}
    return propagate.extract(carrier)


class Telemetry:
    """Per-request tracing and request log lines (always), metrics (when
    given). ``attach`` hooks it into an engine; the gRPC layer calls
    ``begin`` / ``abandon`` / ``rejected`` from the event loop."""

    def __init__(
        self, provider: TracerProvider | None = None, metrics: ServerMetrics | None = None
    ) -> None:
        self.provider = provider
        self.metrics = metrics
        tracer = provider.get_tracer("slipstream") if provider is not None else trace.NoOpTracer()
        self.requests = RequestTracer(tracer)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], metrics: ServerMetrics | None = None
    ) -> Telemetry:
        provider = tracer_provider(environ)
        log.info("tracing_configured", enabled=provider is not None)
        return cls(provider, metrics)

    def attach(self, engine: Engine) -> None:
        """Observe ``engine``; set while it is idle (ideally before start)."""
        self.requests.bind_engine(engine)
        observers: list[EngineObserver] = [self.requests]
        if self.metrics is not None:
            self.metrics.bind_engine(engine)
            observers.append(self.metrics)
        engine.observer = observers[0] if len(observers) == 1 else ObserverGroup(observers)

    def begin(
        self,
        request: RequestSpec,
        client_request_id: str,
        metadata: Iterable[tuple[str, str | bytes]],
        trace_context: Mapping[str, str],
    ) -> None:
        """Before ``engine.submit``: the request's span, child of its caller's."""
        parent = extract_context(metadata, trace_context)
        self.requests.begin(request, client_request_id, parent)

    def abandon(self, req_id: str) -> None:
        """``engine.submit`` refused the request begun under ``req_id``."""
        self.requests.abandon(req_id)

    def rejected(
        self,
        client_request_id: str,
        reason: str,
        status: WireStatus,
        message: str,
        metadata: Iterable[tuple[str, str | bytes]],
        trace_context: Mapping[str, str],
        tenant: str = "",
        req_id: str = "",
        refusal: Refusal | None = None,
    ) -> None:
        """A submit refused before the engine took it; ``reason`` as on the wire
        (``queue_full``), ``status`` the gRPC status it was refused with,
        ``tenant`` the caller's (empty on a server without tenants), ``req_id``
        the server's id for it where that differs from the caller's (a gRPC
        stream's ``<stream>/<request_id>``, as its finished line would say),
        ``refusal`` its arrival, priority, expired limit and retry hint."""
        parent = extract_context(metadata, trace_context)
        reason = self.requests.rejected(
            client_request_id, reason, status, message, parent, tenant, req_id, refusal
        )
        if self.metrics is not None:
            self.metrics.rejected(reason, tenant, None if refusal is None else refusal.priority)

    def unadmitted(
        self,
        event: FinishEvent,
        client_request_id: str,
        arrival: float,
        metadata: Iterable[tuple[str, str | bytes]],
        trace_context: Mapping[str, str],
        tenant: str = "",
    ) -> None:
        """A submit that finished before the engine took it (cancelled while
        its prompt was tokenized): traced, logged and counted as a finished
        request, from its ``arrival``."""
        parent = extract_context(metadata, trace_context)
        self.requests.unadmitted(event, client_request_id, arrival, parent, tenant)
        if self.metrics is not None:
            self.metrics.unadmitted(event, tenant)

    def unauthenticated(self, method: str, peer: str, message: str) -> None:
        """A call refused for want of a valid bearer token (never logs the token)."""
        log.warning("call_unauthenticated", method=method, peer=peer, detail=message)
        if self.metrics is not None:
            self.metrics.call_refused("unauthenticated")

    def not_serving(self, method: str, peer: str, reason: str, message: str) -> None:
        """A call refused because the server is loading or draining; ``reason``
        as on the wire (``loading``, ``draining``)."""
        log.info("call_refused", method=method, peer=peer, reason=reason, detail=message)
        if self.metrics is not None:
            self.metrics.call_refused(reason)

    def shutdown(self) -> None:
        """Record finished requests still queued, then flush buffered spans
        (bounded by the exporter's timeout)."""
        self.requests.close()
        if self.provider is not None:
            self.provider.shutdown()

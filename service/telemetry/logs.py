"""Structured logs: structlog renders every line, its own and the standard
library's (grpc, urllib3, opentelemetry...), as JSON by default or for a
human on a TTY.

Every line logged while an OpenTelemetry span is current carries its
``trace_id`` / ``span_id``; request lines (``request_finished``,
``request_rejected``) carry ``request_id`` and their request span's ids
explicitly, since they are written on the engine thread where no span is
current.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog
from opentelemetry import trace

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("auto", "json", "console")


def _add_trace_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    if "trace_id" not in event:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            event["trace_id"] = trace.format_trace_id(context.trace_id)
            event["span_id"] = trace.format_span_id(context.span_id)
    return event


def _renderer(fmt: str, stream: TextIO) -> Any:
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    if fmt == "console":
        return structlog.dev.ConsoleRenderer()
    return structlog.processors.JSONRenderer()


# Each module's logger is built once, on its first line (the cheap path). The
# test suite turns it off: a cached logger keeps the processors of the
# configuration it was built under, out of reach of structlog's capture_logs.
CACHE_LOGGERS = True


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Routes structlog and the standard library through one handler on
    ``stream`` (stderr). Idempotent: a second call replaces the first."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}")
    stream = sys.stderr if stream is None else stream
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_ids,
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=CACHE_LOGGERS,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _renderer(fmt, stream),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

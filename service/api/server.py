"""The gRPC server: ``slipstream.v1.Inference`` plus the standard health and
reflection services, always on.

``create_server`` builds a server around a loaded engine (tests use it on port
0); ``run`` is the process's life: listen while loading (health NOT_SERVING),
serve, and on SIGTERM/SIGINT drain within a grace period, then stop.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from slipstream.service.api.http.app import HttpFront
from slipstream.service.api.lifecycle import Lifecycle
from slipstream.service.api.limits import Limits
from slipstream.service.api.servicer import InferenceServicer, add_to_server
from slipstream.service.api.status import finish_status
from slipstream.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from slipstream.service.engine.engine import Engine
    from slipstream.service.telemetry.tracing import Telemetry

log = structlog.get_logger(__name__)


class StartupFailed(Exception):
    """The engine could not be loaded; the message says what failed and what to do.

    Raised by ``run`` after the listening server is stopped, so nothing of the
    half-started process is left to fail again while the interpreter exits.
    """


SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["Inference"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


def _channel_options(limits: Limits) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
    ]


def connection_age_options(max_age_s: float | None, grace_s: float | None) -> list[tuple[str, int]]:
    """Server options of gRPC's A9 proposal: after ``max_age_s`` a connection
    is sent GOAWAY (clients open a new one, maybe to another replica, for new
    calls); calls already on it get ``grace_s`` more to finish."""
    options = []
    if max_age_s is not None:
        if max_age_s <= 0:
            raise ValueError("the maximum connection age must be positive")
        options.append(("grpc.max_connection_age_ms", round(max_age_s * 1000)))
    if grace_s is not None:
        if grace_s < 0:
            raise ValueError("the connection age grace must not be negative")
        options.append(("grpc.max_connection_age_grace_ms", round(grace_s * 1000)))
    return options


def build_server(
    lifecycle: Lifecycle,
    host: str,
    port: int,
    telemetry: Telemetry | None = None,
    options: Sequence[tuple[str, object]] = (),
    limits: Limits | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A server (not started) for ``lifecycle``; returns it and the bound port.
    ``options`` are extra gRPC server options (``connection_age_options``)."""
    limits = limits or Limits()
    server = grpc.aio.server(options=[*_channel_options(limits), *options])
    if telemetry is not None:
        telemetry.requests.finish_status = finish_status
    add_to_server(InferenceServicer(lifecycle, telemetry, limits), server)
    health_pb2_grpc.add_HealthServicer_to_server(lifecycle.health, server)
    reflection.enable_server_reflection(SERVICE_NAMES, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, bound


async def create_server(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    telemetry: Telemetry | None = None,
    options: Sequence[tuple[str, object]] = (),
    limits: Limits | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A started server around a loaded engine, health SERVING; ``telemetry``
    (if given) is attached to the engine."""
    lifecycle = Lifecycle(engine)
    server, bound = build_server(lifecycle, host, port, telemetry, options, limits)
    if telemetry is not None:
        telemetry.attach(engine)
    await server.start()
    await lifecycle.serve()
    return server, bound


async def shutdown(
    server: grpc.aio.Server, lifecycle: Lifecycle, grace_s: float, http: HttpFront | None = None
) -> None:
    """Drain: refuse new work, let running requests finish within ``grace_s``
    (then they are cancelled), stop the server(s) and the engine."""
    await lifecycle.drain()
    deadline = time.monotonic() + grace_s
    engine = lifecycle.engine
    await asyncio.to_thread(engine.wait_idle, grace_s)
    # Streams whose requests all finished are ending now; give them the rest.
    await server.stop(max(deadline - time.monotonic(), 0.5))
    await asyncio.to_thread(engine.shutdown)
    if http is not None:
        # After the engine: HTTP requests still running past the grace have
        # been cancelled by now, and their handlers have answered.
        await http.stop()


def startup_message(exc: BaseException) -> str:
    """``exc`` from loading a model, as one line an operator can act on."""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    # ValueError covers bad flags, unsupported checkpoints and weight packing
    # refused by the CPU (kernels.linear.WeightPackingFailed).
    if isinstance(exc, ValueError | FileNotFoundError):
        return f"cannot load the model: {detail}"
    if isinstance(exc, MemoryError):
        return f"out of memory loading the model ({detail}); lower --kv-cache-gb"
    return (
        f"cannot load the model: {type(exc).__name__}: {detail} "
        "(run with SLIPSTREAM_LOG_LEVEL=debug and check the model path and --dtype)"
    )


async def run(
    load_engine: Callable[[], Engine],
    host: str,
    port: int,
    grace_s: float,
    on_ready: Callable[[int, Engine], None] | None = None,
    telemetry: Telemetry | None = None,
    http_port: int = 0,
    on_http: Callable[[int], None] | None = None,
    options: Sequence[tuple[str, object]] = (),
    limits: Limits | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully. With an
    ``http_port`` (0: none) the OpenAI-compatible front listens there too,
    on this event loop and engine; ``on_http`` gets its bound port."""
    lifecycle = Lifecycle()
    server, bound = build_server(lifecycle, host, port, telemetry, options, limits)
    http = None if not http_port else HttpFront(lifecycle, telemetry)
    await server.start()
    if http is not None:
        try:
            http_bound = await http.start(host, http_port)
        except OSError as exc:
            await server.stop(None)
            raise StartupFailed(f"cannot listen for HTTP on {host}:{http_port}: {exc}") from None
        log.info("http_listening", host=host, port=http_bound)
        if on_http is not None:
            on_http(http_bound)
    await lifecycle.report_loading()
    log.info("server_loading", host=host, port=bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        engine = await asyncio.to_thread(load_engine)
    except Exception as exc:  # anything at all: the process must end with one clear line
        log.debug("server_start_failed", exc_info=True)  # the traceback, only when asked for
        await server.stop(None)
        if http is not None:
            await http.stop()
        raise StartupFailed(startup_message(exc)) from None
    if telemetry is not None:
        telemetry.attach(engine)
    await lifecycle.serve(engine)
    log.info("server_serving", host=host, port=bound, model=engine.info.name)
    if on_ready is not None:
        on_ready(bound, engine)
    await stop.wait()
    log.info("server_draining", grace_s=grace_s)
    await shutdown(server, lifecycle, grace_s, http)
    if telemetry is not None:
        await asyncio.to_thread(telemetry.shutdown)
    log.info("server_stopped")

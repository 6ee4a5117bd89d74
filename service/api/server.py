"""The gRPC server: ``slipstream.v1.Inference`` plus the standard health and
reflection services, always on.

``create_server`` builds a server around a loaded engine (tests use it on port
0); ``run`` is the process's life: listen while loading (health NOT_SERVING),
serve, and on SIGTERM/SIGINT drain within a grace period, then stop (or,
while still loading or at a second signal, stop at once); on
SIGHUP re-read the tenants file.

Security sits at this edge: TLS (optionally mutual) from ``tls.py``, the same
files on the HTTP front (HTTPS); with tenants, the servicer refuses any
``slipstream.v1.Inference`` call without a known bearer token
(UNAUTHENTICATED) and the session applies each tenant's per-request limits.
Health and reflection stay open. (Not a server interceptor: with one
installed, grpc.aio clients often see an early abort as INTERNAL instead of
its real status.)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from slipstream.service.api.auth import Tenants, TenantsFileError, load_tenants
from slipstream.service.api.http.app import HttpFront
from slipstream.service.api.lifecycle import Lifecycle
from slipstream.service.api.limits import Limits
from slipstream.service.api.servicer import InferenceServicer, add_to_server
from slipstream.service.api.status import finish_status
from slipstream.service.api.tls import CertificateFiles, ServerTLS
from slipstream.service.api.workers import WorkerPool
from slipstream.service.engine.gc_heap import frozen_heap
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


# What streams get to send their cut-off requests' Finished events.
FINISHED_SEND_S = 0.5


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


# Keepalive (gRPC A8): a connection quiet for KEEPALIVE_S is pinged, and
# closed when the ping is not answered within KEEPALIVE_TIMEOUT_S; its calls
# end, their requests cancelled. Without it a peer that vanished without
# closing its connection (a machine gone, a frozen client) held its streams
# and the connection for gRPC's default of 2 hours.
KEEPALIVE_S = 60.0
KEEPALIVE_TIMEOUT_S = 20.0
# Clients' own pings are taken every MIN_CLIENT_PING_S at most, with calls
# or without: half the 10 s floor that grpc-go and grpc-java put on a
# client's keepalive time, so no such client is sent GOAWAY "too_many_pings"
# (gRPC's default policy allows one ping per 5 minutes, 2 hours on a
# connection without calls). Past MAX_PING_STRIKES (gRPC's default) pings
# that come sooner with no data sent between them, the connection is closed.
MIN_CLIENT_PING_S = 5.0
MAX_PING_STRIKES = 2


def keepalive_options(
    time_s: float = KEEPALIVE_S,
    timeout_s: float = KEEPALIVE_TIMEOUT_S,
    min_client_ping_s: float = MIN_CLIENT_PING_S,
) -> list[tuple[str, int]]:
    """Server options: ping a connection quiet for ``time_s``, close it when
    a ping goes unanswered for ``timeout_s``; take clients' pings every
    ``min_client_ping_s``, also on a connection without calls."""
    if time_s <= 0 or timeout_s <= 0:
        raise ValueError("the keepalive time and timeout must be positive")
    if min_client_ping_s < 0:
        raise ValueError("the clients' ping interval must not be negative")
    timeout_ms = round(timeout_s * 1000)
    return [
        ("grpc.keepalive_time_ms", round(time_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # How long gRPC core (1.85 here) waits for any ping's ack,
        # keepalive's included: left at its 60 s default, an unanswered
        # keepalive ping closes the connection only then, whatever
        # keepalive_timeout_ms says.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", round(min_client_ping_s * 1000)),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]


def server_options(
    limits: Limits, options: Sequence[tuple[str, object]]
) -> list[tuple[str, object]]:
    """The gRPC server's options: message sizes, no SO_REUSEPORT, keepalive
    (``keepalive_options()``), then ``options``, each replacing a default of
    the same name (gRPC itself would keep the first)."""
    # No SO_REUSEPORT (gRPC's default): a second server on a busy port must
    # fail to start, not share the port and split its clients between them.
    defaults = [*_channel_options(limits), ("grpc.so_reuseport", 0), *keepalive_options()]
    return list(dict([*defaults, *options]).items())


def build_server(
    lifecycle: Lifecycle,
    host: str,
    port: int,
    telemetry: Telemetry | None = None,
    options: Sequence[tuple[str, object]] = (),
    limits: Limits | None = None,
    *,
    tls: ServerTLS | None = None,
    tenants: Tenants | None = None,
    workers: WorkerPool | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A server (not started) for ``lifecycle``; returns it and the bound port.
    ``options`` are extra gRPC server options (``connection_age_options``,
    ``keepalive_options``: they replace the defaults);
    ``tls``: serve TLS only (mutual with a client CA); ``tenants``: every
    inference call needs a bearer token of one of them; ``workers``: the
    tokenizer pool (one of its own when not given)."""
    limits = limits or Limits()
    server = grpc.aio.server(options=server_options(limits, options))
    if telemetry is not None:
        telemetry.requests.finish_status = finish_status
    servicer = InferenceServicer(lifecycle, telemetry, limits, tenants, workers)
    add_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(lifecycle.health, server)
    reflection.enable_server_reflection(SERVICE_NAMES, server)
    address = f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, CertificateFiles(tls).credentials())
    except RuntimeError:  # grpc's "Failed to bind": in use, or a host that does not resolve
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, bound


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as ``serve --host`` takes it) is reachable from this
    machine only."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposure_warning(
    host: str, has_tls: bool, has_tenants: bool, has_http: bool = False
) -> str | None:
    """Why listening on ``host`` this way lets anyone on the network in, or
    None when it does not (loopback, or TLS and tenants both on: the HTTP
    front then speaks HTTPS with the same files, as gRPC speaks TLS)."""
    if is_loopback(host) or (has_tls and has_tenants):
        return None
    where = f"listening on {host}, reachable from the network,"
    if has_tenants:
        fronts = "gRPC and HTTP calls" if has_http else "gRPC calls"
        return f"{where} without TLS: {fronts} would carry bearer tokens in the clear"
    missing = "tenants" if has_tls else "TLS (--tls-cert/--tls-key) or tenants"
    ports = "either port (gRPC, HTTP)" if has_http else "the port"
    return f"{where} without {missing}: anyone who reaches {ports} can submit work of any class"


def metrics_exposure_warning(metrics_host: str, has_tenants: bool) -> str | None:
    """Why the metrics port on ``metrics_host`` gives tenants' usage away, or
    None (loopback, or no tenants). It speaks plain HTTP with no token, for
    Prometheus, while the HTTP front's /metrics asks a tenant's token."""
    if not has_tenants or is_loopback(metrics_host):
        return None
    return (
        f"the metrics port listens on {metrics_host}, reachable from the network, in plain "
        "HTTP without a token: its /metrics names every tenant and its usage. "
        "--metrics-host 127.0.0.1 keeps it on this machine; else let only Prometheus reach it"
    )


def exposure_remedy(has_tls: bool, has_tenants: bool, http_port: int = 0) -> str:
    """What to do about ``exposure_warning``: the flags still missing, and,
    with the HTTP front on (``http_port``) and no TLS, how to turn it off."""
    missing = [
        flags
        for flags, is_on in (("--tls-cert/--tls-key", has_tls), ("--tenants", has_tenants))
        if not is_on
    ]
    both = " (gRPC and the HTTP front then both speak TLS)" if not has_tls and http_port else ""
    remedy = (
        f"Add {' and '.join(missing)}{both}, listen on 127.0.0.1, or pass --insecure "
        "if the network is trusted."
    )
    if not has_tls and http_port:
        remedy += (
            f"\nThe HTTP front listens on port {http_port} too (on by default): "
            "--http-port 0 turns it off."
        )
    return remedy


def _tls_mode(tls: ServerTLS | None) -> str:
    return "off" if tls is None else ("mutual" if tls.client_ca_file else "on")


def reload_tenants(tenants: Tenants, path: Path) -> bool:
    """Re-reads the tenants file into ``tenants``; a bad file keeps the old
    tenants and logs why. True when the new file was taken."""
    try:
        tenants.replace(load_tenants(path))
    except TenantsFileError as exc:
        log.error("tenants_reload_failed", detail=str(exc), keeping="the current tenants")
        return False
    log.info("tenants_reloaded", path=str(path), tenants=tenants.names)
    return True


async def create_server(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    telemetry: Telemetry | None = None,
    options: Sequence[tuple[str, object]] = (),
    limits: Limits | None = None,
    *,
    tls: ServerTLS | None = None,
    tenants: Tenants | None = None,
    workers: WorkerPool | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A started server around a loaded engine, health SERVING; ``telemetry``
    (if given) is attached to the engine."""
    lifecycle = Lifecycle(engine)
    server, bound = build_server(
        lifecycle, host, port, telemetry, options, limits, tls=tls, tenants=tenants, workers=workers
    )
    if telemetry is not None:
        telemetry.attach(engine)
    await server.start()
    await lifecycle.serve()
    return server, bound


async def shutdown(
    server: grpc.aio.Server,
    lifecycle: Lifecycle,
    grace_s: float,
    http: HttpFront | None = None,
    cut_short: asyncio.Event | None = None,
) -> None:
    """Drain: refuse new work, let running requests finish within ``grace_s``
    (then they end SHUTDOWN: CANCELLED, status UNAVAILABLE on the wire), stop
    the server(s) and the engine. Once ``cut_short`` is set (a second stop
    signal) the grace ends: running requests end so at once."""
    await lifecycle.drain()
    deadline = time.monotonic() + grace_s
    engine = lifecycle.engine
    idle = asyncio.ensure_future(asyncio.to_thread(engine.wait_idle, grace_s))
    waits = {idle} if cut_short is None else {idle, asyncio.ensure_future(cut_short.wait())}
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits - {idle}:
        wait.cancel()
    if idle.done() and idle.result():
        # Streams whose requests all finished are ending now; give them the rest.
        grace_left_s = max(deadline - time.monotonic(), 0.5)
    else:
        num_running = len(engine.live_output_counts())
        if idle.done():
            log.warning("server_grace_expired", grace_s=grace_s, num_running=num_running)
        else:
            log.warning("server_drain_cut_short", num_running=num_running)
        # Ended here, SHUTDOWN, before their calls close: a call the server
        # closes would end its requests CANCELLED, as a client's cancel does.
        await asyncio.to_thread(engine.shutdown)
        grace_left_s = FINISHED_SEND_S
    await server.stop(grace_left_s)
    await asyncio.to_thread(engine.shutdown)
    if http is not None:
        # After the engine: HTTP requests still running past the grace have
        # been cancelled by now, and their handlers have answered.
        await http.stop()


def _load_in_background(load_engine: Callable[[], Engine]) -> asyncio.Future[Engine]:
    """``load_engine()`` on a daemon thread: a stop signal during a load of
    minutes ends the process at once. (``asyncio.to_thread``'s threads are
    joined when the loop closes and again at interpreter exit, so the process
    would wait for the load to finish.)"""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Engine] = loop.create_future()

    def settle(engine: Engine | None, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is None:
            future.set_result(engine)  # type: ignore[arg-type]
        else:
            future.set_exception(exc)

    def load() -> None:
        engine, exc = None, None
        try:
            engine = load_engine()
        except BaseException as error:  # the caller's to handle, as with to_thread
            exc = error
        # A closed loop: the server stopped while loading; nobody waits for it.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, engine, exc)

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(load,), name="slipstream-load", daemon=True).start()
    return future


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
    *,
    tls: ServerTLS | None = None,
    tenants_file: Path | None = None,
) -> bool:
    """Serve until SIGTERM or SIGINT, then shut down gracefully, and return
    True; one that comes while the model loads stops the server at once and
    returns False: the load's thread is still running then, inside native
    code, and the process should end with ``os._exit`` (a normal exit's
    finalization under it can abort the process). With an
    ``http_port`` (0: none) the OpenAI-compatible front listens there too,
    on this event loop and engine; ``on_http`` gets its bound port. SIGHUP
    re-reads ``tenants_file``. A bad TLS or tenants file raises before
    anything listens (TLSFilesError, TenantsFileError)."""
    tenants = None if tenants_file is None else Tenants.from_file(tenants_file)
    lifecycle = Lifecycle()
    # One bounded tokenizer pool for both front doors: a flood on one cannot
    # take more threads than the limits allow.
    workers = WorkerPool.for_limits(limits or Limits())
    try:
        server, bound = build_server(
            lifecycle,
            host,
            port,
            telemetry,
            options,
            limits,
            tls=tls,
            tenants=tenants,
            workers=workers,
        )
    except OSError as exc:
        raise StartupFailed(f"{exc} (in use, or the host does not resolve)") from None
    http: HttpFront | None = None
    if http_port:  # the same limits as gRPC: a size refused there is refused here
        http = HttpFront(
            lifecycle, telemetry, tenants=tenants, workers=workers, limits=limits, tls=tls
        )
    # gRPC's health service says SERVING until told otherwise: a probe must
    # never hear that from a server whose model has not loaded.
    await lifecycle.report_loading()
    await server.start()
    if http is not None:
        try:
            http_bound = await http.start(host, http_port)
        except OSError as exc:
            await server.stop(None)
            raise StartupFailed(f"cannot listen for HTTP on {host}:{http_port}: {exc}") from None
        log.info("http_listening", host=host, port=http_bound, tls=_tls_mode(tls))
        if on_http is not None:
            on_http(http_bound)
    # Before server_loading is logged: from then on a stop signal is handled.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if tenants is not None and tenants_file is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_tenants, tenants, tenants_file)
    log.info(
        "server_loading",
        host=host,
        port=bound,
        tls=_tls_mode(tls),
        tenants=None if tenants is None else tenants.names,
    )
    loading = _load_in_background(load_engine)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait((loading, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not loading.done():
        # The load cannot be interrupted; its daemon thread dies with the process.
        log.info("server_stopped_while_loading", host=host, port=bound)
        await server.stop(None)
        if http is not None:
            await http.stop()
        if telemetry is not None:
            await asyncio.to_thread(telemetry.shutdown)
        return False
    try:
        engine = loading.result()
    except Exception as exc:  # anything at all: the process must end with one clear line
        log.debug("server_start_failed", exc_info=True)  # the traceback, only when asked for
        await server.stop(None)
        if http is not None:
            await http.stop()
        raise StartupFailed(startup_message(exc)) from None
    if telemetry is not None:
        telemetry.attach(engine)
    # Before SERVING: the one collection it makes stops every thread (gc_heap.py).
    with frozen_heap():
        await lifecycle.serve(engine)
        log.info("server_serving", host=host, port=bound, model=engine.info.name)
        if on_ready is not None:
            on_ready(bound, engine)
        await stop.wait()
        log.info("server_draining", grace_s=grace_s)
        # A second stop signal: the operator will not wait out the grace.
        cut_short = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, cut_short.set)
        await shutdown(server, lifecycle, grace_s, http, cut_short)
    if telemetry is not None:
        await asyncio.to_thread(telemetry.shutdown)
    log.info("server_stopped")
    return True

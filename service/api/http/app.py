"""The HTTP server: an aiohttp application on the running event loop (the
one the ``grpc.aio`` server uses), its routes, and its start and stop.

Routes::

    POST /v1/completions        text or token-id prompt
    POST /v1/chat/completions   messages, rendered with the model's chat template
    GET  /v1/models             the one model served
    GET  /v1/models/{model}     that model (404 for any other)
    GET  /health                200 while serving, 503 while loading or draining
    GET  /metrics               Prometheus, the same registry as --metrics-port

With a ``ServerTLS`` it speaks HTTPS only, with gRPC's files and rotation
(``tls.py``); with a client CA every client must present a certificate.
Each connection is made below the app, in ``connections.py``: capped at
accept, wrapped in its TLS layer, and answered there when aiohttp itself
cannot parse its request.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slipstream.service.api.auth import Tenants
from slipstream.service.api.http.connections import (
    PROTOCOL_LOG,
    TLS_HANDSHAKE_TIMEOUT_S,
    ConnectionCap,
    OpenAIProtocol,
    error_code,
)
from slipstream.service.api.http.errors import (
    ApiError,
    internal_error,
    model_not_found,
    too_large,
)
from slipstream.service.api.http.generation import Authenticator, Generations, not_serving
from slipstream.service.api.lifecycle import Lifecycle, NotServing, Phase
from slipstream.service.api.limits import Limits
from slipstream.service.api.tls import CertificateFiles, ServerTLS

if TYPE_CHECKING:
    from slipstream.service.api.workers import WorkerPool
    from slipstream.service.telemetry.tracing import Telemetry

# A body is one prompt of at most --max-prompt-bytes (text, or token ids in
# JSON) and a little else; bodies past the two are refused (413) before they
# are read in full. The whole body parses on the event loop (json.loads
# holds the GIL, so a thread would not help), at ~30 ms a MiB on a slow
# core: this bounds the stall one request can cause.
BODY_MARGIN_BYTES = 2**20

# What stop() gives handlers still running (after draining and the engine's
# shutdown, all of them have their answer already).
SHUTDOWN_TIMEOUT_S = 5.0

# aiohttp's default: how long an unread body is read after its answer.
LINGERING_S = 10.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = structlog.get_logger(__name__)


def openai_errors(max_body_bytes: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Middleware: every error, ours or aiohttp's (404 route, 405 method,
    413 body) or a bug's (500, its traceback logged), in OpenAI's JSON shape."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPRequestEntityTooLarge:
            return too_large(f"the request body is over {max_body_bytes} bytes").response()
        except web.HTTPException as exc:
            return _http_error(exc, request)
        except Exception:
            if request.writer.output_size > 0:
                raise  # a stream already begun: aiohttp closes the connection
            log.exception("http_request_failed", method=request.method, path=request.path)
            return internal_error().response()

    return middleware


def _http_error(exc: web.HTTPException, request: web.Request) -> web.StreamResponse:
    if exc.status < 400:
        raise exc  # a redirect is not an error
    message = exc.reason
    if exc.status == 404:
        message = _no_route(request.method, request.path)
    return ApiError(
        exc.status,
        message,
        code=error_code(exc.reason),
        headers={k: v for k, v in exc.headers.items() if k == "Allow"},
    ).response()


# OpenAI's paths, which this server serves under /v1 as OpenAI does.
_OPENAI_PATHS = ("/completions", "/chat/completions", "/models")


def _no_route(method: str, path: str) -> str:
    """A 404's message; a client whose base URL lacks /v1 is told so."""
    message = f"{method} {path} is not a route of this server"
    if path.startswith(_OPENAI_PATHS):
        message += f" (the API is under /v1: /v1{path}; a client's base URL ends in /v1)"
    return message


class HttpFront:
    """The OpenAI-compatible front door of one server process."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        telemetry: Telemetry | None = None,
        max_body_bytes: int | None = None,
        authenticate: Authenticator | None = None,
        tenants: Tenants | None = None,
        workers: WorkerPool | None = None,
        limits: Limits | None = None,
        tls: ServerTLS | None = None,
    ) -> None:
        """``tls``: the files are read here (TLSFilesError), before anything
        listens. ``max_body_bytes``: by default the prompt limit of
        ``limits`` plus ``BODY_MARGIN_BYTES``."""
        limits = limits or Limits()
        if max_body_bytes is None:
            max_body_bytes = limits.max_prompt_bytes + BODY_MARGIN_BYTES
        self._lifecycle = lifecycle
        self._certificates = None if tls is None else CertificateFiles(tls, front="http")
        self._telemetry = telemetry
        self._limits = limits
        self._created = int(time.time())
        generations = Generations(lifecycle, telemetry, authenticate, tenants, workers, limits)
        # With tenants, what names the model or the tenants asks a token as a
        # completion does (OpenAI's /v1/models does; /metrics lists tenants);
        # /health stays open for probes.
        self._check_token = generations.check_token
        self.app = web.Application(
            client_max_size=max_body_bytes, middlewares=[openai_errors(max_body_bytes)]
        )
        self.app.router.add_post("/v1/completions", generations.completions)
        self.app.router.add_post("/v1/chat/completions", generations.chat)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model:.+}", self.model)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.connections: ConnectionCap | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the bound port."""
        limits = self._limits
        sock = socket.create_server((host.strip("[]"), port))
        # Each connection's handler (RequestHandler's arguments).
        handler_args: dict[str, Any] = dict(
            access_log=None,
            logger=PROTOCOL_LOG,
            # aiohttp closes a connection this long without a whole request's
            # headers (from its start or its last answer; idle ones too).
            # The body's own timeout is the handler's (generation.py).
            keepalive_timeout=limits.http_read_timeout_s,
            # After an answer, the rest of an unread body is read (so the
            # client sees the answer) for at most as long, then it is closed.
            lingering_time=min(LINGERING_S, limits.http_read_timeout_s),
        )
        self._runner = web.AppRunner(
            self.app,
            # Cancel a handler the moment its client disconnects: that is
            # what frees the request's KV while it still waits in the queue.
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            **handler_args,
        )
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        certificates = self._certificates
        self.connections = ConnectionCap(
            # What server() would make (requests go to the app), of the subclass.
            functools.partial(OpenAIProtocol, server, loop=loop, **handler_args),
            limits.max_http_connections,
            self._telemetry,
            tls=None if certificates is None else certificates.ssl_context(),
            # A handshake gets a short time, as any unfinished request.
            handshake_timeout_s=min(limits.http_read_timeout_s, TLS_HANDSHAKE_TIMEOUT_S),
        )
        # Not a web.SockSite: this factory, not aiohttp's, makes each
        # connection, TLS layer included: the listener itself is plain.
        self._listener = await loop.create_server(self.connections, sock=sock)
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and close connections; call after draining and
        after the engine has ended every request."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def models(self, request: web.Request) -> web.Response:
        self._check_token(request)
        return web.json_response({"object": "list", "data": [self._model(request)]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's ``models.retrieve``: the served model, as listed."""
        self._check_token(request)
        model = self._model(request)
        if request.match_info["model"] != model["id"]:
            raise model_not_found(request.match_info["model"])
        return web.json_response(model)

    def _model(self, request: web.Request) -> dict[str, object]:
        try:
            info = self._lifecycle.engine.info
        except NotServing as exc:
            raise not_serving(exc, request, self._telemetry) from None
        return {
            "id": info.name,
            "object": "model",
            "created": self._created,
            "owned_by": "slipstream",
            "max_model_len": info.max_model_len,
        }

    async def health(self, request: web.Request) -> web.Response:
        phase = self._lifecycle.phase
        if phase is not Phase.SERVING:
            raise ApiError(
                503,
                f"the server is {phase.name.lower()}",
                "service_unavailable",
                None,
                phase.name.lower(),
            )
        return web.json_response({"status": "serving"})

    async def metrics(self, request: web.Request) -> web.Response:
        self._check_token(request)
        metrics = None if self._telemetry is None else self._telemetry.metrics
        if metrics is None:
            raise ApiError(404, "metrics are not enabled on this server", code="not_found")
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

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
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import socket
import ssl
import time
import weakref
from asyncio import sslproto
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from aiohttp.http import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slipstream.service.api.auth import Tenants
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
# A TLS handshake takes a round trip or two; one not done by then is dropped.
TLS_HANDSHAKE_TIMEOUT_S = 10.0
# A refused connection is logged at most this often, with the count since.
REFUSED_LOG_INTERVAL_S = 10.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = structlog.get_logger(__name__)


class _MalformedRequests(logging.Filter):
    """aiohttp answers a request it cannot parse (a broken client's, a
    scanner's: a bad header, one over its size) 400 and logs it as an error
    with its traceback, as it would a bug of the server's. Said here in one
    line at info instead, as a refused call is; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError) or not 400 <= exc.code < 500:
            return True
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else None
        log.info("http_bad_request", peer=peer, status=exc.code, detail=_one_line(exc.message))
        return False


def _one_line(message: object) -> str:
    """aiohttp's detail of a request it cannot parse, which spans lines and
    points a caret at the bad byte, on one line without the caret."""
    return " ".join(word for word in str(message).split() if word != "^")


# aiohttp's server logger (its records keep its name), for this front's connections.
_PROTOCOL_LOG = logging.getLogger("aiohttp.server.slipstream")
_PROTOCOL_LOG.addFilter(_MalformedRequests())


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
        code=_code(exc.reason),
        headers={k: v for k, v in exc.headers.items() if k == "Allow"},
    ).response()


def _code(reason: str) -> str:
    """An error's code for a status aiohttp answers: ``Bad Request`` -> ``bad_request``."""
    return reason.lower().replace(" ", "_")


class _OpenAIProtocol(web.RequestHandler):
    """aiohttp's handler of one connection, except that what it answers
    itself, before any route or middleware (a request it cannot parse: a
    bad header, one over its size, bytes that are not HTTP), is in OpenAI's
    JSON shape too, not in plain text. aiohttp logs it as before."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs; raises if begun
        kind = "invalid_request_error" if status < 500 else "server_error"
        detail = _one_line(message or plain.reason)
        answer = ApiError(status, detail, kind, code=_code(plain.reason)).response()
        answer.force_close()  # as aiohttp's: the rest of the bytes cannot be trusted
        return answer


# OpenAI's paths, which this server serves under /v1 as OpenAI does.
_OPENAI_PATHS = ("/completions", "/chat/completions", "/models")


def _no_route(method: str, path: str) -> str:
    """A 404's message; a client whose base URL lacks /v1 is told so."""
    message = f"{method} {path} is not a route of this server"
    if path.startswith(_OPENAI_PATHS):
        message += f" (the API is under /v1: /v1{path}; a client's base URL ends in /v1)"
    return message


class ConnectionCap:
    """The listening socket's protocol factory: a handler of
    ``make_handler``'s (aiohttp's) for each connection until
    ``max_connections`` are open, then a protocol that closes a new one as
    soon as it is accepted. Without it every unfinished request holds a
    file descriptor, until the process has none left for gRPC either.

    A connection counts from its accept to its close: each handler is
    wrapped (``_Counted``) and held weakly. Over TLS (``tls``) the listener
    accepts in the clear and each connection under the cap is wrapped in
    its TLS layer here (``_TLSOrPlain``, at its first bytes), so one over
    it is reset before any handshake work. A handshake that never completes
    is closed at ``handshake_timeout_s`` from the accept, without a word to
    the handler: it stops counting when asyncio lets go of it."""

    def __init__(
        self,
        make_handler: Callable[[], asyncio.Protocol],
        max_connections: int,
        telemetry: Telemetry | None = None,
        tls: ssl.SSLContext | None = None,
        handshake_timeout_s: float = TLS_HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self._make_handler = make_handler
        self._max_connections = max_connections
        self._metrics = None if telemetry is None else telemetry.metrics
        self._tls = tls
        self._handshake_timeout_s = handshake_timeout_s
        self._open: weakref.WeakSet[_Counted] = weakref.WeakSet()
        self._num_refused = 0  # since the last warning
        self._last_warning = -math.inf
        self._flush: asyncio.TimerHandle | None = None

    @property
    def num_connections(self) -> int:
        return len(self._open)

    def __call__(self) -> asyncio.BaseProtocol:
        if self.num_connections >= self._max_connections:
            self._refused()
            return _Refused()
        counted = _Counted(self._make_handler(), self._open)
        self._open.add(counted)
        if self._tls is None:
            return counted
        make_tls = functools.partial(_tls_layer, counted, self._tls)
        return _TLSOrPlain(make_tls, self._handshake_timeout_s)

    def _refused(self) -> None:
        if self._metrics is not None:
            self._metrics.call_refused("too_many_connections")
        self._num_refused += 1
        if time.monotonic() - self._last_warning >= REFUSED_LOG_INTERVAL_S:
            self._warn()
        elif self._flush is None:  # the rest of a burst, said when the interval ends
            loop = asyncio.get_running_loop()
            self._flush = loop.call_later(REFUSED_LOG_INTERVAL_S, self._warn)

    def _warn(self) -> None:
        self._flush = None
        if self._num_refused:
            log.warning(
                "http_connections_refused",
                max_connections=self._max_connections,
                num_refused=self._num_refused,
            )
        self._last_warning, self._num_refused = time.monotonic(), 0


class _Counted(asyncio.Protocol):
    """aiohttp's handler for one connection, every event passed on; it
    leaves its cap's open set when the connection is lost."""

    def __init__(self, handler: asyncio.Protocol, open_set: weakref.WeakSet[_Counted]) -> None:
        self._handler = handler
        self._open_set = open_set

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._open_set.discard(self)
        self._handler.connection_lost(exc)


def _tls_layer(
    protocol: asyncio.Protocol, context: ssl.SSLContext, handshake_timeout_s: float
) -> asyncio.BufferedProtocol:
    # What loop.create_server(ssl=...) wraps each accepted connection's
    # protocol in; made here, the cap is asked first. (loop.start_tls, the
    # public way, hands over the TLS transport a loop turn after the
    # handshake: a request sent with it could reach aiohttp unmade.)
    return sslproto.SSLProtocol(
        asyncio.get_running_loop(),
        protocol,
        context,
        None,  # type: ignore[arg-type]  # no waiter: nothing awaits the handshake
        server_side=True,
        ssl_handshake_timeout=handshake_timeout_s,  # type: ignore[arg-type]
    )


def _is_tls(first_byte: int) -> bool:
    """nginx's test: a TLS record of a ClientHello begins 0x16 (handshake),
    an SSLv2-style hello with its high bit set."""
    return first_byte == 0x16 or first_byte & 0x80 != 0


def _plain_answer(error: ApiError) -> bytes:
    """``error`` as a whole HTTP/1.1 response that closes its connection."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


_PLAIN_HTTP_ON_TLS = _plain_answer(
    ApiError(400, "this port speaks HTTPS: a plain HTTP request was sent to it", code="bad_request")
)


class _TLSOrPlain(asyncio.Protocol):
    """A connection to the HTTPS port until its first bytes, which a client
    sends first. A TLS hello hands it to its TLS layer (``make_tls``, made
    then with what is left of ``timeout_s``), the hello fed to it: no wait
    a handshake would not have had. Anything else (a client speaking plain
    HTTP to the port, which would get an empty reply) is answered a 400
    saying so, as nginx does, and closed once the client has had it: the
    rest of its request is read and dropped for ``timeout_s`` at most, as
    closing with bytes unread resets the connection and can lose the
    answer. One that sends nothing within ``timeout_s`` of its accept is
    reset."""

    def __init__(
        self, make_tls: Callable[[float], asyncio.BufferedProtocol], timeout_s: float
    ) -> None:
        self._make_tls = make_tls
        self._timeout_s = timeout_s
        self._deadline = 0.0
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._is_answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        loop = asyncio.get_running_loop()
        self._transport = transport
        self._deadline = loop.time() + self._timeout_s
        self._timer = loop.call_at(self._deadline, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._is_answered:
            return  # the rest of the plain request
        assert self._transport is not None and self._timer is not None
        self._timer.cancel()
        if _is_tls(data[0]):
            self._start_tls(self._transport, data)
        else:
            self._answer_plain(self._transport)

    def _start_tls(self, transport: asyncio.Transport, hello: bytes) -> None:
        remaining_s = self._deadline - asyncio.get_running_loop().time()
        tls = self._make_tls(max(remaining_s, 0.0))
        transport.set_protocol(tls)
        tls.connection_made(transport)
        _feed(tls, hello)

    def _answer_plain(self, transport: asyncio.Transport) -> None:
        self._is_answered = True
        peer = transport.get_extra_info("peername")
        detail = "plain HTTP on the HTTPS port"
        log.info("http_bad_request", peer=peer[0] if peer else None, status=400, detail=detail)
        transport.write(_PLAIN_HTTP_ON_TLS)
        transport.write_eof()  # once sent; closed at the client's own close
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, transport.close)

    def eof_received(self) -> bool:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _feed(protocol: asyncio.BufferedProtocol, data: bytes) -> None:
    """Hands ``data`` to ``protocol`` as a transport would."""
    view = memoryview(data)
    while view:
        buffer = memoryview(protocol.get_buffer(len(view)))
        num_bytes = min(len(buffer), len(view))
        buffer[:num_bytes] = view[:num_bytes]
        protocol.buffer_updated(num_bytes)
        view = view[num_bytes:]


class _Refused(asyncio.Protocol):
    """A connection over the cap: reset at once, nothing read or written."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]


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
            logger=_PROTOCOL_LOG,
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
            functools.partial(_OpenAIProtocol, server, loop=loop, **handler_args),
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

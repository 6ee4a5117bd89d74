"""The HTTP front's connections, below aiohttp's requests: what the
listening socket makes of each one it accepts.

- the cap (``ConnectionCap``): a connection over ``max_connections`` is
  reset at its accept, before any handshake or parse; refusals are
  counted in the metrics and logged at most every ``REFUSED_LOG_INTERVAL_S``;
- TLS: the listener is plain and each connection under the cap is wrapped
  in its own TLS layer, with a handshake deadline;
- plain HTTP sent to the HTTPS port: answered a 400 that says so;
- aiohttp's own answers (``OpenAIProtocol``), to a request it cannot parse
  before any route or middleware sees it: a 400 in OpenAI's JSON shape,
  logged in one line at info.

One accepted connection::

    ConnectionCap()
      ├─ over the cap   _Refused                     reset
      ├─ HTTP           _Counted(OpenAIProtocol)
      └─ HTTPS          _TLSOrPlain                  until the first bytes
                          ├─ a TLS hello   SSLProtocol(_Counted(OpenAIProtocol))
                          └─ anything else a 400, then closed
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import ssl
import time
import weakref
from asyncio import sslproto
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING

import structlog
from aiohttp import web
from aiohttp.http import HttpProcessingError

from slipstream.service.api.http.errors import ApiError

if TYPE_CHECKING:
    from slipstream.service.telemetry.tracing import Telemetry

# A TLS handshake takes a round trip or two; one not done by then is dropped.
TLS_HANDSHAKE_TIMEOUT_S = 10.0
# A refused connection is logged at most this often, with the count since.
REFUSED_LOG_INTERVAL_S = 10.0

log = structlog.get_logger(__name__)


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


class _Refused(asyncio.Protocol):
    """A connection over the cap: reset at once, nothing read or written."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]


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


def _feed(protocol: asyncio.BufferedProtocol, data: bytes) -> None:
    """Hands ``data`` to ``protocol`` as a transport would."""
    view = memoryview(data)
    while view:
        buffer = memoryview(protocol.get_buffer(len(view)))
        num_bytes = min(len(buffer), len(view))
        buffer[:num_bytes] = view[:num_bytes]
        protocol.buffer_updated(num_bytes)
        view = view[num_bytes:]


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


class OpenAIProtocol(web.RequestHandler):
    """aiohttp's handler of one connection, except that what it answers
    itself, before any route or middleware (a request it cannot parse: a
    bad header, one over its size, bytes that are not HTTP), is in OpenAI's
    JSON shape too, not in plain text. aiohttp logs it as before, to the
    ``logger`` it is given: ``PROTOCOL_LOG``."""

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
        answer = ApiError(status, detail, kind, code=error_code(plain.reason)).response()
        answer.force_close()  # as aiohttp's: the rest of the bytes cannot be trusted
        return answer


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


# aiohttp's server logger (its records keep its name), for this front's connections.
PROTOCOL_LOG = logging.getLogger("aiohttp.server.slipstream")
PROTOCOL_LOG.addFilter(_MalformedRequests())


def _one_line(message: object) -> str:
    """aiohttp's detail of a request it cannot parse, which spans lines and
    points a caret at the bad byte, on one line without the caret."""
    return " ".join(word for word in str(message).split() if word != "^")


def error_code(reason: str) -> str:
    """An error's code for a status aiohttp answers: ``Bad Request`` -> ``bad_request``."""
    return reason.lower().replace(" ", "_")

"""What one HTTP client can cost every other: how large a body is read,
how long it takes to parse on the event loop, how many connections it may
hold open and for how long, on the ``tiny`` model's front."""

from __future__ import annotations

import asyncio
import datetime
import gc
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from http_front_thread import FrontThread
from polling import wait_until
from structlog.testing import capture_logs

from slipstream.service.api.http import generation
from slipstream.service.api.http.errors import ApiError
from slipstream.service.api.http.params import parse
from slipstream.service.api.limits import Limits
from slipstream.service.api.tls import ServerTLS
from slipstream.service.engine.config import EngineConfig
from slipstream.service.telemetry.metrics import ServerMetrics
from slipstream.service.telemetry.tracing import Telemetry

CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)


class Front(FrontThread):
    def post(self, body: bytes | str) -> tuple[int, dict[str, object]]:
        data = body.encode() if isinstance(body, str) else body
        status, reply = self.post_bytes("/v1/completions", data)
        return status, json.loads(reply)


def refusal(body: dict[str, object], **limits: int) -> ApiError:
    with pytest.raises(ApiError) as refused:
        parse(body, {}, False, **limits)
    return refused.value


def test_a_token_id_prompt_over_the_context_is_refused_before_its_ids_are_read() -> None:
    """Its length first, in the gRPC front's words: a body of millions of
    ids is not checked id by id on the event loop (it took ~1 s)."""
    error = refusal({"model": "tiny", "prompt": [0] * 2000 + ["x"]}, max_model_len=1024)
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "prompt")
    assert error.message == "prompt (2001) + max_new_tokens (16) exceeds max_model_len (1024)"
    error = refusal({"model": "tiny", "prompt": [0] * 1023 + ["x"]}, max_model_len=1024)
    assert error.message.startswith("a token-id prompt must be a list of integers")


def test_a_list_of_too_many_prompts_is_refused_before_each_is_read() -> None:
    error = refusal({"model": "tiny", "prompt": [[0]] * 20 + [["x"]]}, max_choices=16)
    assert (error.status, error.param) == (400, "prompt")
    assert error.message == (
        "21 prompts with n=1 ask for 21 choices, more than the 16 this server allows"
    )


class Body:
    """Just what ``generation._json`` reads of a request."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.charset = None

    async def read(self) -> bytes:
        return self.raw


def test_a_body_parses_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """200,000 small lists would start hundreds of collections mid-parse,
    on the event loop: ``[[0],[0],...]`` parsed ~7x slower."""
    collections: list[dict[str, int]] = []
    parsing = threading.Event()
    loads = json.loads

    def parse_watched(text: str) -> object:
        parsing.set()
        try:
            return loads(text)
        finally:
            parsing.clear()

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and parsing.is_set():
            collections.append(info)

    monkeypatch.setattr(generation.json, "loads", parse_watched)
    body = b'{"prompt": [' + b",".join([b"[0]"] * 200_000) + b"]}"
    gc.callbacks.append(count)
    try:
        parsed = asyncio.run(generation._json(Body(body)))  # type: ignore[arg-type]
    finally:
        gc.callbacks.remove(count)
    assert len(parsed["prompt"]) == 200_000  # type: ignore[index]
    assert collections == [] and gc.isenabled()
    with pytest.raises(ApiError):
        asyncio.run(generation._json(Body(b"[" * 100 + b"x")))  # type: ignore[arg-type]
    assert gc.isenabled()


@pytest.fixture(scope="module")
def small_prompts(engine: object) -> Iterator[Front]:
    front = Front(engine, Limits(max_prompt_bytes=4096))
    yield front
    front.stop()


def test_the_body_limit_is_the_prompt_limit_and_a_margin(small_prompts: Front) -> None:
    """A body past --max-prompt-bytes and 1 MiB is refused before it is
    read or parsed, so the worst parse is bounded by the prompt limit (the
    limit was a fixed 16 MiB: ~2 s of parsing on the event loop)."""
    limit = 4096 + 2**20
    ids = b'{"model": "tiny", "prompt": [' + b",".join([b"0"] * (limit // 2)) + b"]}"
    status, reply = small_prompts.post(ids)
    assert status == 413, reply
    assert reply["error"]["message"] == f"the request body is over {limit} bytes"  # type: ignore[index]
    padded = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}) + " " * (2**20 - 64)
    status, reply = small_prompts.post(padded.encode())
    assert status == 200, reply


def connect(front: Front, first_bytes: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", front.port), timeout=10)
    sock.sendall(first_bytes)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes (a reset ends it too)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def num_connections(front: Front) -> int:
    assert front.http.connections is not None
    return front.http.connections.num_connections


UNFINISHED_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
UNFINISHED_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{"
)


def test_connections_past_the_cap_are_closed_at_once(engine: object) -> None:
    """Unfinished requests once held a descriptor each until the process
    had none (gRPC calls then failed too) and asyncio logged every failed
    accept; now one past --max-http-connections is reset as it is
    accepted, counted, and warned of once in a while."""
    telemetry = Telemetry(None, ServerMetrics())
    front = Front(engine, Limits(max_http_connections=4), telemetry)
    held = [connect(front, UNFINISHED_HEADERS if i % 2 else UNFINISHED_BODY) for i in range(4)]
    try:
        assert wait_until(lambda: num_connections(front) == 4)
        with capture_logs() as logs:
            for _ in range(20):
                with connect(front, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") as extra:
                    assert read_all(extra) == b""
        refused = [entry for entry in logs if entry["event"] == "http_connections_refused"]
        assert len(refused) == 1 and refused[0]["max_connections"] == 4, logs
        registry = telemetry.metrics.registry  # type: ignore[union-attr]
        labels = {"reason": "too_many_connections"}
        assert registry.get_sample_value("slipstream_rejections_total", labels) == 20
        held.pop().close()
        assert wait_until(lambda: num_connections(front) == 3)
        status, reply = front.post(json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        assert status == 200, reply
    finally:
        for sock in held:
            sock.close()
        front.stop()


def _self_signed(tmp_path: Path) -> ServerTLS:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ServerTLS(cert_file, key_file)


def test_over_tls_a_connection_counts_from_its_accept(engine: object, tmp_path: Path) -> None:
    """Over TLS aiohttp sees a connection only once its handshake is done:
    sockets that never began one were counted nowhere, and any number of
    them held a descriptor each until the handshake timeout."""
    telemetry = Telemetry(None, ServerMetrics())
    front = Front(engine, Limits(max_http_connections=3), telemetry, tls=_self_signed(tmp_path))
    held = [socket.create_connection(("127.0.0.1", front.port), timeout=10) for _ in range(3)]
    try:
        assert wait_until(lambda: num_connections(front) == 3)
        extra = [socket.create_connection(("127.0.0.1", front.port), timeout=10) for _ in range(5)]
        registry = telemetry.metrics.registry  # type: ignore[union-attr]
        labels = {"reason": "too_many_connections"}
        assert wait_until(
            lambda: registry.get_sample_value("slipstream_rejections_total", labels) == 5
        )
        assert num_connections(front) == 3
        held.extend(extra)
    finally:
        for sock in held:
            sock.close()
        front.stop()


def test_over_tls_a_connection_past_the_cap_is_reset_before_its_handshake(
    engine: object, tmp_path: Path
) -> None:
    """A plain connection past --max-http-connections is reset as it is
    accepted; one over TLS was reset only after its handshake, the server's
    share of the work done (and after up to 10 s of a client's stalling)."""
    front = Front(engine, Limits(max_http_connections=2), tls=_self_signed(tmp_path))
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE  # the cap is tested, not trust
    held = [socket.create_connection(("127.0.0.1", front.port), timeout=10) for _ in range(2)]
    try:
        assert wait_until(lambda: num_connections(front) == 2)
        extra = socket.create_connection(("127.0.0.1", front.port), timeout=10)
        with extra, pytest.raises(OSError):  # reset: no ServerHello, no handshake
            client.wrap_socket(extra)
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as silent:
            assert read_all(silent) == b""  # reset without waiting for a ClientHello
        assert num_connections(front) == 2
        held.pop().close()
        assert wait_until(lambda: num_connections(front) == 1)
        with client.wrap_socket(socket.create_connection(("127.0.0.1", front.port))) as secure:
            secure.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_all(secure).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in held:
            sock.close()
        front.stop()


def test_plain_http_to_the_https_port_is_a_400_saying_so(engine: object, tmp_path: Path) -> None:
    """A client that spoke plain HTTP to the HTTPS port (http:// for
    https://) had its connection closed without a word, an "empty reply";
    as nginx does, it is told so in a 400, its whole request read first.
    A TLS client is served as before, and a connection that sends nothing
    is still closed at the handshake's timeout."""
    front = Front(engine, Limits(http_read_timeout_s=1.0), tls=_self_signed(tmp_path))
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE  # TLS is tested, not trust
    body = b"{" + b" " * 2**20 + b"}"  # more than one read: it comes after the answer
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    try:
        with capture_logs() as logs:
            for request in (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", post + body):
                with connect(front, request) as plain:
                    answer = read_all(plain)
                head, reply = answer.split(b"\r\n\r\n", 1)
                assert head.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in head, answer
                error = json.loads(reply)["error"]
                assert "speaks HTTPS" in error["message"] and error["code"] == "bad_request"
        said = [e for e in logs if e["event"] == "http_bad_request"]
        assert len(said) == 2 and said[0]["peer"] == "127.0.0.1", said
        assert said[0]["detail"] == "plain HTTP on the HTTPS port", said
        with client.wrap_socket(socket.create_connection(("127.0.0.1", front.port))) as secure:
            secure.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_all(secure).startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", front.port), timeout=10) as silent:
            assert read_all(silent) == b""
        assert 1.0 <= time.monotonic() - start < 5.0
        assert wait_until(lambda: num_connections(front) == 0, timeout_s=3.0)
    finally:
        front.stop()


def test_a_request_that_stalls_is_ended_and_frees_its_slot(engine: object) -> None:
    """Headers that never end are closed, a body that stalls is a 408:
    each after --http-read-timeout, and its connection is gone soon after."""
    front = Front(engine, Limits(max_http_connections=2, http_read_timeout_s=1.0))
    try:
        start = time.monotonic()
        with connect(front, UNFINISHED_HEADERS) as headers, connect(front, UNFINISHED_BODY) as body:
            assert wait_until(lambda: num_connections(front) == 2)
            assert read_all(headers) == b""
            answer = read_all(body)
        assert 1.0 <= time.monotonic() - start < 5.0
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["message"] == "the request body did not arrive within 1 s"
        assert wait_until(lambda: num_connections(front) == 0, timeout_s=3.0)
        status, reply = front.post(json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        assert status == 200, reply
    finally:
        front.stop()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    ],
    ids=["bad-content-length", "header-too-long"],
)
def test_a_request_that_is_not_http_is_a_json_400_and_one_log_line_not_an_error(
    engine: object, request_bytes: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp answers a request it cannot parse 400 and logged it as an
    error with its traceback, as it would a bug of the server's: a
    scanner's or a broken client's requests filled the log with them.
    Its answer was plain text, the one error of the front's not in
    OpenAI's JSON shape."""
    front = Front(engine)
    try:
        with capture_logs() as logs, caplog.at_level(logging.INFO, logger="aiohttp"):
            with connect(front, request_bytes) as sock:
                answer = read_all(sock)
            assert wait_until(lambda: any(e["event"] == "http_bad_request" for e in logs))
        errors = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
        assert errors == []
        said = next(e for e in logs if e["event"] == "http_bad_request")
        assert said["log_level"] == "info" and said["peer"] == "127.0.0.1", said
        assert said["status"] == 400 and said["detail"], said
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.0 400 "), answer
        assert b"\r\nContent-Type: application/json" in head, answer
        error = json.loads(body)["error"]
        assert error == {
            "message": said["detail"],  # aiohttp's, on one line
            "type": "invalid_request_error",
            "param": None,
            "code": "bad_request",
        }
    finally:
        front.stop()

"""Keepalive (gRPC A8): the server pings a quiet connection and closes it
when the ping goes unanswered, so a client that vanished without closing
its connection ends its calls and their requests in seconds, not gRPC's
default 2 hours; and it takes clients' own pings, where gRPC's default
policy sends a client that pings more than once in 5 minutes away with
GOAWAY "too_many_pings". Short times stand in for the defaults (60 s, 20 s,
5 s) on a real ``grpc.aio`` server on tiny."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from polling import wait_until
from server_thread import ServerThread, hold_every_submit

from slipstream.clients.balancing import channel_options
from slipstream.service.api import server
from slipstream.service.api.lifecycle import Lifecycle
from slipstream.service.api.limits import Limits
from slipstream.service.engine.config import EngineConfig
from slipstream.service.telemetry.metrics import ServerMetrics
from slipstream.service.telemetry.tracing import Telemetry
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

CONFIG = EngineConfig(
    model="tiny",
    dtype="float32",
    reject_infeasible=False,
    abandon_hopeless=False,
    calibrate_cost_model=False,
)
NEVER_READS = Path(__file__).with_name("never_reads.py")
# A client that pings every second, also with no data sent between its pings
# (gRPC's keepalive guide asks this of a client that wants its pings).
PINGING_CLIENT = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


def built_options(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> list[tuple[str, object]]:
    """The options ``build_server(..., **kwargs)`` hands gRPC."""
    seen: list[tuple[str, object]] = []
    make = grpc.aio.server

    def recorded(*args: Any, options: list[tuple[str, object]], **more: Any) -> grpc.aio.Server:
        seen.extend(options)
        return make(*args, options=options, **more)

    monkeypatch.setattr(grpc.aio, "server", recorded)

    async def build() -> None:
        srv, _ = server.build_server(Lifecycle(), "127.0.0.1", 0, **kwargs)
        await srv.stop(None)

    asyncio.run(build())
    return seen


def test_a_server_pings_quiet_connections_and_takes_clients_pings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options = dict(built_options(monkeypatch))
    assert options["grpc.keepalive_time_ms"] == 60_000
    assert options["grpc.keepalive_timeout_ms"] == 20_000
    assert options["grpc.http2.ping_timeout_ms"] == 20_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 5_000
    assert options["grpc.http2.max_ping_strikes"] == 2


def test_options_given_replace_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC keeps the first of two options of one name: a default left ahead
    of the caller's would win."""
    given = [*server.keepalive_options(30, 10), ("grpc.max_receive_message_length", 1 << 20)]
    options = built_options(monkeypatch, options=given, limits=Limits())
    names = [name for name, _ in options]
    assert len(names) == len(set(names))
    assert dict(options)["grpc.keepalive_time_ms"] == 30_000
    assert dict(options)["grpc.keepalive_timeout_ms"] == 10_000
    assert dict(options)["grpc.max_receive_message_length"] == 1 << 20


def test_keepalive_options_are_checked() -> None:
    assert dict(server.keepalive_options(1.5, 0.25, 0))["grpc.keepalive_time_ms"] == 1500
    for bad in ((0, 20), (60, 0)):
        with pytest.raises(ValueError, match="positive"):
            server.keepalive_options(*bad)
    with pytest.raises(ValueError, match="negative"):
        server.keepalive_options(60, 20, -1)


def test_serve_defaults_are_the_servers() -> None:
    from slipstream.service.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.keepalive_s, args.keepalive_timeout_s) == (
        server.KEEPALIVE_S,
        server.KEEPALIVE_TIMEOUT_S,
    )


def test_the_clients_pings_are_ones_the_server_takes() -> None:
    """The Python clients set no keepalive of their own (a default gRPC
    client sends at most 2 pings without data, never a third strike); one
    they set must be no more often than the server takes."""
    for name, value in channel_options():
        if name == "grpc.keepalive_time_ms":
            assert isinstance(value, int) and value >= server.MIN_CLIENT_PING_S * 1000


def quiet_stream_status(target: str, hold_s: float) -> grpc.StatusCode:
    """A ``PINGING_CLIENT``'s Generate stream that sends nothing for
    ``hold_s`` (or until the call ends), then half-closes: how it ended."""
    ended = threading.Event()

    def frames() -> Iterator[pb.GenerateRequest]:
        ended.wait(hold_s)
        yield from ()

    with grpc.insecure_channel(target, options=PINGING_CLIENT) as channel:
        call = pb_grpc.InferenceStub(channel).Generate(frames(), timeout=60)
        call.add_callback(ended.set)
        with contextlib.suppress(grpc.RpcError):
            list(call)
        return call.code()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("min_client_ping_s", "hold_s", "status"),
    [
        (0.25, 4.5, grpc.StatusCode.OK),  # this server's policy, scaled: taken
        (300.0, 30.0, grpc.StatusCode.UNAVAILABLE),  # gRPC's own: sent away ("Too many pings")
    ],
)
def test_a_client_that_pings_as_often_as_the_server_takes_keeps_its_stream(
    engine: object, min_client_ping_s: float, hold_s: float, status: grpc.StatusCode
) -> None:
    options = server.keepalive_options(min_client_ping_s=min_client_ping_s)
    srv = ServerThread(engine, options=options)
    try:
        assert quiet_stream_status(srv.target, hold_s) is status
    finally:
        srv.stop()


def num_cancelled(srv: ServerThread) -> float:
    labels = {"priority": "0", "reason": "cancelled"}
    registry = srv.telemetry.metrics.registry
    return registry.get_sample_value("slipstream_requests_finished_total", labels) or 0.0


def num_live(engine: Any) -> int:
    return len(engine.live_output_counts())


def test_a_client_that_vanishes_without_closing_its_connection_is_let_go(
    engine: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen client (SIGSTOP: its kernel keeps the TCP connection, nothing
    answers the server's pings) stands for a machine gone: the server closes
    the connection after a ping goes unanswered, and its requests end
    CANCELLED at once, not after the slow-reader grace."""
    hold_every_submit(engine, monkeypatch)  # the requests run until their call ends
    telemetry = Telemetry(TracerProvider(), ServerMetrics())
    options = server.keepalive_options(time_s=0.5, timeout_s=2.0)
    limits = Limits(slow_reader_grace_s=600.0)
    srv = ServerThread(engine, options=options, telemetry=telemetry, limits=limits)
    num_requests = 2
    command = [sys.executable, str(NEVER_READS), srv.target, str(num_requests), "64"]
    client = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdout.readline() == "sent\n"
        assert wait_until(lambda: num_live(engine) == num_requests, timeout_s=30)
        before = num_cancelled(srv)
        client.send_signal(signal.SIGSTOP)
        assert wait_until(lambda: num_cancelled(srv) - before == num_requests, timeout_s=30)
        assert wait_until(lambda: num_live(engine) == 0)
    finally:
        client.kill()
        client.send_signal(signal.SIGCONT)
        client.wait()
        srv.stop()


def test_serve_hands_its_keepalive_flags_to_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.service.cli import build_parser, serve

    given: dict[str, object] = {}

    async def run(*args: Any, options: list[tuple[str, object]], **kwargs: Any) -> bool:
        given.update(options)
        return True

    monkeypatch.setattr(server, "run", run)
    argv = ["serve", "--model", "tiny", "--keepalive-s", "30", "--keepalive-timeout-s", "5"]
    assert serve.run(build_parser().parse_args(argv)) == 0
    assert given["grpc.keepalive_time_ms"] == 30_000
    assert given["grpc.keepalive_timeout_ms"] == given["grpc.http2.ping_timeout_ms"] == 5_000

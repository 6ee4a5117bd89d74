"""A call that ends while the server is blocked writing to it (its client
stopped reading, flow control is full) ends quietly and frees its requests
at once: a client's cancel of ``Generate`` or ``GenerateOne``, or a client
process that dies. grpc logged each as an ERROR traceback
(``ExecuteBatchError raised in core``) when the write failed before grpc
saw the cancel. A real ``grpc.aio`` server on tiny."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from polling import wait_until
from server_thread import ServerThread
from structlog.testing import capture_logs

from slipstream.service.api import servicer, session
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
# A small outbox pauses a stream soon after its writes block; a long grace
# keeps its requests from ending SLOW_READER before the test ends the call.
LIMITS = Limits(max_outbox_events=64, slow_reader_grace_s=60.0)
LONG = 960  # tokens: far more than fill the client's window and the outbox
# The client's side absorbs little: its window is 16 KiB and does not grow.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
NEVER_READS = Path(__file__).with_name("never_reads.py")


@pytest.fixture(scope="module")
def server(engine: object) -> Iterator[ServerThread]:
    telemetry = Telemetry(TracerProvider(), ServerMetrics())
    srv = ServerThread(engine, limits=LIMITS, telemetry=telemetry)
    yield srv
    srv.stop()


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[session.StreamSession]:
    """The sessions of the calls the server takes from here on."""
    made: list[session.StreamSession] = []

    class Recorded(session.StreamSession):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(servicer, "StreamSession", Recorded)
    return made


def num_cancelled(server: ServerThread) -> float:
    metrics = server.telemetry.metrics
    labels = {"priority": "0", "reason": "cancelled"}
    return metrics.registry.get_sample_value("slipstream_requests_finished_total", labels) or 0.0


def engine_is_empty(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        stats = pb_grpc.InferenceStub(channel).GetServerStats(pb.GetServerStatsRequest())
    used = (stats.kv_blocks_used.device, stats.kv_blocks_used.host)
    return used == (0, 0) and (stats.running, stats.waiting, stats.swapped) == (0, 0, 0)


def is_blocked(sessions: list[session.StreamSession], num_calls: int) -> bool:
    """Each call's writes are held by flow control: its outbox is full."""
    return len(sessions) == num_calls and all(
        s.num_unread >= LIMITS.max_outbox_events for s in sessions
    )


def submit(i: int) -> pb.Submit:
    """A long request whose every token is ~250 bytes on the wire (its top
    20 alternatives): a hundred fill the client's window, however many
    tokens a chunk carries."""
    return pb.Submit(
        request_id=f"r{i}",
        token_ids=pb.TokenIds(ids=[5, 6, 7 + i]),
        stopping=pb.StoppingCriteria(max_new_tokens=LONG, ignore_eos=True),
        return_logprobs=True,
        top_logprobs=20,
    )


def open_generate(stub: pb_grpc.InferenceStub, num_requests: int) -> grpc.RpcContext:
    sent = threading.Event()

    def frames() -> Iterator[pb.GenerateRequest]:
        for i in range(num_requests):
            yield pb.GenerateRequest(submit=submit(i))
        sent.wait()  # half-closes only once cancelled

    call = stub.Generate(frames(), timeout=60)
    call.add_callback(sent.set)
    return call


CALLS: dict[str, tuple[int, Callable[[pb_grpc.InferenceStub], grpc.RpcContext]]] = {
    "Generate": (4, lambda stub: open_generate(stub, 4)),
    "GenerateOne": (1, lambda stub: stub.GenerateOne(submit(0), timeout=60)),
}


def assert_quiet_and_freed(
    server: ServerThread, before: float, num_requests: int, caplog: pytest.LogCaptureFixture
) -> None:
    assert wait_until(lambda: engine_is_empty(server.target))
    assert num_cancelled(server) - before == num_requests
    noisy = [r for r in caplog.records if r.name.startswith("grpc") and r.levelno >= logging.INFO]
    assert not noisy, [r.getMessage() for r in noisy]


@pytest.mark.parametrize("method", list(CALLS))
def test_a_cancel_while_the_server_is_blocked_writing_ends_quietly(
    server: ServerThread,
    sessions: list[session.StreamSession],
    caplog: pytest.LogCaptureFixture,
    method: str,
) -> None:
    num_requests, open_call = CALLS[method]
    before = num_cancelled(server)
    with grpc.insecure_channel(server.target, options=SMALL_WINDOW) as channel:
        call = open_call(pb_grpc.InferenceStub(channel))
        assert wait_until(lambda: is_blocked(sessions, 1), timeout_s=30)
        with caplog.at_level(logging.DEBUG, logger="grpc"):
            call.cancel()
            assert_quiet_and_freed(server, before, num_requests, caplog)
    assert call.code() is grpc.StatusCode.CANCELLED


def test_a_client_that_dies_while_the_server_is_blocked_writing_ends_quietly(
    server: ServerThread,
    sessions: list[session.StreamSession],
    caplog: pytest.LogCaptureFixture,
) -> None:
    num_requests, num_streams = 4, 2
    before = num_cancelled(server)
    command = [sys.executable, str(NEVER_READS), server.target, str(num_requests), str(LONG)]
    client = subprocess.Popen([*command, str(num_streams)], stdout=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: is_blocked(sessions, num_streams), timeout_s=30)
        with caplog.at_level(logging.DEBUG, logger="grpc"):
            client.kill()
            client.wait()
            assert_quiet_and_freed(server, before, num_requests * num_streams, caplog)
    finally:
        client.kill()
        client.wait()


def test_submits_waiting_on_a_paused_stream_are_counted_when_its_call_ends(
    server: ServerThread, sessions: list[session.StreamSession]
) -> None:
    """A paused stream answers no submit until its client reads: those
    waiting when the call ends are never admitted, yet each has its
    ``request_finished`` line and its count, as a cancel before admission."""
    num_running, num_waiting = 4, 3
    more = threading.Event()

    def frames() -> Iterator[pb.GenerateRequest]:
        for i in range(num_running):
            yield pb.GenerateRequest(submit=submit(i))
        more.wait(30)
        for i in range(num_running, num_running + num_waiting):
            yield pb.GenerateRequest(submit=submit(i))
        ended.wait(30)  # half-closes only once cancelled

    ended = threading.Event()
    before = num_cancelled(server)
    with grpc.insecure_channel(server.target, options=SMALL_WINDOW) as channel:
        call = pb_grpc.InferenceStub(channel).Generate(frames(), timeout=60)
        call.add_callback(ended.set)
        with capture_logs() as logs:
            assert wait_until(lambda: is_blocked(sessions, 1), timeout_s=30)  # paused
            more.set()
            assert wait_until(lambda: sessions[0].num_waiting == num_waiting)
            call.cancel()
            assert wait_until(lambda: engine_is_empty(server.target))
            assert wait_until(lambda: num_cancelled(server) - before == num_running + num_waiting)
            assert server.telemetry.requests.flush(10)
    unadmitted = sorted(
        e["client_request_id"]
        for e in logs
        if e.get("event") == "request_finished" and e["message"] == session.CALL_ENDED_UNADMITTED
    )
    assert unadmitted == ["r4", "r5", "r6"]

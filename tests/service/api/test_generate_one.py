"""``GenerateOne`` over a real ``grpc.aio`` server on loopback, with the real
engine on ``tiny``: the events of ``Generate`` for one request, rejections as
gRPC statuses, cancel and call deadlines freeing the KV at once, trace
context from metadata, the clients' ``generate_one``; and the server's
maximum connection age with the shared stream moving to a new connection."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Iterator

import grpc
import polling
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from server_thread import hold_every_submit
from structlog.testing import capture_logs

from slipstream.clients import AsyncClient, Client, StreamError
from slipstream.service.api.lifecycle import Lifecycle
from slipstream.service.api.server import build_server, connection_age_options
from slipstream.service.api.session import CALL_ENDED
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import RequestSpec
from slipstream.service.telemetry.tracing import Telemetry
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

CONFIG = EngineConfig(
    model="tiny",
    dtype="float32",
    max_queue_len=4096,
    reject_infeasible=False,
    abandon_hopeless=False,
)
LONG = 960  # tokens: outlives anything a test does to it
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class ServerThread:
    """A started server on its own event loop thread; ``lifecycle`` is its own."""

    def __init__(
        self,
        engine: object,
        telemetry: Telemetry | None = None,
        options: list[tuple[str, object]] | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.lifecycle = Lifecycle(engine)  # type: ignore[arg-type]

        async def start() -> tuple[grpc.aio.Server, int]:
            server, port = build_server(self.lifecycle, "127.0.0.1", 0, telemetry, options or [])
            if telemetry is not None:
                telemetry.attach(engine)  # type: ignore[arg-type]
            await server.start()
            await self.lifecycle.serve()
            return server, port

        self.server, self.port = self.run(start())  # type: ignore[misc]
        self.target = f"127.0.0.1:{self.port}"

    def run(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(engine: object, spans: InMemorySpanExporter) -> Iterator[ServerThread]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    srv = ServerThread(engine, Telemetry(provider))
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target) as c:
        yield c


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.InferenceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.InferenceStub(channel)


# The shared poll, with this file's own patience.
wait_until = functools.partial(polling.wait_until, timeout_s=5.0)


def engine_idle(engine: object) -> bool:
    stats = engine.stats()  # type: ignore[attr-defined]
    return (stats.waiting, stats.running, stats.device_blocks.used) == (0, 0, 0)


def submit(request_id: str = "a", **fields: object) -> pb.Submit:
    message = pb.Submit(request_id=request_id, **fields)  # type: ignore[arg-type]
    if message.WhichOneof("prompt") is None:
        message.token_ids.ids.extend([5, 17, 99, 310])
    return message


def local_greedy(engine: object, prompt: list[int], max_tokens: int) -> list[int]:
    request = RequestSpec(req_id="local", prompt_token_ids=prompt, max_new_tokens=max_tokens)
    return engine.generate([request])[0].token_ids  # type: ignore[attr-defined]


# ---------------------------------------------------------------- events


def test_events_are_accepted_chunks_finished_then_ok(
    stub: pb_grpc.InferenceStub, engine: object
) -> None:
    call = stub.GenerateOne(
        submit("one", stopping=pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True)),
        timeout=30,
    )
    responses = list(call)
    assert call.code() is grpc.StatusCode.OK
    kinds = [r.WhichOneof("event") for r in responses]
    assert kinds[0] == "accepted" and kinds[-1] == "finished"
    assert set(kinds[1:-1]) == {"chunk"}
    assert all(r.request_id == "one" for r in responses)
    ids = [t for r in responses[1:-1] for t in r.chunk.token_ids]
    assert ids == local_greedy(engine, [5, 17, 99, 310], 12)
    finished = responses[-1].finished
    assert finished.reason == pb.FINISH_REASON_MAX_TOKENS and finished.status_code == "OK"
    assert finished.usage.output_tokens == 12 and responses[0].accepted.num_prompt_tokens == 4


def test_the_clients_generate_one_matches_the_multiplexed_stream(
    client: Client, engine: object
) -> None:
    prompt = [9, 8, 7, 6, 5, 4]
    one = client.generate_one(prompt, max_tokens=10, ignore_eos=True)
    chunks = list(one)
    result = one.result(timeout=30)
    shared = client.generate(prompt, max_tokens=10, ignore_eos=True).result(timeout=30)
    also_one = client.generate(prompt, multiplex=False, max_tokens=10, ignore_eos=True)
    assert result.token_ids == shared.token_ids == also_one.result(timeout=30).token_ids
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert result.finish_reason == "max_tokens" and result.queue_position is not None


def test_the_async_client_generates_one_per_call(server: ServerThread) -> None:
    async def main() -> list[str]:
        async with AsyncClient(server.target) as client:
            generations = [
                await client.generate_one(f"hello {i}", request_id=f"q{i}", max_tokens=6)
                for i in range(8)
            ]
            generations.append(await client.generate("x", multiplex=False, max_tokens=3))
            return [(await g.result()).finish_reason for g in generations]

    reasons = asyncio.run(main())
    assert len(reasons) == 9 and set(reasons) <= {"max_tokens", "eos"}


# ---------------------------------------------------------------- rejection


def test_a_bad_submit_ends_the_call_with_its_status_and_no_event(
    stub: pb_grpc.InferenceStub, client: Client
) -> None:
    call = stub.GenerateOne(
        submit("bad", stopping=pb.StoppingCriteria(max_new_tokens=0)), timeout=10
    )
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_new_tokens" in info.value.details()
    assert dict(info.value.trailing_metadata())["slipstream-reject-reason"] == "invalid"
    # The client turns it into the same result a stream gives.
    result = client.generate_one([5, 6], max_tokens=0).result(timeout=10)
    assert (result.finish_reason, result.reject_reason) == ("rejected", "invalid")
    assert result.status_code == "INVALID_ARGUMENT" and "max_new_tokens" in result.message


def test_an_empty_request_id_is_rejected(stub: pb_grpc.InferenceStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateOne(submit(""), timeout=10))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_a_draining_server_refuses_with_unavailable(engine: object) -> None:
    srv = ServerThread(engine)
    try:
        srv.run(srv.lifecycle.drain())
        with Client(srv.target) as client:
            # Refused as a call, with its reason trailed: the client's rejection.
            result = client.generate_one("late", max_tokens=4).result(timeout=10)
        outcome = (result.finish_reason, result.reject_reason, result.status_code)
        assert outcome == ("rejected", "draining", "UNAVAILABLE")
    finally:
        engine._draining = False  # type: ignore[attr-defined]  # shared by the module
        srv.stop()


# ---------------------------------------------------------------- cancel, deadline


def test_cancelling_the_call_frees_the_kv_at_once(client: Client, engine: object) -> None:
    generation = client.generate_one("cancel me", max_tokens=LONG, ignore_eos=True)
    next(iter(generation))
    assert engine.stats().running == 1  # type: ignore[attr-defined]
    started = time.monotonic()
    with capture_logs() as logs:
        generation.cancel()
        result = generation.result(timeout=10)
        assert (result.finish_reason, result.status_code) == ("cancelled", "CANCELLED")
        assert wait_until(lambda: any(e["event"] == "request_finished" for e in logs))
    # No Finished came: the client counts the prompt as the server's Accepted did.
    assert result.prompt_tokens == len(client.tokenize("cancel me")) > 0
    # The server's line says the call ended, not "the stream ended" (GenerateOne has none).
    [line] = [e for e in logs if e["event"] == "request_finished"]
    assert line["message"] == CALL_ENDED
    assert 1 <= len(result.token_ids) < LONG
    assert wait_until(lambda: engine_idle(engine), timeout_s=2.0)
    assert time.monotonic() - started < 2.0


def test_the_call_deadline_is_the_requests_deadline(
    client: Client, engine: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold_every_submit(engine, monkeypatch)  # it cannot finish before the deadline
    generation = client.generate_one("too slow", max_tokens=LONG, ignore_eos=True, timeout=0.5)
    # The engine expires the request at the same instant the call's deadline
    # ends the call: whichever reaches the client first, the caller gets the
    # same result.
    result = generation.result(timeout=10)
    assert result.finish_reason == "deadline_exceeded", result
    assert result.status_code == "DEADLINE_EXCEEDED"
    assert result.prompt_tokens == len(client.tokenize("too slow")) > 0
    assert wait_until(lambda: engine_idle(engine), timeout_s=2.0)


def test_the_submits_own_timeout_when_tighter_than_the_call(
    stub: pb_grpc.InferenceStub, engine: object
) -> None:
    message = submit("t", stopping=pb.StoppingCriteria(max_new_tokens=LONG, ignore_eos=True))
    message.timeout.FromMilliseconds(300)
    responses = list(stub.GenerateOne(message, timeout=30))
    assert responses[-1].finished.reason == pb.FINISH_REASON_DEADLINE_EXCEEDED
    assert wait_until(lambda: engine_idle(engine), timeout_s=2.0)


# ---------------------------------------------------------------- tracing


def test_trace_context_comes_from_the_call_metadata(
    client: Client, spans: InMemorySpanExporter
) -> None:
    spans.clear()
    result = client.generate_one(
        "traced", request_id="tr", max_tokens=3, metadata=[("traceparent", TRACEPARENT)]
    ).result(timeout=30)
    assert result.is_ok
    _, trace_id, parent_id, _ = TRACEPARENT.split("-")

    def request_spans() -> list[object]:
        return [
            s
            for s in spans.get_finished_spans()
            if s.parent is not None and s.parent.span_id == int(parent_id, 16)
        ]

    assert wait_until(lambda: len(request_spans()) == 1)
    (request_span,) = request_spans()
    assert format(request_span.context.trace_id, "032x") == trace_id  # type: ignore[attr-defined]


# ---------------------------------------------------------------- connection age


def test_connection_age_options_are_checked() -> None:
    assert connection_age_options(2.5, 30) == [
        ("grpc.max_connection_age_ms", 2500),
        ("grpc.max_connection_age_grace_ms", 30000),
    ]
    assert connection_age_options(None, None) == []
    with pytest.raises(ValueError, match="positive"):
        connection_age_options(0, None)
    with pytest.raises(ValueError, match="negative"):
        connection_age_options(1, -1)


def test_past_its_maximum_age_the_stream_finishes_and_new_requests_use_a_new_one(
    engine: object,
) -> None:
    srv = ServerThread(engine, options=connection_age_options(1.0, 30.0))
    try:
        with Client(srv.target) as client:
            running = client.generate("before", max_tokens=200, ignore_eos=True)
            next(iter(running))
            first_stream = client._shared
            time.sleep(1.5)  # past the age: the server sent GOAWAY
            later = [client.generate(f"after {i}", max_tokens=4) for i in range(3)]
            assert client._shared is not first_stream  # moved to a new stream
            assert all(g.result(timeout=30).is_ok for g in later)
            result = running.result(timeout=60)  # within the grace, on the old connection
            assert result.finish_reason == "max_tokens" and len(result.token_ids) == 200
    finally:
        srv.stop()


def test_a_request_cut_off_by_the_age_grace_is_not_logged_as_a_client_cancel(
    engine: object, server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server cannot tell the connection closed at the end of the grace
    from a client's cancel: the line says it may be either. (``server``'s
    telemetry, attached to the engine, writes the line.)"""
    hold_every_submit(engine, monkeypatch)  # it cannot finish within the grace
    srv = ServerThread(engine, options=connection_age_options(0.3, 0.3))
    try:
        with Client(srv.target) as client, capture_logs() as logs:
            running = client.generate("cut off", max_tokens=LONG, ignore_eos=True)
            with pytest.raises(StreamError, match="max connection age"):
                running.result(timeout=60)
            assert wait_until(lambda: any(e["event"] == "request_finished" for e in logs))
        [line] = [e for e in logs if e["event"] == "request_finished"]
        assert line["reason"] == "cancelled"
        assert "or its connection closed by the server" in line["message"]
    finally:
        srv.stop()


def test_the_async_client_also_moves_to_a_new_stream_past_the_age(engine: object) -> None:
    srv = ServerThread(engine, options=connection_age_options(1.0, 30.0))

    async def main() -> None:
        async with AsyncClient(srv.target) as client:
            running = await client.generate("before", max_tokens=200, ignore_eos=True)
            await running._chunks.get()
            first_stream = client._shared
            await asyncio.sleep(1.5)
            later = [await client.generate(f"after {i}", max_tokens=4) for i in range(3)]
            assert client._shared is not first_stream
            assert all([(await g.result()).is_ok for g in later])
            result = await running.result()
            assert result.finish_reason == "max_tokens" and len(result.token_ids) == 200

    try:
        asyncio.run(main())
    finally:
        srv.stop()


def test_the_cli_sends_one_call_per_prompt(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    from slipstream.service.cli import main

    common = ["--prompt", "Hello", "--prompt", "Bye", "--max-tokens", "8", "--json"]
    outputs = {}
    for mode in ([], ["--per-request"]):
        assert main(["generate", "--server", server.target, *mode, *common]) == 0
        lines = capsys.readouterr().out.splitlines()  # the in-process server logs here too
        outputs[bool(mode)] = [json.loads(line) for line in lines if line.startswith("{")]
    assert outputs[True] == outputs[False] and len(outputs[True]) == 2
    argv = ["generate", "--server", server.target, "--per-request", "--prompt", "x"]
    assert main([*argv, "--max-tokens", str(LONG), "--ignore-eos", "--cancel-after", "3"]) == 0
    assert "(cancelled)" in capsys.readouterr().out

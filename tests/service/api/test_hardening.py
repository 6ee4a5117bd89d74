"""Hostile and careless clients against a real ``grpc.aio`` server on tiny:
frames that do not parse, inputs over the limits, large prompts (tokenized
off the event loop), and clients that stop reading (paused, then cancelled
SLOW_READER). Each fails alone; the server and its other streams go on."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from polling import wait_until
from server_thread import ServerThread
from structlog.testing import capture_logs

from slipstream.service.api import servicer, session, wire, workers
from slipstream.service.api.limits import Limits
from slipstream.service.api.workers import WorkerPool, WorkersBusy
from slipstream.service.engine.config import EngineConfig
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

CONFIG = EngineConfig(
    model="tiny",
    dtype="float32",
    reject_infeasible=False,
    abandon_hopeless=False,
    calibrate_cost_model=False,
)
LIMITS = Limits(
    max_prompt_bytes=3000,
    max_stop_sequences=2,
    max_stop_sequence_bytes=8,
    max_trace_context_entries=2,
    max_trace_context_bytes=64,
    max_outbox_events=64,
    slow_reader_grace_s=2.0,
    inline_prompt_bytes=1024,
)
GENERATE = "/slipstream.v1.Inference/Generate"
NEVER_READS = Path(__file__).with_name("never_reads.py")


@pytest.fixture(scope="module")
def server(engine: object) -> Iterator[ServerThread]:
    srv = ServerThread(engine, limits=LIMITS)
    yield srv
    srv.stop()


@pytest.fixture
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def no_blocks_used(channel: grpc.Channel) -> bool:
    stats = pb_grpc.InferenceStub(channel).GetServerStats(pb.GetServerStatsRequest())
    return (stats.kv_blocks_used.device, stats.kv_blocks_used.host, stats.running) == (0, 0, 0)


def submit(request_id: str, max_new_tokens: int = 8, **fields: object) -> pb.GenerateRequest:
    if "text" not in fields:
        fields.setdefault("token_ids", pb.TokenIds(ids=[5, 6, 7]))
    return pb.GenerateRequest(
        submit=pb.Submit(
            request_id=request_id,
            stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
            **fields,  # type: ignore[arg-type]
        )
    )


# ---------------------------------------------------------------- frames that do not parse

VALID = submit("ok", max_new_tokens=4).SerializeToString()
BAD_FRAMES = {
    "garbage": b"\xff\xff\xff\xff",
    "truncated": VALID[:-3],
    "wrong-type": pb.GenerateRequest(submit=pb.Submit(request_id="\x00"))
    .SerializeToString()
    .replace(b"\x0a\x01\x00", b"\x0d\x01\x00\x00\x00"),  # request_id as a fixed32
    "bad-utf8": b"\x0a\x04\x0a\x02\xc3\x28",  # submit.request_id = invalid UTF-8
}


@pytest.mark.parametrize("frame", list(BAD_FRAMES.values()), ids=list(BAD_FRAMES))
def test_a_frame_that_does_not_parse_ends_only_its_stream(
    channel: grpc.Channel, frame: bytes
) -> None:
    generate = channel.stream_stream(GENERATE, response_deserializer=pb.GenerateResponse.FromString)
    neighbour = pb_grpc.InferenceStub(channel).Generate(iter([submit("neighbour", 40)]), timeout=30)
    with capture_logs() as logs, pytest.raises(grpc.RpcError) as err:
        list(generate(iter([VALID, frame]), timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert "does not parse as a slipstream.v1.GenerateRequest" in details, details
    assert "Error" not in details.replace("Error parsing", "") and "Traceback" not in details
    lines = [entry for entry in logs if entry["event"] == "stream_invalid"]
    assert len(lines) == 1 and "exc_info" not in lines[0]
    # The neighbour stream runs to its end; nothing is left holding blocks.
    finishes = [r.finished.reason for r in neighbour if r.WhichOneof("event") == "finished"]
    assert finishes == [pb.FINISH_REASON_MAX_TOKENS]
    assert wait_until(lambda: no_blocks_used(channel))


SUBMIT = submit("one", max_new_tokens=4).submit.SerializeToString()
BAD_SUBMITS = {
    "garbage": b"\xff\xff\xff\xff",
    "truncated": SUBMIT[:-3],
    "bad-utf8": b"\x0a\x02\xc3\x28",  # request_id = invalid UTF-8
}


@pytest.mark.parametrize("frame", list(BAD_SUBMITS.values()), ids=list(BAD_SUBMITS))
def test_generate_one_with_a_frame_that_does_not_parse_is_invalid_argument(
    channel: grpc.Channel, frame: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    generate_one = channel.unary_stream(
        "/slipstream.v1.Inference/GenerateOne",
        response_deserializer=pb.GenerateResponse.FromString,
    )
    with capture_logs() as logs, pytest.raises(grpc.RpcError) as err:
        list(generate_one(frame, timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert f"a {len(frame)}-byte message does not parse as a slipstream.v1.Submit" in details
    lines = [entry for entry in logs if entry["event"] == "call_invalid"]
    assert len(lines) == 1 and "exc_info" not in lines[0]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert list(generate_one(SUBMIT, timeout=30))[-1].WhichOneof("event") == "finished"


def test_parse_generate_request_never_raises() -> None:
    assert isinstance(wire.parse_generate_request(VALID), pb.GenerateRequest)
    for frame in BAD_FRAMES.values():
        bad = wire.parse_generate_request(frame)
        assert isinstance(bad, wire.BadFrame) and bad.num_bytes == len(frame)


# ---------------------------------------------------------------- over the limits


def _with_top_level_unknown_field() -> pb.GenerateRequest:
    message = submit("top-unknown")
    message.MergeFromString(bytes([0xF8, 0x3E, 0x01]))  # field 999 on the GenerateRequest
    return message


OVER_LIMITS = {
    "prompt-bytes": (submit("prompt-bytes", text="é" * 1501), pb.REJECT_REASON_INVALID),
    "stop-count": (submit("stop-count"), pb.REJECT_REASON_INVALID),
    "stop-bytes": (submit("stop-bytes"), pb.REJECT_REASON_INVALID),
    "trace-entries": (
        submit("trace-entries", trace_context={"a": "1", "b": "2", "c": "3"}),
        pb.REJECT_REASON_INVALID,
    ),
    "trace-bytes": (submit("trace-bytes", trace_context={"k": "v" * 64}), pb.REJECT_REASON_INVALID),
    "ids-over-context": (
        submit("ids-over-context", token_ids=pb.TokenIds(ids=[9] * 200_000)),
        pb.REJECT_REASON_PROMPT_TOO_LONG,
    ),
    "nan-temperature": (
        submit("nan-temperature", sampling=pb.SamplingParams(temperature=float("nan"))),
        pb.REJECT_REASON_INVALID,
    ),
    "inf-top-p": (
        submit("inf-top-p", sampling=pb.SamplingParams(top_p=float("inf"))),
        pb.REJECT_REASON_INVALID,
    ),
    "top-unknown": (_with_top_level_unknown_field(), pb.REJECT_REASON_INVALID),
}
OVER_LIMITS["stop-count"][0].submit.stopping.stop_sequences.extend(["a", "b", "c"])
OVER_LIMITS["stop-bytes"][0].submit.stopping.stop_sequences.append("123456789")


def test_each_input_over_a_limit_is_rejected_alone(channel: grpc.Channel) -> None:
    messages = [submit("neighbour", 24), *(m for m, _ in OVER_LIMITS.values())]
    finished = {
        r.request_id: r.finished
        for r in pb_grpc.InferenceStub(channel).Generate(iter(messages), timeout=30)
        if r.WhichOneof("event") == "finished"
    }
    assert finished["neighbour"].reason == pb.FINISH_REASON_MAX_TOKENS
    for request_id, (_, reason) in OVER_LIMITS.items():
        got = finished[request_id]
        assert (got.reason, got.reject_reason) == (pb.FINISH_REASON_REJECTED, reason), request_id
        assert got.message, request_id
    assert "3002 bytes" in finished["prompt-bytes"].message  # UTF-8 bytes, not characters


def test_tokenize_over_the_limit_fails_that_call(channel: grpc.Channel, engine: object) -> None:
    stub = pb_grpc.InferenceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(text="x" * 3001))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "3001 bytes" in (err.value.details() or "")
    text = "Hello world, " * 100  # over the inline size: tokenized on a worker
    reply = stub.Tokenize(pb.TokenizeRequest(text=text))
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    assert list(reply.token_ids) == tokenizer.encode(text)
    assert list(reply.tokens) == tokenizer.convert_ids_to_tokens(tokenizer.encode(text))


def test_tokenize_refuses_an_answer_over_the_message_limit(engine: object) -> None:
    """Text within the prompt limit whose answer would not fit in one message
    is refused INVALID_ARGUMENT, naming the limit (not left for gRPC to fail
    RESOURCE_EXHAUSTED once it is built); an answer of exactly the limit
    goes out."""
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    text = "é🙂 \x00" * 500
    ids = tokenizer.encode(text)
    answer = pb.TokenizeResponse(token_ids=ids, tokens=tokenizer.convert_ids_to_tokens(ids))
    srv = ServerThread(engine, limits=Limits(max_message_bytes=answer.ByteSize()))
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            assert stub.Tokenize(pb.TokenizeRequest(text=text)) == answer
            with pytest.raises(grpc.RpcError) as err:
                stub.Tokenize(pb.TokenizeRequest(text=text + "é"))
    finally:
        srv.stop()
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"message limit of {answer.ByteSize()} bytes" in (err.value.details() or "")


# ---------------------------------------------------------------- off the event loop


def test_a_large_prompt_is_converted_on_a_worker_thread(
    channel: grpc.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: dict[str, str] = {}
    convert = wire.to_generation_request

    def recording(submit: pb.Submit, *args: object) -> object:
        threads[submit.request_id] = threading.current_thread().name
        return convert(submit, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(wire, "to_generation_request", recording)
    messages = [submit("small", text="Hello"), submit("large", text="Hello world. " * 150)]
    finished = {
        r.request_id: r.finished.reason
        for r in pb_grpc.InferenceStub(channel).Generate(iter(messages), timeout=30)
        if r.WhichOneof("event") == "finished"
    }
    assert finished == {"small": pb.FINISH_REASON_MAX_TOKENS, "large": pb.FINISH_REASON_MAX_TOKENS}
    assert threads["large"].startswith("slipstream-tokenizer")
    assert not threads["small"].startswith("slipstream-tokenizer")  # not worth the hop


def test_worker_pool_is_bounded_and_trims_after_large_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trims: list[int] = []
    monkeypatch.setattr(workers, "release_memory", lambda: trims.append(1) or True)
    pool = WorkerPool(num_workers=1, max_queued=1, trim_after_bytes=100)
    gate = threading.Event()

    async def scenario() -> list[object]:
        loop_thread = threading.current_thread()
        first = asyncio.ensure_future(pool.run(lambda: gate.wait(5) and threading.current_thread()))
        second = asyncio.ensure_future(pool.run(lambda: "queued"))
        await asyncio.sleep(0.05)
        with pytest.raises(WorkersBusy):  # a large input counts against the bound too
            await pool.run(lambda: "one too many", input_bytes=100)
        gate.set()
        results = [await first, await second, await pool.run(lambda: "large", input_bytes=100)]
        assert results[0] is not loop_thread
        return results

    results = asyncio.run(scenario())
    pool.shutdown()
    assert results[1:] == ["queued", "large"] and pool.num_pending == 0
    assert trims == [1]  # only the large input released memory


def test_a_large_input_is_tokenized_at_the_lowest_priority() -> None:
    """A worker holding a core for long stalls every region of a CPU step: a
    large input takes only what the step leaves over, an ordinary one waits
    less (a lower priority than the engine, not the lowest)."""
    pool = WorkerPool(num_workers=1, max_queued=1, trim_after_bytes=100)

    def where() -> tuple[str, int]:
        thread = threading.current_thread().name
        return thread, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def both() -> list[tuple[str, int]]:
        return [await pool.run(where, 99), await pool.run(where, 100)]

    try:
        (ordinary, ordinary_nice), (large, large_nice) = asyncio.run(both())
    finally:
        pool.shutdown()
    assert ordinary.startswith("slipstream-tokenizer_") and large.startswith(
        "slipstream-tokenizer-large"
    )
    assert large_nice == 19  # the most Linux allows, whatever the process's own
    assert ordinary_nice == min(19, os.nice(0) + workers.WORKER_NICE) < 19


# ---------------------------------------------------------------- slow readers


def _live_outputs(engine: object) -> dict[str, int]:
    return engine.live_output_counts()  # type: ignore[attr-defined, no-any-return]


def test_a_client_that_stops_reading_is_paused_then_cancelled(
    server: ServerThread, channel: grpc.Channel, engine: object
) -> None:
    # A client process that submits and is then stopped: it reads nothing at all.
    client = subprocess.Popen(
        [sys.executable, str(NEVER_READS), server.target, "8", "1000"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "sent"
        os.kill(client.pid, signal.SIGSTOP)
        stats = engine.stats  # type: ignore[attr-defined]
        assert wait_until(lambda: stats().paused == 8, timeout_s=30), _live_outputs(engine)
        # A step planned before the pause may still land its tokens: wait until
        # the held requests' outputs stop moving, then check they stay put.
        held = _live_outputs(engine)

        def settled() -> bool:
            nonlocal held
            time.sleep(0.3)
            now = _live_outputs(engine)
            stable, held = now == held, now
            return stable

        assert wait_until(settled, timeout_s=30)
        # Another stream is served while they are held; the held ones do not move.
        other = pb_grpc.InferenceStub(channel).Generate(iter([submit("other", 32)]), timeout=30)
        reasons = [r.finished.reason for r in other if r.WhichOneof("event") == "finished"]
        assert reasons == [pb.FINISH_REASON_MAX_TOKENS]
        assert all(_live_outputs(engine).get(k, v) == v for k, v in held.items())
        assert max(held.values()) < 1000  # stopped well before the end
        # After the grace (2 s) they are cancelled and every block is back.
        with capture_logs() as logs:
            assert wait_until(lambda: not _live_outputs(engine), timeout_s=10)
        assert wait_until(lambda: no_blocks_used(channel))
        assert [e["event"] for e in logs].count("slow_reader_cancelled") == 1
    finally:
        client.kill()
        client.wait()


def test_a_client_that_writes_refused_submits_and_never_reads_is_held_back(
    server: ServerThread, engine: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refusals count against the unread bound as tokens do: past it the
    stream's submits wait unanswered, then unread, so the server's buffer
    stays bounded however many the client writes; its running request ends
    SLOW_READER after the grace, every submit is answered once the client
    reads, and the ended stream leaves nothing behind."""
    monkeypatch.setattr(session, "MAX_WAITING_SUBMITS", 8)
    sessions: list[weakref.ref[session.StreamSession]] = []

    class Recorded(session.StreamSession):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            sessions.append(weakref.ref(self))

    monkeypatch.setattr(servicer, "StreamSession", Recorded)
    num_refused = 3000  # 12 MB: more than flow control lets the client write ahead
    num_sent = 0

    def frames() -> Iterator[pb.GenerateRequest]:
        nonlocal num_sent
        yield submit("running", 1000)
        for i in range(num_refused):
            num_sent += 1
            refused = submit(f"over{i}")
            refused.submit.stopping.stop_sequences.append("x" * 4000)  # over the limit
            yield refused

    def unread() -> int:
        stream = sessions[0]()
        return -1 if stream is None else stream.num_unread

    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        call = pb_grpc.InferenceStub(channel).Generate(frames(), timeout=60)
        assert wait_until(lambda: bool(sessions) and unread() > 0)
        # Held back: what the client wrote stops being read and answered.
        assert wait_until(lambda: not _live_outputs(engine), timeout_s=15)  # SLOW_READER
        held = num_sent
        time.sleep(0.5)
        assert num_sent == held < num_refused
        assert 0 < unread() <= LIMITS.max_outbox_events + 8 + 1
        finished = [(r.request_id, r.finished) for r in call if r.WhichOneof("event") == "finished"]
        assert call.code() is grpc.StatusCode.OK
    reasons = dict(finished)
    assert len(finished) == len(reasons) == num_refused + 1
    assert reasons.pop("running").reason == pb.FINISH_REASON_SLOW_READER
    assert {f.reason for f in reasons.values()} == {pb.FINISH_REASON_REJECTED}
    del call
    assert wait_until(lambda: gc.collect() >= 0 and sessions[0]() is None)


def test_slow_reader_finish_maps_to_the_wire() -> None:
    from slipstream.scheduler.request import FinishReason
    from slipstream.service.api.status import wire_finish

    reason, status = wire_finish(FinishReason.SLOW_READER)
    assert (reason, status) == (pb.FINISH_REASON_SLOW_READER, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.mark.parametrize(
    ("cause", "code"),
    [("SHED", "RESOURCE_EXHAUSTED"), ("DEADLINE_INFEASIBLE", "DEADLINE_EXCEEDED"), (None, None)],
)
def test_spans_carry_the_status_the_wire_carries(cause: str | None, code: str | None) -> None:
    """A request the scheduler rejected after queueing it (shed, infeasible)
    gets on its span the status its caller saw, not a generic one."""
    from slipstream.scheduler.request import FinishReason, RejectCause
    from slipstream.service.api.status import finish_status, rejection_for_cause
    from slipstream.service.engine.events import FinishEvent

    reject_cause = None if cause is None else RejectCause[cause]
    event = FinishEvent("r", FinishReason.REJECTED, reject_cause=reject_cause)
    status = finish_status(event)
    if reject_cause is None:
        assert status.name == "FAILED_PRECONDITION"
    else:
        assert status.name == code == rejection_for_cause(reject_cause).status.name
    assert finish_status(FinishEvent("r", FinishReason.MAX_TOKENS)).name == "OK"


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    yield
    structlog.reset_defaults()

"""Fuzzing a live server on tiny: structured (hypothesis over every Submit
field, extremes included) and byte-level (mutated, truncated and mistyped
frames sent raw). Whatever arrives, the server stays SERVING, every submit
that parses gets exactly one Finished, the stream ends OK or
INVALID_ARGUMENT (never UNKNOWN), and afterwards no KV block is in use.

``make test`` runs a few examples; ``make fuzz`` (SLIPSTREAM_FUZZ_EXAMPLES)
runs many more.
"""

from __future__ import annotations

import collections
import functools
import os
import time
from collections.abc import Iterator

import grpc
import polling
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_thread import ServerThread

from slipstream.service.engine.config import EngineConfig
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

NUM_EXAMPLES = int(os.environ.get("SLIPSTREAM_FUZZ_EXAMPLES", "12"))
FUZZ = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=NUM_EXAMPLES <= 12,  # the short CI run is the same every time
)
GENERATE = "/slipstream.v1.Inference/Generate"
CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)
CALL_TIMEOUT_S = 60.0

INT32 = (-(2**31), 2**31 - 1)
UINT32_MAX = 2**32 - 1
INT64 = (-(2**63), 2**63 - 1)


@pytest.fixture(scope="module")
def channel(engine: object) -> Iterator[grpc.Channel]:
    server = ServerThread(engine)
    with grpc.insecure_channel(server.target) as ch:
        yield ch
    server.stop()


# ---------------------------------------------------------------- strategies


def _extremes(low: int, high: int, small: tuple[int, int] = (0, 8)) -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(*small), st.sampled_from([low, high, low + 1, high - 1, 0, -1 if low else 1])
    )


floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1.0, 0.5, -0.0, 1e-45, 3.4e38]),
)
texts = st.text(max_size=40)
durations = st.builds(Duration, seconds=_extremes(*INT64), nanos=_extremes(*INT32))
timestamps = st.builds(
    Timestamp,
    seconds=st.one_of(_extremes(*INT64), st.just(int(time.time()) + 30)),
    nanos=_extremes(*INT32),
)
token_ids = st.builds(
    pb.TokenIds,
    ids=st.lists(st.one_of(st.integers(0, 4095), st.sampled_from([4096, UINT32_MAX])), max_size=40),
)
prompt = st.one_of(
    st.fixed_dictionaries({"text": texts}),
    st.fixed_dictionaries({"token_ids": token_ids}),
    st.fixed_dictionaries(
        {
            "messages": st.builds(
                pb.ChatMessages,
                messages=st.lists(st.builds(pb.ChatMessage, role=texts, content=texts), max_size=3),
            )
        }
    ),
    st.just({}),
)
sampling = st.builds(
    pb.SamplingParams,
    temperature=floats,
    top_k=_extremes(0, UINT32_MAX),
    top_p=st.one_of(st.none(), floats),
    seed=st.one_of(st.none(), _extremes(0, 2**64 - 1)),
    presence_penalty=floats,
    frequency_penalty=floats,
    repetition_penalty=st.one_of(st.none(), floats),
    logit_bias=st.dictionaries(_extremes(0, UINT32_MAX), floats, max_size=4),
    min_p=st.one_of(st.none(), floats),
)
stopping = st.builds(
    pb.StoppingCriteria,
    # Small budgets keep each example short; the extremes are rejected.
    max_new_tokens=st.one_of(st.none(), st.integers(0, 6), st.sampled_from([10**6, UINT32_MAX])),
    stop_sequences=st.lists(st.text(max_size=300), max_size=20),
    ignore_eos=st.booleans(),
    min_tokens=st.one_of(st.integers(0, 6), _extremes(0, UINT32_MAX)),
    stop_token_ids=st.lists(_extremes(0, UINT32_MAX), max_size=70),
)


@st.composite
def submits(draw: st.DrawFn) -> pb.Submit:
    fields: dict[str, object] = {
        "request_id": draw(st.one_of(st.sampled_from(["a", "b", ""]), st.text(max_size=140))),
        **draw(prompt),
        "sampling": draw(sampling),
        "stopping": draw(stopping),
        "priority": draw(_extremes(*INT32)),
        "trace_context": draw(st.dictionaries(texts, texts, max_size=10)),
        "return_logprobs": draw(st.booleans()),
    }
    optional = {
        "timeout": durations,
        "deadline": timestamps,
        "first_token_timeout": durations,
        "expected_output_tokens": _extremes(0, UINT32_MAX),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            fields[name] = draw(strategy)
    return pb.Submit(**fields)  # type: ignore[arg-type]


def neighbour(request_id: str = "neighbour") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        submit=pb.Submit(
            request_id=request_id,
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True),
        )
    )


# ---------------------------------------------------------------- checks


# The shared poll, with this file's own patience.
wait_until = functools.partial(polling.wait_until, timeout_s=30.0)


def check_server(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    stub = pb_grpc.InferenceStub(channel)

    def idle() -> bool:
        stats = stub.GetServerStats(pb.GetServerStatsRequest())
        used = (stats.kv_blocks_used.device, stats.kv_blocks_used.host)
        return used == (0, 0) and (stats.waiting, stats.running, stats.swapped) == (0, 0, 0)

    assert wait_until(idle), stub.GetServerStats(pb.GetServerStatsRequest())


def run_stream(
    channel: grpc.Channel, frames: list[bytes]
) -> tuple[grpc.StatusCode, list[pb.GenerateResponse]]:
    generate = channel.stream_stream(GENERATE, response_deserializer=pb.GenerateResponse.FromString)
    responses: list[pb.GenerateResponse] = []
    try:
        for response in generate(iter(frames), timeout=CALL_TIMEOUT_S):
            responses.append(response)
    except grpc.RpcError as exc:
        return exc.code(), responses
    return grpc.StatusCode.OK, responses


def parsed_submit_ids(frames: list[bytes]) -> collections.Counter[str] | None:
    """Request ids of the submits among ``frames``, or None when a frame ends
    the stream (does not parse, or is neither a submit nor a cancel)."""
    ids: collections.Counter[str] = collections.Counter()
    for frame in frames:
        try:
            message = pb.GenerateRequest.FromString(frame)
        except Exception:
            return None
        kind = message.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "submit":
            ids[message.submit.request_id] += 1
    return ids


def check_outcome(
    channel: grpc.Channel, frames: list[bytes], outcome: tuple[grpc.StatusCode, list]
) -> None:  # type: ignore[type-arg]
    code, responses = outcome
    expected = parsed_submit_ids(frames)
    if expected is None:
        assert code is grpc.StatusCode.INVALID_ARGUMENT, code
    else:
        assert code is grpc.StatusCode.OK, (code, responses[-1:] if responses else None)
        finished = collections.Counter(
            r.request_id for r in responses if r.WhichOneof("event") == "finished"
        )
        assert finished == expected
    check_server(channel)


# ---------------------------------------------------------------- structured


@FUZZ
@given(
    fuzzed=st.lists(submits(), min_size=1, max_size=3),
    cancel=st.one_of(st.none(), st.sampled_from(["a", "b", "neighbour", ""])),
)
def test_structured_submits(
    channel: grpc.Channel, fuzzed: list[pb.Submit], cancel: str | None
) -> None:
    messages = [neighbour(), *(pb.GenerateRequest(submit=s) for s in fuzzed)]
    if cancel is not None:
        messages.append(pb.GenerateRequest(cancel=pb.Cancel(request_id=cancel)))
    messages.append(neighbour("last"))
    frames = [m.SerializeToString() for m in messages]
    check_outcome(channel, frames, run_stream(channel, frames))


# ---------------------------------------------------------------- byte level

SEEDS = [
    neighbour("seed").SerializeToString(),
    pb.GenerateRequest(
        submit=pb.Submit(
            request_id="full",
            text="Hello there",
            sampling=pb.SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3),
            stopping=pb.StoppingCriteria(max_new_tokens=3, stop_sequences=["\n"]),
            priority=1,
            timeout=Duration(seconds=20),
            trace_context={
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            },
        )
    ).SerializeToString(),
    pb.GenerateRequest(cancel=pb.Cancel(request_id="seed")).SerializeToString(),
]


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    frame = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "retype"]))
        if not frame:
            break
        at = draw(st.integers(0, len(frame) - 1))
        if op == "flip":
            frame[at] = draw(st.integers(0, 255))
        elif op == "truncate":
            del frame[at:]
        elif op == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del frame[at]
        else:  # change a field key's wire type (low 3 bits)
            frame[at] = (frame[at] & ~0x07) | draw(st.sampled_from([0, 1, 2, 5, 3, 4, 6, 7]))
    return bytes(frame)


@FUZZ
@given(frame=mutated_frames(), garbage=st.binary(max_size=16))
def test_mutated_frames(channel: grpc.Channel, frame: bytes, garbage: bytes) -> None:
    for frames in (
        [neighbour().SerializeToString(), frame, neighbour("last").SerializeToString()],
        [garbage],
    ):
        check_outcome(channel, frames, run_stream(channel, frames))

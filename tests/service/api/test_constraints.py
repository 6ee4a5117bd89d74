"""Structured output through the gRPC front door on ``tiny``:
``Submit.constraint``. A constrained output matches (greedy and sampled); a
constraint that does not compile, or is too large, is refused
INVALID_ARGUMENT with the compiler's message, that request alone; the
compiling runs off the event loop."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import grpc
import pytest
from server_thread import ServerThread

from slipstream.service.engine.config import EngineConfig
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

CONFIG = EngineConfig(model="tiny", dtype="float32", max_queue_len=4096, calibrate_cost_model=False)
YES_NO = '{"enum": ["yes", "no"]}'


@pytest.fixture(scope="module")
def server(engine: object) -> Iterator[ServerThread]:
    srv = ServerThread(engine)
    yield srv
    srv.stop()


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.InferenceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.InferenceStub(channel)


def _submit(request_id: str, constraint: pb.OutputConstraint | None, **fields) -> pb.Submit:
    submit = pb.Submit(
        request_id=request_id,
        text="Once upon a time",
        stopping=pb.StoppingCriteria(max_new_tokens=16),
        **fields,
    )
    if constraint is not None:
        submit.constraint.CopyFrom(constraint)
    return submit


def _stream(stub: pb_grpc.InferenceStub, submits: list[pb.Submit]) -> dict[str, tuple]:
    """Every submit's (text, Finished) from one Generate stream."""
    responses = stub.Generate(iter([pb.GenerateRequest(submit=s) for s in submits]), timeout=60)
    texts: dict[str, list[str]] = {s.request_id: [] for s in submits}
    finished = {}
    for response in responses:
        kind = response.WhichOneof("event")
        if kind == "chunk":
            texts[response.request_id].append(response.chunk.text)
        elif kind == "finished":
            texts[response.request_id].append(response.finished.text)
            finished[response.request_id] = response.finished
    return {rid: ("".join(parts), finished[rid]) for rid, parts in texts.items()}


def test_a_streams_bad_constraint_fails_alone_beside_constrained_ones(stub):
    sampled = pb.SamplingParams(temperature=1.0, seed=7)
    results = _stream(
        stub,
        [
            _submit("digits", pb.OutputConstraint(regex="[0-9]{3}")),
            _submit("bad", pb.OutputConstraint(regex="[0-9")),
            _submit("yes_no", pb.OutputConstraint(json_schema=YES_NO), sampling=sampled),
            _submit("plain", None),
        ],
    )
    text, finished = results["bad"]
    assert finished.reason == pb.FINISH_REASON_REJECTED
    assert finished.reject_reason == pb.REJECT_REASON_INVALID
    assert finished.status_code == "INVALID_ARGUMENT"
    assert "regex" in finished.message and "unclosed character class" in finished.message
    text, finished = results["digits"]
    assert re.fullmatch("[0-9]{3}", text), text
    assert finished.reason == pb.FINISH_REASON_STOP_SEQUENCE and finished.status_code == "OK"
    text, finished = results["yes_no"]
    assert json.loads(text) in ("yes", "no")
    assert finished.reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert results["plain"][1].status_code == "OK"


def test_generate_one_refuses_a_schema_that_does_not_compile(stub):
    call = stub.GenerateOne(
        _submit("one", pb.OutputConstraint(json_schema='{"type": "nope"}')), timeout=30
    )
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "Invalid type: nope" in info.value.details()


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (pb.OutputConstraint(regex="a" * (64 * 1024 + 1)), "the constraint is 65537 bytes"),
        (pb.OutputConstraint(json_object=False), "json_object must be true"),
        (pb.OutputConstraint(), "constraint names no kind"),
        (pb.OutputConstraint(json_schema="{"), "json_schema is not valid JSON"),
    ],
    ids=["too_large", "json_object_false", "no_kind", "not_json"],
)
def test_malformed_constraints_are_invalid_argument(stub, constraint, words):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateOne(_submit("m", constraint), timeout=30))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


def test_constraints_compile_off_the_event_loop(stub, server, engine, monkeypatch):
    threads = []
    compile_it = engine.grammars.compile

    def spy(constraint):
        threads.append(threading.current_thread())
        return compile_it(constraint)

    monkeypatch.setattr(engine.grammars, "compile", spy)
    list(stub.GenerateOne(_submit("off", pb.OutputConstraint(regex="[0-9]{2}")), timeout=30))
    assert threads and server.thread not in threads

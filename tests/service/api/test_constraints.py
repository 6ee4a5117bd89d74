"""Structured output through both front doors on ``tiny``: gRPC's
``Submit.constraint`` and OpenAI's ``response_format``. A constrained
output matches (greedy and sampled); a constraint that does not compile,
or is too large, is refused INVALID_ARGUMENT (a 400 naming
``response_format``) with the compiler's message, that request alone; the
compiling runs off the event loop."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import grpc
import pytest
from http_front_thread import FrontThread
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


@pytest.fixture(scope="module")
def front(engine: object) -> Iterator[FrontThread]:
    front = FrontThread(engine)
    yield front
    front.stop()


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


def test_a_schema_that_breaks_the_compiler_fails_alone_on_its_stream(stub):
    """A schema nested deeper than Python's stack raised RecursionError on
    the worker: the stream ended UNKNOWN, every request on it with it."""
    deep = '{"not":' * 6000 + "{}" + "}" * 6000
    results = _stream(
        stub, [_submit("deep", pb.OutputConstraint(json_schema=deep)), _submit("plain", None)]
    )
    finished = results["deep"][1]
    assert finished.reason == pb.FINISH_REASON_REJECTED
    assert finished.status_code == "INVALID_ARGUMENT"
    assert "json_schema is nested too deeply" in finished.message
    assert results["plain"][1].status_code == "OK"


def test_a_compilers_long_message_is_cut_short(stub):
    """llguidance's message repeats the regex (160 KB here): as a trailer it
    went past gRPC's metadata limit, and the caller saw RESOURCE_EXHAUSTED."""
    nested = "(" * 20_000 + "a" + ")" * 20_000
    call = stub.GenerateOne(_submit("one", pb.OutputConstraint(regex=nested)), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid regex" in info.value.details() and len(info.value.details()) <= 500


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


def _spy_on_compile(engine, monkeypatch) -> list[tuple[str, threading.Thread]]:
    """(the constraint's text, the thread) of every compile from now on."""
    compiled = []
    compile_it = engine.grammars.compile

    def spy(constraint):
        compiled.append((constraint.text, threading.current_thread()))
        return compile_it(constraint)

    monkeypatch.setattr(engine.grammars, "compile", spy)
    return compiled


def test_constraints_compile_off_the_event_loop(stub, server, front, engine, monkeypatch):
    compiled = _spy_on_compile(engine, monkeypatch)
    # Constraints of this test alone: none is kept from another's compile.
    regex = pb.OutputConstraint(regex="[0-9]{2}(off the loop)?")
    list(stub.GenerateOne(_submit("off", regex), timeout=30))
    schema = _json_schema({"enum": ["off", "the", "loop"]})
    status, _ = _complete(front, response_format=schema, max_tokens=2)
    assert status == 200
    assert len(compiled) == 2
    threads = [thread for _, thread in compiled]
    assert server.thread not in threads and front.thread not in threads


def test_a_constraint_sent_again_is_not_compiled_again(stub, front, engine, monkeypatch):
    """Services send the same schema with every request: the compiled one is
    kept, and taken on the event loop, no worker needed."""
    compiled = _spy_on_compile(engine, monkeypatch)
    regex = pb.OutputConstraint(regex="[0-9]{2}(again)?")
    for i in range(3):
        list(stub.GenerateOne(_submit(f"again{i}", regex), timeout=30))
    schema = _json_schema({"enum": ["again", "and"]})
    for _ in range(3):
        status, body = _complete(front, response_format=schema, max_tokens=4, n=2)
        assert status == 200, body
        assert all(json.loads(c["text"]) in ("again", "and") for c in body["choices"])
    texts = [text for text, _ in compiled]
    assert len(texts) == 2 and texts[0] == "[0-9]{2}(again)?", texts


# ---------------------------------------------------------------- HTTP


def _complete(front: FrontThread, **fields) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, **fields}
    status, raw = front.post_bytes("/v1/completions", json.dumps(body).encode())
    return status, json.loads(raw)


def _json_schema(schema: object, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **extra}}


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_response_format_json_schema_is_followed(front, temperature):
    status, body = _complete(
        front,
        response_format=_json_schema(json.loads(YES_NO), strict=True),
        temperature=temperature,
        seed=3,
        n=2,
    )
    assert status == 200, body
    for choice in body["choices"]:
        assert json.loads(choice["text"]) in ("yes", "no")
        assert choice["finish_reason"] == "stop"


def test_response_format_json_object_starts_an_object(front):
    status, body = _complete(
        front, response_format={"type": "json_object"}, max_tokens=4, temperature=0
    )
    assert status == 200, body
    assert body["choices"][0]["text"].lstrip().startswith("{")


def test_response_format_text_is_no_constraint(front):
    asked = [{}, {"response_format": {"type": "text"}}]
    replies = [_complete(front, temperature=0, **extra) for extra in asked]
    assert all(status == 200 for status, _ in replies)
    assert replies[0][1]["choices"] == replies[1][1]["choices"]


@pytest.mark.parametrize(
    ("response_format", "words"),
    [
        ({"type": "xml"}, "response_format.type must be"),
        ("json", "must be an object with a type"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name is required"),
        ({"type": "json_object", "schema": {}}, "response_format.schema is not supported"),
        (_json_schema({"type": "nope"}), "Invalid type: nope"),
        (_json_schema({"enum": 5}), "enum must be an array"),
    ],
    ids=["type", "not_an_object", "no_name", "extra_key", "bad_type", "bad_enum"],
)
def test_a_bad_response_format_is_a_400_naming_it(front, response_format, words):
    status, body = _complete(front, response_format=response_format)
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "response_format" and error["type"] == "invalid_request_error"
    assert words in error["message"]

"""vLLM's ``min_p``, ``min_tokens`` and ``stop_token_ids`` on both front doors
and the Python client, end to end on the ``tiny`` model: the gRPC fields
and the OpenAI body's (vLLM's extra_body) reach the engine and answer as an
in-process caller's request does, and a bad value is refused before
anything runs: INVALID_ARGUMENT, a 400 naming the field, or the client's
ValueError before it sends."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import grpc
import pytest
from http_front_thread import FrontThread
from server_thread import ServerThread

from slipstream.clients import Client
from slipstream.clients.wire import GenerateOptions, build_submit
from slipstream.scheduler.request import SamplingParams
from slipstream.service.api.http.params import parse
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import RequestSpec
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)
PROMPT = "Hello there"
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def server(engine: object) -> Iterator[ServerThread]:
    srv = ServerThread(engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.InferenceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.InferenceStub(channel)


@pytest.fixture(scope="module")
def front(engine: object) -> Iterator[FrontThread]:
    srv = FrontThread(engine)
    yield srv
    srv.stop()


def local(engine: object, sampling: SamplingParams, ignore_eos: bool = True):
    """The engine's own result for ``PROMPT`` with ``sampling``."""
    ids = engine.tokenizer.encode(PROMPT)  # type: ignore[attr-defined]
    request = RequestSpec("local", ids, NUM_TOKENS, sampling=sampling, ignore_eos=ignore_eos)
    return engine.generate([request])[0]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def stop_id(engine: object) -> tuple[int, list[int]]:
    """A token the greedy answer first samples at its 4th place or later,
    and the answer up to and with it."""
    tokens = local(engine, SamplingParams()).token_ids
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    return tokens[at], tokens[: at + 1]


# ---------------------------------------------------------------- gRPC


def generate(stub: pb_grpc.InferenceStub, stopping: dict, **sampling: object):
    message = pb.Submit(
        request_id="a",
        text=PROMPT,
        sampling=pb.SamplingParams(**sampling),  # type: ignore[arg-type]
        stopping=pb.StoppingCriteria(max_new_tokens=NUM_TOKENS, ignore_eos=True, **stopping),
    )
    replies = list(stub.GenerateOne(message, timeout=60))
    tokens = [t for r in replies for t in r.chunk.token_ids]
    text = "".join(r.chunk.text for r in replies) + replies[-1].finished.text
    return tokens, text, replies[-1].finished.reason


def test_grpc_stop_token_ids_end_the_request_as_a_stop(stub, engine, stop_id) -> None:
    token, expected = stop_id
    tokens, text, reason = generate(stub, {"stop_token_ids": [token]})
    assert tokens == expected and reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert text == engine.tokenizer.decode(expected[:-1])  # the stop token's text left out


def test_grpc_min_tokens_holds_the_stop_id_back(stub, engine, stop_id) -> None:
    token, expected = stop_id
    stopping = {"stop_token_ids": [token], "min_tokens": len(expected)}
    sampling = SamplingParams(stop_token_ids=(token,), min_tokens=len(expected))
    tokens, _, _ = generate(stub, stopping)
    assert len(tokens) > len(expected) and tokens == local(engine, sampling).token_ids


def test_grpc_min_p_reaches_the_sampler(stub, engine) -> None:
    sampled, _, _ = generate(stub, {}, temperature=1.5, seed=7)
    narrowed, _, _ = generate(stub, {}, temperature=1.5, seed=7, min_p=1.0)
    assert narrowed == local(engine, SamplingParams()).token_ids != sampled


@pytest.mark.parametrize(
    ("stopping", "sampling", "words"),
    [
        ({}, {"min_p": 1.5}, "min_p must be in [0, 1] (0 is off), got 1.5"),
        ({}, {"min_p": -0.5}, "min_p must be in [0, 1] (0 is off), got -0.5"),
        ({}, {"min_p": float("nan")}, "min_p must be in [0, 1]"),
        ({"min_tokens": NUM_TOKENS + 1}, {}, "min_tokens (13) must be at most max_new_tokens (12)"),
        ({"stop_token_ids": [4096]}, {}, "token id 4096 is not in the vocabulary [0, 4096)"),
        ({"stop_token_ids": list(range(65))}, {}, "stop_token_ids has 65 ids, more than the 64"),
    ],
)
def test_grpc_refuses_a_bad_value_invalid_argument(stub, stopping, sampling, words) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, stopping, **sampling)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


def test_a_bad_value_on_a_stream_fails_alone(stub) -> None:
    """One stream: each bad submit is refused with its reason, and the
    good ones beside it finish as they would alone."""
    stopping = {"max_new_tokens": NUM_TOKENS, "ignore_eos": True}
    submits = [
        pb.Submit(request_id="good", text=PROMPT, stopping=pb.StoppingCriteria(**stopping)),
        pb.Submit(
            request_id="bad_min_p",
            text=PROMPT,
            sampling=pb.SamplingParams(min_p=1.5),
            stopping=pb.StoppingCriteria(**stopping),
        ),
        pb.Submit(
            request_id="bad_stop_id",
            text=PROMPT,
            stopping=pb.StoppingCriteria(stop_token_ids=[4096], **stopping),
        ),
        pb.Submit(
            request_id="also_good",
            text=PROMPT,
            sampling=pb.SamplingParams(min_p=0.5, temperature=1.0, seed=3),
            stopping=pb.StoppingCriteria(min_tokens=2, stop_token_ids=[1], **stopping),
        ),
    ]
    requests = iter([pb.GenerateRequest(submit=submit) for submit in submits])
    finished = {
        r.request_id: r.finished
        for r in stub.Generate(requests, timeout=60)
        if r.WhichOneof("event") == "finished"
    }
    assert set(finished) == {s.request_id for s in submits}
    for bad, words in (("bad_min_p", "min_p must be in [0, 1]"), ("bad_stop_id", "4096")):
        assert finished[bad].status_code == "INVALID_ARGUMENT", finished[bad]
        assert words in finished[bad].message
    for good in ("good", "also_good"):
        assert finished[good].status_code == "OK", finished[good]
        assert finished[good].usage.output_tokens >= 2


# ---------------------------------------------------------------- HTTP


def complete(front: FrontThread, **extra: object):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    status, reply = front.post_bytes("/v1/completions", json.dumps(body).encode())
    return status, json.loads(reply)


def test_http_takes_vllms_fields(front, engine, stop_id) -> None:
    token, expected = stop_id
    status, reply = complete(front, stop_token_ids=[token])
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == engine.tokenizer.decode(expected[:-1])
    sampling = SamplingParams(stop_token_ids=(token,), min_tokens=len(expected))
    status, reply = complete(front, stop_token_ids=[token], min_tokens=len(expected))
    assert status == 200, reply
    assert reply["choices"][0]["text"] == local(engine, sampling).text
    status, reply = complete(front, temperature=1.5, seed=7, min_p=1)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == local(engine, SamplingParams()).text


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"min_p": 1.01}, "min_p", "min_p must be in [0, 1] (0 is off), got 1.01"),
        ({"min_p": "0.1"}, "min_p", "min_p must be a number"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be in [0,"),
        ({"min_tokens": 1.5}, "min_tokens", "min_tokens must be an integer"),
        ({"min_tokens": NUM_TOKENS + 1}, "min_tokens", "must be at most max_tokens (12)"),
        ({"stop_token_ids": 5}, "stop_token_ids", "must be a list of at most 64 token ids"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "(has 65)"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids", "stop_token_ids[1] must be a token id"),
        ({"stop_token_ids": [True]}, "stop_token_ids", "stop_token_ids[0] must be a token id"),
        ({"stop_token_ids": [4096]}, "stop_token_ids", "token id 4096 is not in the vocabulary"),
    ],
)
def test_http_refuses_a_bad_value_naming_it(front, extra, param, words) -> None:
    status, reply = complete(front, **extra)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_chat_without_max_tokens_is_held_to_its_context_at_conversion(
    front, engine, monkeypatch
) -> None:
    """Its bound is the room the prompt leaves, named in the HTTP's own
    words (not the wire's max_new_tokens); a chat's max_completion_tokens
    is named as the body named it."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    longest = engine.info.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": messages, "min_tokens": longest}
    status, reply = front.post_bytes("/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, reply
    error = json.loads(reply)["error"]
    assert error["param"] == "min_tokens", error
    words = rf"min_tokens \({longest}\) must be at most the (\d+) tokens the context \({longest}\)"
    room = re.match(words, error["message"])
    assert room is not None and "max_new_tokens" not in error["message"], error
    assert 0 < int(room.group(1)) < longest and "no max_tokens was given" in error["message"]
    body = {"model": "tiny", "messages": messages, "min_tokens": 6, "max_completion_tokens": 5}
    status, reply = front.post_bytes("/v1/chat/completions", json.dumps(body).encode())
    error = json.loads(reply)["error"]
    assert status == 400 and error["param"] == "min_tokens", error
    assert error["message"] == "min_tokens (6) must be at most max_completion_tokens (5)", error


@pytest.mark.parametrize("is_chat", [False, True], ids=["completions", "chat"])
def test_the_vllm_fields_become_the_grpc_fields(is_chat: bool) -> None:
    body: dict[str, object] = {
        "model": "tiny", "max_tokens": 9, "min_p": 0.05, "min_tokens": 4,
        "stop_token_ids": [2, 50256],
    }  # fmt: skip
    body.update({"messages": [{"role": "user", "content": "hi"}]} if is_chat else {"prompt": "hi"})
    submit = parse(body, {}, is_chat).submit
    assert submit.sampling.min_p == pytest.approx(0.05)
    assert submit.stopping.min_tokens == 4 and list(submit.stopping.stop_token_ids) == [2, 50256]
    nulls = {"model": "tiny", "prompt": "hi", "min_p": None, "min_tokens": None,
             "stop_token_ids": None}  # fmt: skip
    submit = parse(nulls, {}, False).submit
    assert not submit.sampling.HasField("min_p") and not submit.stopping.min_tokens
    assert not submit.stopping.stop_token_ids


# ---------------------------------------------------------------- the client


def test_the_client_round_trips_the_new_keywords(server, engine, stop_id) -> None:
    token, expected = stop_id
    options = {"max_tokens": NUM_TOKENS, "ignore_eos": True}
    with Client(server.target) as client:
        stopped = client.generate(PROMPT, **options, stop_token_ids=[token]).result(timeout=60)
        assert stopped.token_ids == expected and stopped.finish_reason == "stop_sequence"
        held = client.generate(
            PROMPT, **options, stop_token_ids=[token], min_tokens=len(expected)
        ).result(timeout=60)
        sampling = SamplingParams(stop_token_ids=(token,), min_tokens=len(expected))
        assert held.token_ids == local(engine, sampling).token_ids
        narrowed = client.generate_one(
            PROMPT, **options, temperature=1.5, seed=7, min_p=1.0
        ).result(timeout=60)
        assert narrowed.token_ids == local(engine, SamplingParams()).token_ids


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"min_p": 1.5}, ValueError, "min_p must be in [0, 1] (0 is off), got 1.5"),
        ({"min_p": float("nan")}, ValueError, "min_p must be in [0, 1]"),
        ({"min_p": "0.1"}, TypeError, "min_p must be a number"),
        ({"min_tokens": -1}, ValueError, "min_tokens must be in [0, 4294967295]"),
        ({"min_tokens": 9, "max_tokens": 8}, ValueError, "min_tokens (9) must be at most"),
        ({"stop_token_ids": range(65)}, ValueError, "65 ids, more than the 64 allowed"),
        ({"stop_token_ids": [3, -1]}, ValueError, "stop_token_ids[1] must be a token id"),
        ({"stop_token_ids": 3}, TypeError, "stop_token_ids must be a sequence"),
    ],
)
def test_the_client_refuses_a_bad_value_before_sending(options, error, words) -> None:
    with pytest.raises(error) as refused:
        build_submit("a", "hi", GenerateOptions(**options))
    assert words in str(refused.value)

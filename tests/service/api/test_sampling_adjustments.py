"""Penalties and logit bias on both front doors, end to end on the ``tiny``
model: gRPC's ``SamplingParams`` fields and the OpenAI body's
``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` and
``logit_bias`` reach the sampler (a banned greedy token is not taken, a
frequency penalty stops a repeat), and a bad value is refused
(INVALID_ARGUMENT, or a 400 naming the field) before anything runs."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from http_front_thread import FrontThread
from server_thread import ServerThread

from slipstream.scheduler.errors import InvalidRequest
from slipstream.scheduler.request import SamplingParams
from slipstream.service.api.http.params import parse
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import RequestSpec
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

# fp32: greedy output cannot depend on how requests happen to be batched.
CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)
# Its greedy answer repeats a token within 24 (at its 8th); with a frequency
# penalty of 2 it repeats none in 120.
PROMPT = "Hello there"
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def stub(engine: object) -> Iterator[pb_grpc.InferenceStub]:
    server = ServerThread(engine)
    try:
        with grpc.insecure_channel(server.target) as channel:
            yield pb_grpc.InferenceStub(channel)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def front(engine: object) -> Iterator[FrontThread]:
    srv = FrontThread(engine)
    yield srv
    srv.stop()


def local(engine: object, sampling: SamplingParams, max_tokens: int = NUM_TOKENS) -> list[int]:
    """The engine's own greedy tokens for ``PROMPT`` with ``sampling``."""
    ids = engine.tokenizer.encode(PROMPT)  # type: ignore[attr-defined]
    request = RequestSpec("local", ids, max_tokens, sampling=sampling, ignore_eos=True)
    return engine.generate([request])[0].token_ids  # type: ignore[attr-defined]


def text_of(engine: object, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids)  # type: ignore[attr-defined]


def has_repeat(ids: list[int]) -> bool:
    return len(set(ids)) < len(ids)


# ---------------------------------------------------------------- gRPC


def generate(stub: pb_grpc.InferenceStub, max_tokens: int = NUM_TOKENS, **sampling: object):
    message = pb.Submit(
        request_id="a",
        text=PROMPT,
        sampling=pb.SamplingParams(**sampling),  # type: ignore[arg-type]
        stopping=pb.StoppingCriteria(max_new_tokens=max_tokens, ignore_eos=True),
    )
    return [t for r in stub.GenerateOne(message, timeout=60) for t in r.chunk.token_ids]


def test_grpc_logit_bias_bans_the_greedy_first_token(stub, engine) -> None:
    [first] = generate(stub, 1)
    assert [first] == local(engine, SamplingParams(), 1)
    [banned] = generate(stub, 1, logit_bias={first: -100.0})
    assert banned != first
    assert [banned] == local(engine, SamplingParams(logit_bias=((first, -100.0),)), 1)


def test_grpc_frequency_penalty_stops_a_repeated_token(stub, engine) -> None:
    assert has_repeat(generate(stub))
    penalised = generate(stub, frequency_penalty=2.0)
    assert not has_repeat(penalised)
    assert penalised == local(engine, SamplingParams(frequency_penalty=2.0))


def test_grpc_carries_every_adjustment_to_the_sampler(stub, engine) -> None:
    fields = dict(presence_penalty=1.5, repetition_penalty=1.8, logit_bias={7: 3.0, 11: -2.5})
    sampling = SamplingParams(
        presence_penalty=1.5, repetition_penalty=1.8, logit_bias=((7, 3.0), (11, -2.5))
    )
    got = generate(stub, **fields)
    assert got == local(engine, sampling) != local(engine, SamplingParams())


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in [0.01, 100] (1 is off)"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be in [0.01, 100] (1 is off)"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be in [0.01, 100]"),
        ({"repetition_penalty": 1e38}, "must be in [0.01, 100] (1 is off), got 1e+38"),
        ({"logit_bias": {4096: 1.0}}, "token id 4096 is not in the vocabulary [0, 4096)"),
        ({"logit_bias": {5: 100.5}}, "the bias of token 5 must be in [-100, 100]"),
        ({"logit_bias": {5: float("-inf")}}, "the bias of token 5 must be in [-100, 100]"),
        ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, "more than the 1024 allowed"),
    ],
)
def test_grpc_refuses_a_bad_adjustment_invalid_argument(stub, sampling, words) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **sampling)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details()


def test_an_in_process_caller_cannot_bias_a_token_outside_the_vocabulary(engine) -> None:
    """The engine's own check, for callers that skip the wire's: one such id
    would fail the whole step, every request in it."""
    sampling = SamplingParams(logit_bias=((4096, -100.0),))
    request = RequestSpec("outside", [5, 6], 2, sampling=sampling)
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(request, lambda event: None)
    assert refused.value.field == "logit_bias"


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(logit_bias=((5, 1e9),)), "logit_bias"),
        (SamplingParams(logprobs=-1), None),  # its top-k would fail the whole step
    ],
)
def test_an_in_process_caller_is_held_to_the_fronts_bounds(engine, sampling, field) -> None:
    """Engine.submit refuses what the wire would have: the bounds are the
    scheduler's admission's, which every entry point passes."""
    request = RequestSpec(f"out-of-bounds-{field}", [5, 6], 2, sampling=sampling)
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(request, lambda event: None)
    assert refused.value.field == field
    assert engine.stats().waiting == 0


# ---------------------------------------------------------------- HTTP


def complete(front: FrontThread, max_tokens: int = NUM_TOKENS, **extra: object):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    status, reply = front.post_bytes("/v1/completions", json.dumps(body).encode())
    return status, json.loads(reply)


def test_http_logit_bias_bans_the_greedy_first_token(front, engine) -> None:
    [first] = local(engine, SamplingParams(), 1)
    status, plain = complete(front, 1)
    assert status == 200 and plain["choices"][0]["text"] == text_of(engine, [first])
    status, reply = complete(front, 1, logit_bias={str(first): -100})
    assert status == 200, reply
    banned = local(engine, SamplingParams(logit_bias=((first, -100.0),)), 1)
    assert banned != [first] and reply["choices"][0]["text"] == text_of(engine, banned)


def test_http_frequency_penalty_stops_a_repeated_token(front, engine) -> None:
    penalised = local(engine, SamplingParams(frequency_penalty=2.0))
    assert has_repeat(local(engine, SamplingParams())) and not has_repeat(penalised)
    status, reply = complete(front, frequency_penalty=2)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == text_of(engine, penalised)


def test_http_takes_vllms_repetition_penalty_and_openais_presence_penalty(front, engine) -> None:
    sampling = SamplingParams(presence_penalty=-0.5, repetition_penalty=1.25)
    status, reply = complete(front, presence_penalty=-0.5, repetition_penalty=1.25)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == text_of(engine, local(engine, sampling))


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -2.01}, "frequency_penalty", "must be in [-2, 2], got -2.01"),
        ({"frequency_penalty": "1"}, "frequency_penalty", "frequency_penalty must be a number"),
        ({"repetition_penalty": 0}, "repetition_penalty", "must be in [0.01, 100]"),
        ({"repetition_penalty": 1e38}, "repetition_penalty", "(1 is off), got 1e+38"),
        ({"logit_bias": [1, 2]}, "logit_bias", "logit_bias must be an object"),
        ({"logit_bias": {"the": 1}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias['5'] must be a number in"),
        ({"logit_bias": {"5": True}}, "logit_bias", "[-100, 100], got bool"),
        ({"logit_bias": {"5": -100.0001}}, "logit_bias", "[-100, 100], got -100.0001"),
        ({"logit_bias": {"05": 5, "5": -5}}, "logit_bias", "names token 5 twice (as '5')"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024 allowed"),
    ],
)
def test_http_refuses_a_bad_adjustment_naming_it(front, extra, param, words) -> None:
    status, reply = complete(front, 2, **extra)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param and words in error["message"], error


def test_http_refuses_a_biased_token_outside_the_vocabulary(front) -> None:
    """Its id fits the wire but not the model: refused where the prompt's
    ids are checked against the vocabulary."""
    status, reply = complete(front, 2, logit_bias={"4096": -100})
    assert status == 400, reply
    assert "token id 4096 is not in the vocabulary [0, 4096)" in reply["error"]["message"]
    assert reply["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("is_chat", [False, True], ids=["completions", "chat"])
def test_the_openai_fields_become_the_grpc_fields(is_chat: bool) -> None:
    body: dict[str, object] = {
        "model": "tiny",
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.1,
        "logit_bias": {"50256": -100, "7": 2.5},
    }
    body.update({"messages": [{"role": "user", "content": "hi"}]} if is_chat else {"prompt": "hi"})
    sampling = parse(body, {}, is_chat).submit.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.repetition_penalty == pytest.approx(1.1)
    assert dict(sampling.logit_bias) == {50256: -100.0, 7: 2.5}


def test_absent_or_null_adjustments_leave_the_grpc_fields_unset() -> None:
    nulls = dict.fromkeys(
        ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    )
    for body in ({"model": "tiny", "prompt": "hi"}, {"model": "tiny", "prompt": "hi", **nulls}):
        sampling = parse(body, {}, False).submit.sampling
        assert not sampling.HasField("repetition_penalty") and not sampling.logit_bias
        assert sampling.presence_penalty == sampling.frequency_penalty == 0.0

"""Several choices per HTTP request (``n``, and a completions ``prompt`` that
is a list of prompts), fanned out at the front into one engine request per
choice: numbered as OpenAI's and vLLM's, whole and streamed, read by the
official ``openai`` SDK from a live front on the ``tiny`` model; a choice
that fails takes the others down at once, and nothing is left running."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import openai
import pytest
from http_front_thread import FrontThread
from polling import wait_until

from slipstream.scheduler.request import FinishReason
from slipstream.service.api.auth import Tenants, parse_tenants, token_sha256
from slipstream.service.api.limits import Limits
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import RequestSpec

# fp32: greedy and seeded output cannot depend on how requests are batched.
CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LONG = 960  # tokens: outlives anything a test does to it
TOKEN = "two-at-a-time-token"
TENANTS_TOML = f"""
[tenants.pair]
token_sha256 = ["{token_sha256(TOKEN)}"]
max_inflight = 2
"""
SAMPLED = {"model": "tiny", "max_tokens": 12, "temperature": 1, "extra_body": {"ignore_eos": True}}


class Front(FrontThread):
    def client(self, **kwargs: object) -> openai.OpenAI:
        options = {"api_key": "unused", "max_retries": 0, **kwargs}
        return openai.OpenAI(base_url=f"{self.base_url}/v1", **options)  # type: ignore[arg-type]

    def post(
        self, path: str, body: dict[str, object], headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        return self.post_bytes(path, json.dumps(body).encode(), headers)


@pytest.fixture(scope="module")
def front(engine: object) -> Iterator[Front]:
    srv = Front(engine)
    yield srv
    srv.stop()


@pytest.fixture
def oai(front: Front) -> Iterator[openai.OpenAI]:
    with front.client() as client:
        yield client


@pytest.fixture
def with_template(engine: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHATML)  # type: ignore[attr-defined]


@pytest.fixture
def submitted(engine: object, monkeypatch: pytest.MonkeyPatch) -> list[RequestSpec]:
    """Every RequestSpec the engine is handed, in order."""
    seen: list[RequestSpec] = []
    original = engine.submit  # type: ignore[attr-defined]

    def spy(request: RequestSpec, on_event: object) -> None:
        seen.append(request)
        original(request, on_event)

    monkeypatch.setattr(engine, "submit", spy)
    return seen


def engine_idle(engine: object) -> bool:
    stats = engine.stats()  # type: ignore[attr-defined]
    return (stats.waiting, stats.running, stats.swapped, stats.device_blocks.used) == (0, 0, 0, 0)


def streamed_texts(chunks: list[object], n: int) -> tuple[list[str], list[str | None]]:
    """Each choice's text and finish reason, joined from completions chunks."""
    texts, finishes = [""] * n, [None] * n
    for chunk in chunks:
        for choice in chunk.choices:  # type: ignore[attr-defined]
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    return texts, finishes  # type: ignore[return-value]


# ---------------------------------------------------------------- completions


def test_n_choices_whole_and_streamed_are_the_same_seeded_samples(
    oai: openai.OpenAI, engine: object, submitted: list[RequestSpec]
) -> None:
    whole = oai.completions.create(prompt="Once upon", n=3, seed=11, **SAMPLED)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) == 3, texts  # temperature 1: each choice samples on its own seed
    assert all(c.finish_reason == "length" for c in whole.choices)
    # Choice i is its own engine request, seeded seed + i, all sharing one prompt.
    assert [r.sampling.seed for r in submitted] == [11, 12, 13]
    assert [r.req_id for r in submitted] == [f"http-{whole.id}-{i}" for i in range(3)]
    assert len({tuple(r.prompt_token_ids) for r in submitted}) == 1
    num_prompt = len(engine.tokenizer.encode("Once upon"))  # type: ignore[attr-defined]
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt, 36)
    # The same request again gives the same choices; streamed, too.
    again = oai.completions.create(prompt="Once upon", n=3, seed=11, **SAMPLED)
    assert [c.text for c in again.choices] == texts
    stream = oai.completions.create(
        prompt="Once upon",
        n=3,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
        **SAMPLED,
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(len(c.choices) == 1 for c in chunks[:-1])
    assert streamed_texts(chunks[:-1], 3) == (texts, ["length"] * 3)
    # Each choice has one finish chunk of its own.
    assert sum(1 for c in chunks[:-1] if c.choices[0].finish_reason) == 3
    assert wait_until(lambda: engine_idle(engine))


def test_unseeded_choices_differ_and_greedy_ones_are_identical(oai: openai.OpenAI) -> None:
    sampled = oai.completions.create(prompt="Once upon", n=3, **SAMPLED)
    assert len({c.text for c in sampled.choices}) > 1
    args = {**SAMPLED, "temperature": 0}
    greedy = oai.completions.create(prompt="Once upon", n=3, **args)
    alone = oai.completions.create(prompt="Once upon", **args)
    assert [c.text for c in greedy.choices] == [alone.choices[0].text] * 3


def test_a_list_of_prompts_is_numbered_prompt_major_and_matches_each_sent_alone(
    oai: openai.OpenAI, engine: object, submitted: list[RequestSpec]
) -> None:
    prompts = ["Once upon", "The quick brown fox"]
    batch = oai.completions.create(prompt=prompts, n=2, seed=40, **SAMPLED)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    # Choice index = prompt_index * n + sample_index, its seed seed +
    # sample_index: each prompt samples as it does sent alone with that seed.
    first = oai.completions.create(prompt=prompts[0], n=2, seed=40, **SAMPLED)
    second = oai.completions.create(prompt=prompts[1], n=2, seed=40, **SAMPLED)
    assert [c.text for c in batch.choices] == [c.text for c in first.choices + second.choices]
    twice = oai.completions.create(prompt=[prompts[1]] * 2, seed=40, **SAMPLED)
    assert twice.choices[0].text == twice.choices[1].text  # the same prompt and seed
    ids = [tuple(r.prompt_token_ids) for r in submitted[:4]]
    assert ids[0] == ids[1] != ids[2] == ids[3]
    num_prompts = [len(engine.tokenizer.encode(p)) for p in prompts]  # type: ignore[attr-defined]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(num_prompts)  # each prompt once, not n times
    assert batch.usage.completion_tokens == 4 * 12
    # Token-id prompts, streamed.
    token_prompts = [[5, 6, 7], [8, 9, 10, 11]]
    stream = oai.completions.create(prompt=token_prompts, seed=3, stream=True, **SAMPLED)
    texts, finishes = streamed_texts(list(stream), 2)
    whole = oai.completions.create(prompt=token_prompts, seed=3, **SAMPLED)
    assert texts == [c.text for c in whole.choices] and finishes == ["length"] * 2


def test_the_sdk_reads_each_choices_index_whole_and_streamed(oai: openai.OpenAI) -> None:
    args = {**SAMPLED, "max_tokens": 4}
    whole = oai.completions.create(prompt="hi", n=2, **args)
    assert [c.index for c in whole.choices] == [0, 1]
    seen = {c.index for chunk in oai.completions.create(prompt="hi", n=2, stream=True, **args)
            for c in chunk.choices}  # fmt: skip
    assert seen == {0, 1}


# ---------------------------------------------------------------- chat


def test_chat_n_choices_whole_and_streamed(oai: openai.OpenAI, with_template: None) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    args = {**SAMPLED, "messages": messages, "n": 3, "seed": 5}
    whole = oai.chat.completions.create(**args)  # type: ignore[call-overload]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in whole.choices)
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) == 3, texts
    chunks = list(oai.chat.completions.create(**args, stream=True))  # type: ignore[call-overload]
    # An opening role chunk per choice, in index order, before any text.
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3
    assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
    streamed, finishes = [""] * 3, [None] * 3
    for chunk in chunks[3:]:
        [choice] = chunk.choices
        assert choice.delta.role is None
        streamed[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            assert finishes[choice.index] is None  # one finish chunk per choice
            finishes[choice.index] = choice.finish_reason
    assert streamed == texts and finishes == ["length"] * 3


# ---------------------------------------------------------------- limits


def test_over_max_choices_is_400_naming_n_or_prompt(engine: object) -> None:
    srv = Front(engine, limits=Limits(max_choices=4, max_prompt_bytes=16))
    try:
        cases = [
            ({"prompt": "hi", "n": 5}, "n", "n must be in [1, 4], got 5"),
            ({"prompt": ["a", "b", "c"], "n": 2}, "n", "3 prompts with n=2 ask for 6 choices"),
            ({"prompt": ["a"] * 5}, "prompt", "5 prompts with n=1 ask for 5 choices"),
            # Size limits hold per prompt.
            ({"prompt": ["short", "x" * 17]}, "prompt", "prompt is 17 bytes"),
        ]
        for fields, param, message in cases:
            body = {"model": "tiny", "max_tokens": 2, **fields}
            status, reply = srv.post("/v1/completions", body)
            error = json.loads(reply)["error"]
            assert (status, error["param"]) == (400, param), reply
            assert error["message"].startswith(message), error
        status, reply = srv.post("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 4})
        assert status == 200 and len(json.loads(reply)["choices"]) == 4
    finally:
        srv.stop()
    assert engine_idle(engine)


def test_serve_sets_max_choices() -> None:
    from slipstream.service.cli import build_parser
    from slipstream.service.cli.serve import limits

    parser = build_parser()
    assert limits(parser.parse_args(["serve"])).max_choices == 16  # type: ignore[attr-defined]
    args = parser.parse_args(["serve", "--max-choices", "64"])
    assert limits(args).max_choices == 64  # type: ignore[attr-defined]


# ---------------------------------------------------------------- failure


def test_a_choice_that_fails_aborts_the_others(
    front: Front, engine: object, submitted: list[RequestSpec]
) -> None:
    """One choice ends without an answer: the request gets its failure (a
    status before headers, an error event after) and the others stop at once."""
    body = {"model": "tiny", "prompt": "x", "n": 3, "max_tokens": LONG, "ignore_eos": True}

    def fail_the_second_once_running() -> None:
        assert wait_until(lambda: len(submitted) == 3 and engine.stats().running == 3)  # type: ignore[attr-defined]
        engine.abort(submitted[1].req_id, FinishReason.DEADLINE_EXCEEDED, "too late")  # type: ignore[attr-defined]

    failer = threading.Thread(target=fail_the_second_once_running)
    failer.start()
    status, reply = front.post("/v1/completions", body)
    failer.join()
    assert status == 504 and json.loads(reply)["error"]["message"] == "too late", reply
    assert wait_until(lambda: engine_idle(engine)), engine.stats()  # type: ignore[attr-defined]

    submitted.clear()
    with front.client() as oai:
        stream = oai.completions.create(
            model="tiny",
            prompt="x",
            n=3,
            max_tokens=LONG,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        assert wait_until(lambda: len(submitted) == 3)
        engine.abort(submitted[2].req_id, FinishReason.ERROR, "the engine failed")  # type: ignore[attr-defined]
        with pytest.raises(openai.APIError) as failed:
            list(stream)
        assert failed.value.message == "the engine failed"
    assert wait_until(lambda: engine_idle(engine)), engine.stats()  # type: ignore[attr-defined]


def test_an_infeasible_deadline_refuses_every_choice(front: Front, engine: object) -> None:
    body = {"model": "tiny", "prompt": ["ab", "cd"], "n": 2, "max_tokens": 900}
    for stream in (False, True):
        fields = {**body, "ignore_eos": True, "deadline_ms": 10, "stream": stream}
        status, reply = front.post("/v1/completions", fields)
        assert status == 504 and json.loads(reply)["error"]["code"] == "deadline_infeasible"
        assert wait_until(lambda: engine_idle(engine)), engine.stats()  # type: ignore[attr-defined]


def test_a_tenant_over_its_quota_for_one_choice_is_refused_whole(engine: object) -> None:
    tenants = Tenants(parse_tenants(TENANTS_TOML))
    srv = Front(engine, tenants=tenants)
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        # More choices than the tenant may ever have in flight: no retry could
        # pass, so not a 429 (which the SDK retries) but a 400 naming n.
        status, reply = srv.post("/v1/completions", {**body, "n": 3}, auth)
        assert status == 400 and json.loads(reply)["error"]["param"] == "n", reply
        # One slot held elsewhere: n=2 is over the quota now, not for ever.
        held = tenants.gate(f"Bearer {TOKEN}").admit(RequestSpec("held", [1], 1))[1]
        status, reply = srv.post("/v1/completions", {**body, "n": 2}, auth)
        assert status == 429 and json.loads(reply)["error"]["code"] == "quota_exceeded", reply
        assert tenants.num_inflight("pair") == 1  # the admitted choice gave its slot back
        held.release()
        status, reply = srv.post("/v1/completions", {**body, "n": 2}, auth)
        assert status == 200 and len(json.loads(reply)["choices"]) == 2
        assert wait_until(lambda: tenants.num_inflight("pair") == 0)
    finally:
        srv.stop()
    assert wait_until(lambda: engine_idle(engine))


def test_a_client_gone_mid_stream_aborts_every_choice(front: Front, engine: object) -> None:
    with front.client() as oai:
        stream = oai.completions.create(
            model="tiny",
            prompt="x",
            n=4,
            max_tokens=LONG,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _, _chunk in zip(range(8), stream, strict=False):
            pass
        assert engine.stats().running == 4  # type: ignore[attr-defined]
        stream.close()
    assert wait_until(lambda: engine_idle(engine)), engine.stats()  # type: ignore[attr-defined]

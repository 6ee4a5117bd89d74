"""Log-probabilities on the OpenAI-compatible HTTP front: completions'
``logprobs: k`` and chat's ``logprobs`` / ``top_logprobs``, whole and
streamed, read by the official ``openai`` SDK from a live front on the
``tiny`` model (a byte-level BPE, as SmolLM2's)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from itertools import accumulate

import openai
import pytest

from slipstream.service.api.http.logprobs import LOGPROB_FLOOR, LogprobsBuilder, TokenTexts
from slipstream.service.api.http.responses import ChunkEncoder, Envelope
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import TokenEvent, TokenLogprobs

# fp32: greedy output and its log-probabilities cannot depend on batching.
CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = "Hello there"
MESSAGES = [{"role": "user", "content": "Say hi"}]
GREEDY = {"model": "tiny", "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


class Front:
    """The HTTP front alone around one engine, on its own event loop thread."""

    def __init__(self, engine: object) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._call(self._start(engine))
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    async def _start(self, engine: object) -> int:
        from slipstream.service.api.http.app import HttpFront
        from slipstream.service.api.lifecycle import Lifecycle

        lifecycle = Lifecycle(engine)  # type: ignore[arg-type]
        self.http = HttpFront(lifecycle)
        port = await self.http.start("127.0.0.1", 0)
        await lifecycle.serve()
        return port

    def stop(self) -> None:
        self._call(self.http.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    def post(self, path: str, body: dict[str, object]) -> tuple[int, bytes]:
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


@pytest.fixture(scope="module")
def front(engine: object) -> Iterator[Front]:
    srv = Front(engine)
    yield srv
    srv.stop()


@pytest.fixture
def oai(front: Front) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{front.base_url}/v1", api_key="-", max_retries=0) as client:
        yield client


@pytest.fixture
def with_template(engine: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHATML)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- completions


def test_completion_logprobs_whole_and_streamed(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(prompt=PROMPT, logprobs=3, **GREEDY)  # type: ignore[arg-type]
    choice = whole.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and whole.usage is not None
    tokens, values = logprobs.tokens or [], logprobs.token_logprobs or []
    tops = logprobs.top_logprobs or []
    assert len(tokens) == len(values) == len(tops) == whole.usage.completion_tokens == 12
    assert choice.text.isascii()  # so each token's text is whole
    assert "".join(tokens) == choice.text
    assert logprobs.text_offset == [0, *accumulate(len(t) for t in tokens)][:-1]
    for token, value, top in zip(tokens, values, tops, strict=True):
        # Greedy: the likeliest token is the one chosen, with its log-probability.
        assert next(iter(top.items())) == (token, value)
        assert len(top) == 3 and value <= 0
        assert list(top.values()) == sorted(top.values(), reverse=True)

    chunks = list(oai.completions.create(prompt=PROMPT, logprobs=3, stream=True, **GREEDY))  # type: ignore[arg-type]
    with_tokens = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert len(with_tokens) == 12 and chunks[-1].choices[0].logprobs is None  # the finish chunk
    assert [t for lp in with_tokens for t in lp.tokens or []] == tokens
    assert [o for lp in with_tokens for o in lp.text_offset or []] == logprobs.text_offset
    streamed = [v for lp in with_tokens for v in lp.token_logprobs or []]
    assert streamed == pytest.approx(values)
    streamed_tops = [top for lp in with_tokens for top in lp.top_logprobs or []]
    assert [list(top) for top in streamed_tops] == [list(top) for top in tops]


def test_completion_logprobs_zero_is_the_chosen_token_alone(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(prompt=PROMPT, logprobs=0, **GREEDY)  # type: ignore[arg-type]
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    pairs = zip(logprobs.tokens, logprobs.token_logprobs, strict=True)
    assert logprobs.top_logprobs == [{token: value} for token, value in pairs]


# ---------------------------------------------------------------- chat


def test_chat_logprobs_whole_and_streamed(oai: openai.OpenAI, with_template: None) -> None:
    whole = oai.chat.completions.create(
        messages=MESSAGES,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        **GREEDY,  # type: ignore[arg-type]
    )
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert whole.usage is not None and len(content) == whole.usage.completion_tokens == 12
    text = choice.message.content or ""
    # The bytes join into the text. This answer has a lone lead byte (0xEB):
    # U+FFFD in the text as in its token, its bytes [235].
    joined = b"".join(bytes(entry.bytes or []) for entry in content)
    assert joined.decode("utf-8", errors="replace") == text
    assert "".join(entry.token for entry in content) == text
    for entry in content:
        assert entry.token == bytes(entry.bytes or []).decode("utf-8", errors="replace")
        assert len(entry.top_logprobs) == 2
        best = entry.top_logprobs[0]
        assert (best.token, best.logprob, best.bytes) == (entry.token, entry.logprob, entry.bytes)
        assert entry.top_logprobs[1].logprob <= best.logprob

    chunks = list(
        oai.chat.completions.create(
            messages=MESSAGES,  # type: ignore[arg-type]
            logprobs=True,
            top_logprobs=2,
            stream=True,
            **GREEDY,  # type: ignore[arg-type]
        )
    )
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or []
    ]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_chat_logprobs_without_top_logprobs_has_none_listed(
    oai: openai.OpenAI, with_template: None
) -> None:
    whole = oai.chat.completions.create(messages=MESSAGES, logprobs=True, **GREEDY)  # type: ignore[arg-type]
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(entry.top_logprobs == [] for entry in content)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("path", "extra", "param", "message"),
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
        ("/v1/completions", {"logprobs": -1}, "logprobs", "logprobs must be in [0, 20], got -1"),
        ("/v1/completions", {"logprobs": True}, "logprobs", "logprobs must be an integer"),
        ("/v1/completions", {"logprobs": "2"}, "logprobs", "logprobs must be an integer"),
        # chat's field
        ("/v1/completions", {"top_logprobs": 2}, "top_logprobs",
         "unsupported parameter: top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
         "top_logprobs must be in [0, 20], got 21"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs",
         "top_logprobs must be in [0, 20], got -1"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs",
         "top_logprobs needs logprobs: true"),
        ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs",
         "top_logprobs needs logprobs: true"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "logprobs must be a boolean"),
    ],
)  # fmt: skip
def test_logprobs_out_of_range_are_400_naming_the_field(
    front: Front, path: str, extra: dict[str, object], param: str, message: str
) -> None:
    prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    status, reply = front.post(path, {"model": "tiny", "max_tokens": 2, **prompt, **extra})
    assert status == 400, reply
    error = json.loads(reply)["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    assert error["message"] == message


def test_the_sdk_sees_logprobs_past_20_as_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model="tiny", prompt=PROMPT, logprobs=21)
    error = caught.value.response.json()["error"]
    assert (
        error["param"] == "logprobs" and error["message"] == "logprobs must be in [0, 20], got 21"
    )


# ---------------------------------------------------------------- rendering


def test_a_request_without_logprobs_renders_as_before(front: Front) -> None:
    """The pre-rendered chunk stays byte for byte; one that asked differs by
    its logprobs alone."""
    completion = ChunkEncoder(Envelope("cmpl-1", 7, "tiny", False), include_usage=True)
    head = 'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"tiny",'
    plain = head + '"choices":[{"index":0,"text":"hé","logprobs":null,"finish_reason":null}],'
    assert completion.token("hé") == f'{plain}"usage":null}}\n\n'.encode()
    asked = completion.token("hé", {"tokens": ["hé"]})
    assert asked == completion.token("hé").replace(b"null", b'{"tokens":["h\xc3\xa9"]}', 1)
    chat = ChunkEncoder(Envelope("chatcmpl-1", 7, "tiny", True), include_usage=False)
    head = 'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"tiny",'
    plain = head + '"choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,'
    assert chat.token("hi") == f'{plain}"finish_reason":null}}]}}\n\n'.encode()
    asked = chat.token("hi", {"content": []})
    assert asked == chat.token("hi").replace(b"null", b'{"content":[]}', 1)
    # The opening chunk has OpenAI's keys too, as nulls.
    opening = head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    assert chat.first() == f'{opening}"logprobs":null,"finish_reason":null}}]}}\n\n'.encode()

    for stream in (False, True):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "stream": stream}
        status, reply = front.post("/v1/completions", body)
        assert status == 200, reply
        if stream:
            assert reply.count(b'"logprobs":null') == 3  # two tokens, the finish
        else:
            assert json.loads(reply)["choices"][0]["logprobs"] is None


def test_token_texts_are_raw_bytes_of_byte_level_tokens(engine: object) -> None:
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("é ☃ the", add_special_tokens=False)
    pieces = [texts.of(token_id) for token_id in ids]
    assert b"".join(bytes(raw) for _, raw in pieces).decode() == "é ☃ the"
    # A character split over tokens: each part is its bytes, its text U+FFFD.
    assert any(text == "\ufffd" and len(raw) == 1 for text, raw in pieces), pieces
    assert pieces[-1] == (" the", list(b" the"))
    assert texts.of(tokenizer.eos_token_id) == (tokenizer.eos_token, list(b"</s>"))


def test_token_texts_of_a_sentencepiece_tokenizer() -> None:
    """Not byte-level: ``<0xNN>`` is that byte, ``▁`` a space (Llama 2's
    decoder would strip it from a text's first token)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<0xE2>": 1, "\u2581the": 2, "cat": 3}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    texts = TokenTexts(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"))
    assert [texts.of(token_id) for token_id in (1, 2, 3)] == [
        ("\ufffd", [0xE2]),
        (" the", list(b" the")),
        ("cat", list(b"cat")),
    ]


def test_completion_tokens_of_a_split_character_are_distinct_and_offsets_index_the_text(
    engine: object,
) -> None:
    """Byte tokens are spelled ``bytes:\\xNN`` (OpenAI's legacy spelling),
    not all U+FFFD, so alternatives stay distinct keys; ``text_offset`` is
    the offset in the text of the character a token's first byte is in."""
    texts = TokenTexts(engine.tokenizer)  # type: ignore[attr-defined]
    text = "a\U0001f389\u00e9"  # 'a', then 4 bytes and 2 bytes, one token each here
    ids = engine.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    assert len(ids) == 7
    party, confetti = (engine.tokenizer.encode(t, add_special_tokens=False) for t in "🎉🎊")  # type: ignore[attr-defined]
    # The last byte of 🎉 chosen over that of 🎊: two byte tokens, two keys.
    logprobs = [TokenLogprobs(-0.1, [i], [-0.1]) for i in ids]
    logprobs[4] = TokenLogprobs(-0.5, [party[-1], confetti[-1]], [-0.5, -1.0])
    event = TokenEvent("r", ids, text, 0, 0, 0, 7, 0.0, logprobs)
    rendered = LogprobsBuilder(texts, is_chat=False).chunk(event)
    assert rendered["tokens"] == [
        "a", "bytes:\\xf0", "bytes:\\x9f", "bytes:\\x8e", "bytes:\\x89",
        "bytes:\\xc3", "bytes:\\xa9",
    ]  # fmt: skip
    assert rendered["top_logprobs"][4] == {"bytes:\\x89": -0.5, "bytes:\\x8a": -1.0}
    assert rendered["text_offset"] == [0, 1, 1, 1, 1, 2, 2]
    assert [text[offset] for offset in rendered["text_offset"]] == list("a🎉🎉🎉🎉éé")  # type: ignore[index]


def test_a_merged_event_renders_each_token(engine: object) -> None:
    """Two tokens in one event (a merged burst): two entries, offsets running
    on; -inf is OpenAI's -9999.0, since JSON has no infinity."""
    texts = TokenTexts(engine.tokenizer)  # type: ignore[attr-defined]
    a, b = (engine.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("Hi", " x"))  # type: ignore[attr-defined]
    logprobs = [TokenLogprobs(-0.5, [a, b], [-0.5, -1.5]), TokenLogprobs(-math.inf, [a], [-0.1])]
    event = TokenEvent("r", [a, b], "", 0, 0, 0, 1, 0.0, logprobs)
    completion = LogprobsBuilder(texts, is_chat=False)
    first = completion.chunk(event)
    name_a, name_b = texts.of(a)[0], texts.of(b)[0]
    assert first == {
        "tokens": [name_a, name_b],
        "token_logprobs": [-0.5, LOGPROB_FLOOR],
        "top_logprobs": [{name_a: -0.5, name_b: -1.5}, {name_a: -0.1, name_b: LOGPROB_FLOOR}],
        "text_offset": [0, len(name_a)],
    }
    assert completion.chunk(event)["text_offset"] == [
        len(name_a + name_b),
        2 * len(name_a) + len(name_b),
    ]
    chat = LogprobsBuilder(texts, is_chat=True)
    chat.add(event)
    chat.add(event)
    content = chat.whole()["content"]
    assert [entry["logprob"] for entry in content] == [-0.5, LOGPROB_FLOOR] * 2  # type: ignore[index]
    assert content[1]["top_logprobs"] == [  # type: ignore[index]
        {"token": name_a, "logprob": -0.1, "bytes": texts.of(a)[1]}
    ]

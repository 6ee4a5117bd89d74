"""The OpenAI-compatible HTTP front, driven by the official ``openai`` SDK
against live servers on the ``tiny`` model: gRPC and HTTP on one event loop
and one engine, as ``slipstream serve --http-port`` runs them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import polling
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from server_thread import hold_every_submit
from structlog.testing import capture_logs

from slipstream.clients import Client
from slipstream.scheduler.errors import Overloaded, QueueFull
from slipstream.scheduler.request import ExpiredLimit, FinishReason, RejectCause
from slipstream.service.api import wire
from slipstream.service.api.auth import QuotaExceeded
from slipstream.service.api.http import generation
from slipstream.service.api.http.errors import from_domain
from slipstream.service.api.lifecycle import Loading, NotServing
from slipstream.service.api.workers import WorkersBusy
from slipstream.service.engine.chat import render_chat
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import FinishEvent, RequestSpec
from slipstream.service.telemetry.metrics import ServerMetrics
from slipstream.service.telemetry.tracing import Telemetry

# fp32 so greedy output cannot depend on how requests happen to be batched.
CONFIG = EngineConfig(model="tiny", dtype="float32", max_queue_len=4096, calibrate_cost_model=False)
MAX_BODY_BYTES = 256 * 1024
LONG = 960  # tokens: outlives anything a test does to it (tiny: ~5 s alone)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Servers:
    """gRPC and HTTP around one engine, on one event loop thread."""

    def __init__(
        self,
        engine: object,
        telemetry: Telemetry | None = None,
        workers: object = None,
        limits: object = None,
    ) -> None:
        from slipstream.service.api.limits import Limits
        from slipstream.service.api.workers import WorkerPool

        # One tokenizer pool and one set of limits for both front doors, as
        # ``slipstream serve`` has.
        self.limits = limits or Limits()
        self.workers = workers or WorkerPool.for_limits(self.limits)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.telemetry = telemetry
        self._call(self._start(engine))
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.base_url = f"http://127.0.0.1:{self.http_port}"

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    async def _start(self, engine: object) -> None:
        from slipstream.service.api.http.app import HttpFront
        from slipstream.service.api.lifecycle import Lifecycle
        from slipstream.service.api.server import build_server

        self.lifecycle = Lifecycle(engine)  # type: ignore[arg-type]
        self.server, self.grpc_port = build_server(
            self.lifecycle,
            "127.0.0.1",
            0,
            self.telemetry,
            limits=self.limits,  # type: ignore[arg-type]
            workers=self.workers,
        )
        if self.telemetry is not None:
            self.telemetry.attach(engine)  # type: ignore[arg-type]
        await self.server.start()
        self.http = HttpFront(
            self.lifecycle,
            self.telemetry,
            max_body_bytes=MAX_BODY_BYTES,
            workers=self.workers,
            limits=self.limits,  # type: ignore[arg-type]
        )
        self.http_port = await self.http.start("127.0.0.1", 0)
        await self.lifecycle.serve()

    def drain(self) -> None:
        self._call(self.lifecycle.drain())

    def stop(self) -> None:
        self._call(self.http.stop())
        self._call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs
        )


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def servers(engine: object, spans: InMemorySpanExporter) -> Iterator[Servers]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    srv = Servers(engine, Telemetry(provider, ServerMetrics()))
    yield srv
    srv.stop()


@pytest.fixture
def oai(servers: Servers) -> Iterator[openai.OpenAI]:
    with servers.client() as client:
        yield client


@pytest.fixture
def grpc_client(servers: Servers) -> Iterator[Client]:
    with Client(servers.target) as client:
        yield client


# The shared poll, with this file's own patience.
wait_until = functools.partial(polling.wait_until, timeout_s=5.0)


def engine_idle(client: Client) -> bool:
    stats = client.server_stats()
    busy = (stats.waiting, stats.running, stats.swapped, stats.kv_blocks_used.device)
    return busy == (0, 0, 0, 0)


def prompts(n: int) -> list[list[int]]:
    return [[5 + (i * 37 + j * 11) % 4000 for j in range(3 + i % 29)] for i in range(n)]


def raw(
    servers: Servers,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    method: str | None = None,
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(
        servers.base_url + path,
        data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def error_of(status_error: openai.APIStatusError) -> dict[str, object]:
    body = status_error.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# ---------------------------------------------------------------- completions


def test_completion_text_prompt(oai: openai.OpenAI, engine: object) -> None:
    reply = oai.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and reply.model == "tiny"
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    num_prompt = len(engine.tokenizer.encode("Hello there"))  # type: ignore[attr-defined]
    assert reply.usage is not None and reply.usage.prompt_tokens == num_prompt
    assert 1 <= reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == num_prompt + reply.usage.completion_tokens


def test_streamed_completion_equals_whole_and_reports_usage(oai: openai.OpenAI) -> None:
    args = {"model": "tiny", "prompt": prompts(1)[0], "max_tokens": 20, "temperature": 0}
    whole = oai.completions.create(**args, extra_body={"ignore_eos": True})
    chunks = list(
        oai.completions.create(
            **args,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    with_choices = chunks[:-1]
    assert all(c.usage is None for c in with_choices)
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "length"
    assert "".join(c.choices[0].text for c in with_choices) == whole.choices[0].text
    # One chunk per generated token, then the finish chunk.
    assert len(with_choices) == 21


def test_greedy_over_http_equals_greedy_over_grpc(oai: openai.OpenAI, grpc_client: Client) -> None:
    token_prompts = prompts(6)
    stream = grpc_client.stream()
    over_grpc = [stream.generate(p, max_tokens=12, ignore_eos=True) for p in token_prompts]
    over_grpc.append(stream.generate("The quick brown fox", max_tokens=12, ignore_eos=True))
    stream.close()
    expected = [g.result(timeout=60) for g in over_grpc]
    for prompt, want in zip([*token_prompts, "The quick brown fox"], expected, strict=True):
        reply = oai.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].text == want.text
        assert reply.usage is not None
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
            want.prompt_tokens,
            len(want.token_ids),
        )


def test_stop_sequence_ends_with_stop(oai: openai.OpenAI) -> None:
    args = {"model": "tiny", "prompt": prompts(2)[1], "max_tokens": 24, "temperature": 0}
    free = oai.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), free
    reply = oai.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "stop"
    assert stop not in reply.choices[0].text
    assert free.startswith(reply.choices[0].text)


def test_seeded_sampling_repeats(oai: openai.OpenAI) -> None:
    args = {"model": "tiny", "prompt": "Once", "max_tokens": 16, "temperature": 0.9, "top_p": 0.9}
    first = oai.completions.create(**args, seed=7, extra_body={"ignore_eos": True})
    again = oai.completions.create(**args, seed=7, extra_body={"ignore_eos": True})
    assert first.choices[0].text == again.choices[0].text


# ---------------------------------------------------------------- chat


def test_chat_on_a_model_without_template_is_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    error = error_of(caught.value)
    assert (error["param"], error["code"]) == ("messages", "invalid_messages")
    # The HTTP way round it, not the gRPC fields (text, token_ids).
    assert error["message"] == "this model has no chat template; use /v1/completions with prompt"


@pytest.fixture
def with_template(engine: object, monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHATML)  # type: ignore[attr-defined]
    return engine.tokenizer  # type: ignore[attr-defined]


def test_chat_with_a_template_streams_and_not(oai: openai.OpenAI, with_template: object) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": t} for t in ("Say ", "hi")]},
    ]
    ids = render_chat(with_template, [("system", "Be brief."), ("user", "Say hi")])
    whole = oai.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=10,
        temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    chunks = list(
        oai.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content


NULLS = {
    name: None
    for name in ("tools", "tool_choice", "response_format", "parallel_tool_calls", "metadata",
                 "store", "service_tier", "functions", "presence_penalty", "logit_bias")
}  # fmt: skip


def test_null_fields_are_absent_as_on_openai(
    oai: openai.OpenAI, servers: Servers, with_template: object
) -> None:
    """A multi-turn loop that appends the SDK's ``message.model_dump()``
    (``refusal``, ``annotations``, ``tool_calls``, ... all None) goes on."""
    messages: list[dict[str, object]] = [{"role": "user", "content": "hi", "name": None}]
    first = oai.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=3,
        extra_body=NULLS,  # type: ignore[arg-type]
    )
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
    assert messages[1]["annotations"] is None and messages[1]["refusal"] is None
    messages[1]["tool_calls"] = []
    second = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=3)  # type: ignore[arg-type]
    assert second.choices[0].finish_reason
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **NULLS}
    status, _, reply = raw(servers, "/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    # Not null: a field this server does not take is still refused, naming it.
    messages[1]["name"] = "ann"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="tiny", messages=messages, max_tokens=3)  # type: ignore[arg-type]
    assert error_of(caught.value)["message"] == "messages[1].name is not supported"


def test_chat_developer_role_is_system(oai: openai.OpenAI, with_template: object) -> None:
    def answer(role: str) -> object:
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]
        reply = oai.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=4,
            temperature=0,  # type: ignore[arg-type]
        )
        return reply.usage, reply.choices[0].message.content

    assert answer("developer") == answer("system")


def test_chat_bad_role_is_400(oai: openai.OpenAI, with_template: object) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])  # type: ignore[misc, list-item]
    assert "robot" in str(error_of(caught.value)["message"])


# ---------------------------------------------------------------- cancel


def test_closing_the_stream_frees_the_request(
    oai: openai.OpenAI, grpc_client: Client, servers: Servers
) -> None:
    stream = oai.completions.create(
        model="tiny",
        prompt=prompts(3)[2],
        max_tokens=LONG,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    assert grpc_client.server_stats().kv_blocks_used.device > 0
    stream.close()
    assert wait_until(lambda: engine_idle(grpc_client)), grpc_client.server_stats()
    _, _, metrics = raw(servers, "/metrics")
    assert 'slipstream_kv_blocks{pool="device",state="used"} 0.0' in metrics.decode()
    assert 'reason="cancelled"' in metrics.decode()


def test_a_client_gone_mid_request_is_aborted(
    servers: Servers, grpc_client: Client, engine: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not streamed: the handler is waiting, writing nothing, when the client goes.
    hold_every_submit(engine, monkeypatch)
    with servers.client(timeout=0.5) as short, pytest.raises(openai.APITimeoutError):
        short.completions.create(
            model="tiny", prompt=prompts(4)[3], max_tokens=LONG, extra_body={"ignore_eos": True}
        )
    assert wait_until(lambda: engine_idle(grpc_client)), grpc_client.server_stats()


# ---------------------------------------------------------------- scheduler controls


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


def _controls(request: RequestSpec) -> tuple[object, ...]:
    assert request.deadline is not None and request.arrival_time is not None
    return (
        request.prompt_token_ids,
        request.max_new_tokens,
        request.sampling,
        request.stop_sequences,
        request.ignore_eos,
        request.priority,
        request.expected_output_tokens,
        round(request.deadline - request.arrival_time, 3),
    )


def test_priority_deadline_and_expected_tokens_map_as_over_grpc(
    oai: openai.OpenAI, grpc_client: Client, submitted: list[RequestSpec]
) -> None:
    prompt = prompts(5)[4]
    stream = grpc_client.stream()
    stream.generate(
        prompt,
        max_tokens=6,
        temperature=0.5,
        top_p=0.8,
        seed=3,
        stop=["zz"],
        priority=2,
        deadline_s=30.0,
        expected_tokens=5,
    ).result(timeout=30)
    stream.close()
    body = {"priority": 2, "deadline_ms": 30000, "expected_output_tokens": 5}
    oai.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        temperature=0.5,
        top_p=0.8,
        seed=3,
        stop=["zz"],
        extra_body=body,
    )
    headers = {
        "x-slipstream-priority": "2",
        "x-slipstream-deadline-ms": "30000",
        "x-slipstream-expected-output-tokens": "5",
    }
    oai.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        temperature=0.5,
        top_p=0.8,
        seed=3,
        stop="zz",
        extra_headers=headers,
    )
    over_grpc, over_body, over_headers = (_controls(r) for r in submitted)
    assert over_body == over_grpc
    assert over_headers == over_grpc


def test_priority_shows_in_metrics(oai: openai.OpenAI, servers: Servers) -> None:
    oai.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=2,
        extra_headers={"x-slipstream-priority": "7"},
        extra_body={"deadline_ms": 60000},
    )
    _, _, metrics = raw(servers, "/metrics")
    assert 'slipstream_deadline_requests_total{priority="7"} 1.0' in metrics.decode()


def test_infeasible_deadline_is_refused_before_any_token(
    oai: openai.OpenAI, grpc_client: Client
) -> None:
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as caught:
            reply = oai.completions.create(
                model="tiny",
                prompt=prompts(1)[0],
                max_tokens=900,
                stream=stream,
                extra_body={"ignore_eos": True, "deadline_ms": 10},
            )
            list(reply) if stream else None  # type: ignore[call-overload]
        assert caught.value.status_code == 504
        assert error_of(caught.value)["code"] == "deadline_infeasible"
    assert engine_idle(grpc_client)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("-5", "must be in [0, 1e13] milliseconds"),
        ("1e20", "must be in [0, 1e13] milliseconds"),
        ("nan", "must be finite"),
        ("soon", "must be a number"),
    ],
)
def test_a_bad_deadline_header_is_400_naming_the_header(
    servers: Servers, header: str, message: str
) -> None:
    body = json.dumps({"model": "tiny", "prompt": "ab", "max_tokens": 2}).encode()
    status, _, reply = raw(servers, "/v1/completions", body, {"x-slipstream-deadline-ms": header})
    assert status == 400, reply
    error = json.loads(reply)["error"]
    assert error["param"] == "x-slipstream-deadline-ms", error
    assert error["message"] == f"x-slipstream-deadline-ms {message}"


def test_traceparent_joins_the_callers_trace(
    oai: openai.OpenAI, servers: Servers, spans: InMemorySpanExporter
) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
    oai.completions.create(
        model="tiny", prompt="trace me", max_tokens=3, extra_headers={"traceparent": traceparent}
    )
    assert servers.telemetry is not None
    servers.telemetry.requests.flush(5)

    def joined() -> bool:
        return any(
            f"{s.context.trace_id:032x}" == trace_id and s.parent is not None
            for s in spans.get_finished_spans()
        )

    assert wait_until(joined)


def test_a_request_refused_while_its_body_parses_joins_the_callers_trace(
    servers: Servers, spans: InMemorySpanExporter
) -> None:
    """A 400 for a bad parameter started a trace of its own."""
    trace_id = "5cf92f3577b34da6a3ce929d0e0e4737"
    body = json.dumps({"model": "tiny", "prompt": "ab", "temperature": 7}).encode()
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    status, _, _ = raw(servers, "/v1/completions", body, headers)
    assert status == 400
    [span] = [
        s
        for s in spans.get_finished_spans()
        if s.attributes.get("slipstream.rejection.reason") == "invalid"
        and f"{s.context.trace_id:032x}" == trace_id
    ]
    assert span.parent is not None and f"{span.parent.span_id:016x}" == "00f067aa0ba902b7"


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 21}, "logprobs"),  # 0 to 20 alternatives
        ({"echo": True}, "echo"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),  # past --max-choices (16)
        ({"n": True}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),  # OpenAI's range is [-2, 2]
        ({"suffix": "x"}, "suffix"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        (
            {"max_tokens": 100_000},
            "max_tokens",
        ),  # past tiny's context: was "max_new_tokens", param null
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),  # OpenAI's range is [0, 2]
        ({"top_p": 0}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"priority": -1}, "priority"),
        ({"priority": True}, "priority"),
        ({"deadline_ms": "soon"}, "deadline_ms"),
        ({"deadline_ms": -5}, "deadline_ms"),
        ({"expected_output_tokens": -3}, "expected_output_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a", 5]}, "prompt"),
        ({"prompt": ["a"] * 17}, "prompt"),  # past --max-choices (16)
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [2**32]}, "prompt"),  # was a plain-text 500: the wire's uint32
        ({"prompt": [[1, 10**20]]}, "prompt"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(
    servers: Servers, extra: dict[str, object], param: str
) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **extra}
    status, _, reply = raw(servers, "/v1/completions", json.dumps(body).encode())
    assert status == 400, reply
    error = json.loads(reply)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_completion_only_fields_at_their_off_value_are_served(servers: Servers) -> None:
    off = {"echo": False, "best_of": 1, "presence_penalty": 0, "logit_bias": {}}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **off}
    status, _, reply = raw(servers, "/v1/completions", json.dumps(body).encode())
    assert status == 200, reply


def test_temperature_is_openais_zero_to_two(servers: Servers) -> None:
    """Over gRPC any temperature >= 0 samples; the OpenAI front keeps
    OpenAI's range, so a request that works here works there too."""
    for temperature, expected in ((2, 200), (2.5, 400)):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": temperature}
        status, _, reply = raw(servers, "/v1/completions", json.dumps(body).encode())
        assert status == expected, reply
    error = json.loads(reply)["error"]
    assert error["message"] == "temperature must be in [0, 2], got 2.5", error


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 1}, "logprobs"),  # a boolean in chat
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        # Completions' alone, even at the values completions take as off.
        ({"echo": False}, "echo"),
        ({"best_of": 1}, "best_of"),
        ({"suffix": ""}, "suffix"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(
    servers: Servers, extra: dict[str, object], param: str
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}
    status, _, reply = raw(servers, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, reply
    assert json.loads(reply)["error"]["param"] == param


@pytest.mark.parametrize(
    ("path", "fields", "param", "where"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": ["a\ud800b"]}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": "ab", "stream": True, "stop": "a\udc00"}, "stop", "stop"),
        ("/v1/completions", {"prompt": "ab", "stop": ["ok", "a\ud800"]}, "stop", "stop[1]"),
        ("/v1/completions", {"prompt": "ab", "user": "a\ud800"}, "user", "user"),
        ("/v1/completions", {"prompt": "ab", "model": "t\ud800"}, "model", "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
         "messages", "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "u\ud800", "content": "a"}]},
         "messages", "messages[0].role"),
        ("/v1/chat/completions", {"stream": True, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]},
         "messages", "messages[0].content"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_400_naming_the_field(
    servers: Servers, path: str, fields: dict[str, object], param: str, where: str
) -> None:
    """JSON's ``\\ud800`` decodes to a string no UTF-8 encodes: it was a
    plain-text 500 from protobuf or the tokenizer."""
    body = json.dumps({"model": "tiny", "max_tokens": 2, **fields}).encode()
    assert b"\\ud800" in body or b"\\udc00" in body
    status, _, reply = raw(servers, path, body)
    assert status == 400, reply
    error = json.loads(reply)["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    assert error["message"] == f"{where} is not valid Unicode (a lone surrogate at character 1)"


def test_a_trace_header_that_is_not_utf8_is_400_naming_it(servers: Servers) -> None:
    body = json.dumps({"model": "tiny", "prompt": "ab", "max_tokens": 2}).encode()
    status, _, reply = raw(servers, "/v1/completions", body, {"tracestate": "k=\xff"})
    assert status == 400, reply
    assert json.loads(reply)["error"]["param"] == "tracestate"


def test_a_server_bug_is_a_json_500_with_its_traceback_logged(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not aiohttp's plain-text "Server got itself in trouble": the SDK
    reads OpenAI's error shape, and the log keeps what the caller is not told."""

    def parse(*args: object) -> object:
        raise TypeError("a bug in parsing")

    monkeypatch.setattr(generation, "parse", parse)
    body = json.dumps({"model": "tiny", "prompt": "ab", "max_tokens": 2}).encode()
    with capture_logs() as logs:
        status, headers, reply = raw(servers, "/v1/completions", body)
    assert status == 500 and headers["Content-Type"].startswith("application/json"), reply
    error = json.loads(reply)["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "a bug" not in error["message"]
    [line] = [entry for entry in logs if entry["event"] == "http_request_failed"]
    assert line["exc_info"] is True and line["path"] == "/v1/completions"


@pytest.mark.parametrize("value", [-1, 0, 100_000])
@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", "max_tokens"),
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
    ],
)
def test_a_token_limit_out_of_range_names_its_field_and_the_models_context(
    servers: Servers, path: str, field: str, value: int
) -> None:
    """Below 1 or past the context, one message: the field the caller used
    and the model's range (not the wire's 2**32 - 1, nor max_new_tokens)."""
    prompt = (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    body = {"model": "tiny", **prompt, field: value}
    status, _, reply = raw(servers, path, json.dumps(body).encode())
    assert status == 400, reply
    error = json.loads(reply)["error"]
    assert error["param"] == field
    assert error["message"] == f"{field} must be in [1, 1024], got {value}"


def test_sdk_sees_400_404_and_413(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model="tiny", prompt="x", logprobs=21)
    assert error_of(bad.value)["param"] == "logprobs"
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.completions.create(model="gpt-9", prompt="x")
    assert error_of(unknown.value)["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as large:
        oai.completions.create(model="tiny", prompt="x" * (MAX_BODY_BYTES + 10))
    assert large.value.status_code == 413


def test_too_large_and_too_long_prompts(servers: Servers) -> None:
    chars = 1024 * 32 + 1  # tiny's context times the characters a token may hold
    body = json.dumps({"model": "tiny", "prompt": "a" * chars}).encode()
    status, _, reply = raw(servers, "/v1/completions", body)
    assert status == 413 and json.loads(reply)["error"]["param"] == "prompt"
    body = json.dumps({"model": "tiny", "prompt": [7] * 1100}).encode()
    status, _, reply = raw(servers, "/v1/completions", body)
    assert status == 400 and json.loads(reply)["error"]["code"] == "context_length_exceeded"
    body = json.dumps({"model": "tiny", "prompt": [7, 5000]}).encode()
    status, _, reply = raw(servers, "/v1/completions", body)
    error = json.loads(reply)["error"]
    assert status == 400 and "vocab" in error["message"] and error["param"] == "prompt"


def test_the_servers_size_limits_are_400_naming_the_param_before_tokenizing(
    engine: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limits gRPC enforces (--max-prompt-bytes, --max-stop-sequences,
    --max-stop-sequence-bytes, trace-context size) hold over HTTP too, with
    gRPC's own message, and nothing is tokenized for a refused request."""
    from slipstream.service.api.limits import Limits

    limits = Limits(
        max_prompt_bytes=16,
        max_stop_sequences=2,
        max_stop_sequence_bytes=4,
        max_trace_context_bytes=80,
    )
    tokenized: list[object] = []
    monkeypatch.setattr(wire, "token_ids", lambda *args: tokenized.append(args) or [5])
    monkeypatch.setattr(generation, "render_chat", lambda *args: tokenized.append(args) or [5])
    srv = Servers(engine, limits=limits)
    chat = "/v1/chat/completions"
    parent = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"  # 66 bytes with its name
    cases = [
        ("/v1/completions", {"prompt": "é" * 9}, {}, "prompt", "prompt is 18 bytes"),
        (chat, {"messages": [{"role": "user", "content": "a" * 13}]}, {}, "messages", "17 bytes"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, {}, "stop", "3 stop"),
        ("/v1/completions", {"prompt": "hi", "stop": "abcde"}, {}, "stop", "longer than 4"),
        ("/v1/completions", {"prompt": "hi"}, {"tracestate": "k=" + "v" * 70}, "tracestate", "80"),
        ("/v1/completions", {"prompt": "hi"}, {"traceparent": parent, "tracestate": "k=vvvv"},
         "traceparent", "trace_context is longer than 80 bytes"),
    ]  # fmt: skip
    try:
        for path, fields, headers, param, message in cases:
            body = json.dumps({"model": "tiny", "max_tokens": 2, **fields}).encode()
            status, _, reply = raw(srv, path, body, headers)
            error = json.loads(reply)["error"]
            assert (status, error["param"]) == (400, param), (param, error)
            assert message in error["message"], error
            assert error["type"] == "invalid_request_error"
        assert tokenized == []
        body = json.dumps({"model": "tiny", "prompt": "é" * 8, "max_tokens": 2, "stop": "abcd"})
        status, _, reply = raw(srv, "/v1/completions", body.encode(), {"tracestate": "k=v"})
        assert status == 200, reply  # at each limit: served
    finally:
        srv.stop()


def test_a_prompt_over_the_context_names_its_param_in_the_grpc_wording(
    servers: Servers, grpc_client: Client, with_template: object
) -> None:
    """OpenAI names ``prompt`` or ``messages``; the message reads as gRPC's,
    for text, token ids and chat alike."""
    text = "hello " * 1100
    num_tokens = len(with_template.encode(text))  # type: ignore[attr-defined]
    cases = [
        ("/v1/completions", {"prompt": [7] * 1100, "max_tokens": 4}, "prompt", 1100, 4),
        ("/v1/completions", {"prompt": text}, "prompt", num_tokens, 16),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                  "max_tokens": 2}, "messages", None, 2),
    ]  # fmt: skip
    for path, fields, param, num_prompt, max_new in cases:
        status, _, reply = raw(servers, path, json.dumps({"model": "tiny", **fields}).encode())
        error = json.loads(reply)["error"]
        assert (status, error["param"], error["code"]) == (400, param, "context_length_exceeded")
        assert error["message"].startswith(
            "prompt (" if num_prompt is None else f"prompt ({num_prompt})"
        )
        assert error["message"].endswith(
            f" + max_new_tokens ({max_new}) exceeds max_model_len (1024)"
        )
    over_grpc = grpc_client.generate([7] * 1100, max_tokens=4).result(timeout=30)
    assert over_grpc.message == "prompt (1100) + max_new_tokens (4) exceeds max_model_len (1024)"


def test_malformed_bodies_and_routes(servers: Servers) -> None:
    status, _, reply = raw(servers, "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in json.loads(reply)["error"]["message"]
    status, _, reply = raw(servers, "/v1/completions", b"[1, 2]")
    assert status == 400
    # Valid JSON that Python's json refuses: it was a 500.
    for body, words in (
        (b"[" * 10_000 + b"]" * 10_000, "too deeply"),
        (b'{"model": "tiny", "seed": 1' + b"0" * 5000 + b"}", "digits"),
    ):
        status, _, reply = raw(servers, "/v1/completions", body)
        assert status == 400 and words in json.loads(reply)["error"]["message"], reply
    # A byte order mark is skipped, as OpenAI's servers do; bytes that are
    # not UTF-8 are said to be that, not bad JSON.
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
    status, _, reply = raw(servers, "/v1/completions", b"\xef\xbb\xbf" + body)
    assert status == 200, reply
    status, _, reply = raw(servers, "/v1/completions", body.replace(b"hi", b"h\xff"))
    message = json.loads(reply)["error"]["message"]
    assert status == 400 and message == "the request body is not valid utf-8 (at byte 30)"
    charset = {"Content-Type": "application/json; charset=nope"}
    status, _, reply = raw(servers, "/v1/completions", b"{}", charset)
    assert status == 400 and "'nope' is unknown" in json.loads(reply)["error"]["message"], reply
    status, _, reply = raw(servers, "/v1/nowhere")
    assert status == 404 and "error" in json.loads(reply)
    status, headers, reply = raw(servers, "/v1/completions", method="GET")
    assert status == 405 and "POST" in headers.get("Allow", "")
    body = json.dumps({"model": "tiny", "prompt": "x", "priority": 1}).encode()
    status, _, reply = raw(servers, "/v1/completions", body, {"x-slipstream-priority": "2"})
    assert status == 400 and json.loads(reply)["error"]["param"] == "priority"
    status, _, reply = raw(servers, "/v1/completions", body, {"x-slipstream-priority": "high"})
    assert status == 400 and json.loads(reply)["error"]["param"] == "x-slipstream-priority"


def test_a_base_url_without_v1_is_told_where_the_api_is(servers: Servers) -> None:
    """OpenAI(base_url="http://host:8000"), /v1 left off, got a bare
    "Not Found" for every call."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{servers.http_port}", api_key="x")
    with client, pytest.raises(openai.NotFoundError) as missed:
        client.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert error_of(missed.value)["message"] == (
        "POST /completions is not a route of this server "
        "(the API is under /v1: /v1/completions; a client's base URL ends in /v1)"
    )
    status, _, reply = raw(servers, "/v1/nowhere")
    message = json.loads(reply)["error"]["message"]
    assert status == 404 and message == "GET /v1/nowhere is not a route of this server"


def test_models_health_and_metrics(oai: openai.OpenAI, servers: Servers) -> None:
    assert [m.id for m in oai.models.list()] == ["tiny"]
    status, _, reply = raw(servers, "/health")
    assert status == 200 and json.loads(reply) == {"status": "serving"}
    status, headers, reply = raw(servers, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b"slipstream_kv_blocks" in reply


def test_the_sdk_retrieves_the_served_model_and_no_other(oai: openai.OpenAI) -> None:
    [listed] = oai.models.list().data
    model = oai.models.retrieve("tiny")
    assert model.to_dict() == listed.to_dict()
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "slipstream")
    assert isinstance(model.created, int)
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.models.retrieve("gpt-9")
    error = error_of(unknown.value)
    assert (error["param"], error["code"]) == ("model", "model_not_found"), error
    assert "gpt-9" in str(error["message"])


def test_tokenizing_runs_off_the_event_loop(
    oai: openai.OpenAI, servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[threading.Thread] = []
    original = wire.token_ids

    def token_ids(*args: object, **kwargs: object) -> list[int]:
        threads.append(threading.current_thread())
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(wire, "token_ids", token_ids)
    oai.completions.create(model="tiny", prompt="a text prompt", max_tokens=2)
    # On the server's tokenizer pool, the one gRPC uses, not a thread of its own.
    assert threads and servers.thread not in threads
    assert all(t.name.startswith("slipstream-tokenizer") for t in threads)


def test_a_full_tokenizer_pool_is_429_over_http_and_grpc(engine: object) -> None:
    """HTTP and gRPC prompts share one bounded pool: while it is full, a text
    prompt on either front door is refused at once (429 / RESOURCE_EXHAUSTED)
    and nothing waits unboundedly; token-id prompts need no tokenizing."""
    import grpc

    from slipstream.service.api.workers import WorkerPool

    pool = WorkerPool(num_workers=1, max_queued=0, trim_after_bytes=2**40)
    srv = Servers(engine, workers=pool)
    release = threading.Event()
    try:
        future = asyncio.run_coroutine_threadsafe(pool.run(release.wait), srv.loop)
        assert wait_until(lambda: pool.num_pending == 1)
        with srv.client() as oai:
            with pytest.raises(openai.RateLimitError) as full:
                oai.completions.create(model="tiny", prompt="a text prompt", max_tokens=2)
            assert error_of(full.value)["code"] == "queue_full"
            ids = oai.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)
            assert ids.choices[0].finish_reason == "length"
        with Client(srv.target) as grpc_client, pytest.raises(grpc.RpcError) as refused:
            grpc_client.tokenize("a" * 100_000)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        future.result(timeout=5)
        with srv.client() as oai:
            done = oai.completions.create(model="tiny", prompt="a text prompt", max_tokens=2)
            assert done.choices[0].finish_reason == "length"
    finally:
        release.set()
        srv.stop()


# ---------------------------------------------------------------- queue full, draining


def _give_up_after(servers: Servers, timeout_s: float, prompt: list[int]) -> None:
    with servers.client(timeout=timeout_s) as oai, contextlib.suppress(openai.APITimeoutError):
        oai.completions.create(
            model="tiny", prompt=prompt, max_tokens=LONG, extra_body={"ignore_eos": True}
        )


@pytest.mark.parametrize(
    ("error", "retry_after"),
    [
        (QueueFull("waiting queue is full (4 requests); retry after 2.300s", 2.3), "3"),
        (Overloaded("overloaded (1.30x): ...; retry after 0.050s", 0.05, 1.3), "1"),
        (QueueFull("waiting queue is full (4 requests); retry after 3.000s", 3.0), "3"),
        (QuotaExceeded("tenant 'a' is over its quota", 4.2), "5"),
        (WorkersBusy("every tokenizer worker is busy"), "1"),  # no hint of its own
    ],
)
def test_retry_after_is_the_refusals_own_hint(error: Exception, retry_after: str) -> None:
    answer = from_domain(error)
    assert answer is not None and answer.status == 429
    assert answer.headers == {"Retry-After": retry_after}


def test_a_shed_request_is_told_when_to_retry() -> None:
    shed = FinishEvent(
        "r",
        FinishReason.REJECTED,
        "shed from a full queue for a more urgent request; retry after 2.500s",
        reject_cause=RejectCause.SHED,
        retry_after_s=2.5,
    )
    answer = generation.finish_error(shed)
    assert answer.status == 503 and answer.headers == {"Retry-After": "3"}
    assert answer.code == "shed"
    assert generation.finish_error(FinishEvent("r", FinishReason.ERROR)).headers == {}


def test_a_request_rejected_once_queued_names_why_in_its_code() -> None:
    """Refused at the door, a request's code says why (``queue_full``,
    ``deadline_infeasible``); rejected once queued, every cause said
    ``rejected``, and a client could only read the message to tell."""
    late = FinishEvent(
        "r",
        FinishReason.REJECTED,
        reject_cause=RejectCause.DEADLINE_INFEASIBLE,
        expired_limit=ExpiredLimit.DEADLINE,
    )
    answer = generation.finish_error(late)
    assert (answer.status, answer.code) == (503, "deadline_infeasible")
    assert answer.body()["error"]["code"] == "deadline_infeasible"


def test_every_503_says_when_to_retry() -> None:
    """A 503 (loading, draining, cut off at shutdown) carried no Retry-After,
    as a 429 does: a client or a balancer could not tell when to come back.
    Its own hint where it has one (shed), else a second."""
    cut_off = generation.finish_error(FinishEvent("r", FinishReason.SHUTDOWN))
    shed = generation.finish_error(
        FinishEvent("r", FinishReason.REJECTED, reject_cause=RejectCause.SHED, retry_after_s=2.5)
    )
    loading, draining = from_domain(Loading("loading")), from_domain(NotServing("draining"))
    assert loading is not None and draining is not None
    for refused, retry_after in ((cut_off, "1"), (shed, "3"), (loading, "1"), (draining, "1")):
        assert refused.status == 503
        assert refused.response().headers["Retry-After"] == retry_after, refused
    failed = generation.finish_error(FinishEvent("r", FinishReason.ERROR))
    assert "Retry-After" not in failed.response().headers  # a 500: no retry promised


def test_queue_full_is_429_and_draining_is_503() -> None:
    from slipstream.service.engine.loader import load_engine

    config = EngineConfig(
        model="tiny", dtype="float32", max_num_seqs=1, max_queue_len=1, calibrate_cost_model=False
    )
    eng = load_engine(config)
    srv = Servers(eng)
    try:
        with srv.client() as oai, Client(srv.target) as grpc_client:
            long = {"model": "tiny", "max_tokens": LONG, "stream": True}
            running = oai.completions.create(
                **long, prompt=prompts(1)[0], extra_body={"ignore_eos": True}
            )
            next(iter(running))
            # Headers wait for the first token, so the queued call blocks: in a thread,
            # on a client that gives up (and so cancels it) after a while.
            queued = threading.Thread(target=_give_up_after, args=(srv, 3.0, prompts(2)[1]))
            queued.start()
            assert wait_until(lambda: grpc_client.server_stats().waiting == 1)
            with pytest.raises(openai.RateLimitError) as full:
                oai.completions.create(model="tiny", prompt="x", max_tokens=2)
            error = error_of(full.value)
            assert error["code"] == "queue_full"
            # The header says what the message says, in whole seconds rounded up.
            hint = re.search(r"retry after ([\d.]+)s", str(error["message"]))
            assert hint is not None, error
            retry_after = full.value.response.headers["Retry-After"]
            assert retry_after == str(max(1, math.ceil(float(hint.group(1))))), error

            srv.drain()
            status, _, reply = raw(srv, "/health")
            assert status == 503 and json.loads(reply)["error"]["code"] == "draining"
            with pytest.raises(openai.InternalServerError) as draining:
                oai.completions.create(model="tiny", prompt="x", max_tokens=2)
            assert draining.value.status_code == 503
            running.close()
            queued.join()
            assert wait_until(lambda: engine_idle(grpc_client), timeout_s=10)
    finally:
        srv.stop()
        eng.shutdown()


# ---------------------------------------------------------------- bench serve --protocol http


def test_bench_http_load_counts_every_token(servers: Servers) -> None:
    from slipstream.service.bench.http_load import run_http
    from slipstream.service.bench.serve import LoadShape, metrics
    from slipstream.service.bench.workload import make_workload

    workload = make_workload(6, 0, 4096, prompt_len=(4, 40), output_len=(2, 12))
    warmup = make_workload(2, 1, 4096, prompt_len=(4, 8), output_len=(2, 3))
    traces, wall = run_http(
        servers.base_url, "tiny", workload, LoadShape(math.inf, 1.0, 3, 0), warmup
    )
    report = metrics(traces, workload, wall)
    assert report["token_counts_match"] and report["num_completed"] == 6
    assert [len(t.chunk_times) for t in traces] == [r.max_tokens for r in workload]


@pytest.mark.slow
def test_chat_on_smollm2_with_its_own_template() -> None:
    from slipstream.service.engine.loader import load_engine

    eng = load_engine(EngineConfig(model="smollm2", dtype="float32", calibrate_cost_model=False))
    srv = Servers(eng)
    try:
        ids = render_chat(eng.tokenizer, [("user", "Name a colour.")])
        with srv.client() as oai, Client(srv.target) as grpc_client:
            reply = oai.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Name a colour."}],
                max_tokens=8,
                temperature=0,
            )
            assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
            over_grpc = grpc_client.generate(ids, max_tokens=8).result(timeout=120)
            assert reply.choices[0].message.content == over_grpc.text and over_grpc.text
    finally:
        srv.stop()
        eng.shutdown()


def test_a_body_refused_at_parsing_is_counted_as_a_rejection(servers: Servers) -> None:
    # As a gRPC submit's INVALID_ARGUMENT is: a client sending bad bodies
    # shows in slipstream_rejections_total, not only in its own 400s.
    def invalid_count() -> float:
        _, _, metrics = raw(servers, "/metrics")
        for line in metrics.decode().splitlines():
            if line.startswith('slipstream_rejections_total{reason="invalid"}'):
                return float(line.split()[-1])
        return 0.0

    before = invalid_count()
    for body in (
        {"model": "tiny", "prompt": ""},
        {"model": "tiny", "prompt": "x", "max_tokens": -3},
    ):
        status, _, _ = raw(servers, "/v1/completions", json.dumps(body).encode())
        assert status == 400
    assert invalid_count() == before + 2


# ---------------------------------------------------------------- loading or draining


def test_a_call_refused_while_loading_or_draining_says_which_on_both_fronts() -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from slipstream.service.api.http.app import HttpFront
    from slipstream.service.api.lifecycle import Lifecycle
    from slipstream.service.api.server import build_server
    from slipstream.service.api.servicer import REJECT_REASON_KEY
    from slipstream.v1 import inference_pb2 as pb
    from slipstream.v1 import inference_pb2_grpc as pb_grpc

    metrics = ServerMetrics()
    telemetry = Telemetry(TracerProvider(), metrics)
    lifecycle = Lifecycle()  # no engine yet: loading
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[object, int, HttpFront, int]:
        server, port = build_server(lifecycle, "127.0.0.1", 0, telemetry)
        await server.start()
        http = HttpFront(lifecycle, telemetry)
        return server, port, http, await http.start("127.0.0.1", 0)

    def call(coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()  # type: ignore[arg-type]

    server, port, http, http_port = call(start())  # type: ignore[misc]
    front = type("Front", (), {"base_url": f"http://127.0.0.1:{http_port}"})
    try:
        call(lifecycle.report_loading())
        for phase in ("loading", "draining"):  # each front names the one it is in
            if phase == "draining":
                call(lifecycle.drain())
            with capture_logs() as logs:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pb_grpc.InferenceStub(channel)
                    with pytest.raises(grpc.RpcError) as refused:
                        list(stub.GenerateOne(pb.Submit(request_id="a", text="x"), timeout=5))
                    health = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=5
                    )
                body = b'{"model": "tiny", "prompt": "x"}'
                status, said, reply = raw(front, "/v1/completions", body)  # type: ignore[arg-type]
                checked, checked_said, checked_reply = raw(front, "/health", method="GET")  # type: ignore[arg-type]
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            assert f"is {phase}" in refused.value.details()
            assert dict(refused.value.trailing_metadata())[REJECT_REASON_KEY] == phase
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert status == 503 and json.loads(reply)["error"]["code"] == phase
            assert f"is {phase}" in json.loads(reply)["error"]["message"]
            assert checked == 503 and json.loads(checked_reply)["error"]["code"] == phase
            assert said["Retry-After"] == checked_said["Retry-After"] == "1"
            refusals = [
                (line["method"], line["reason"]) for line in logs if line["event"] == "call_refused"
            ]
            assert refusals == [("GenerateOne", phase), ("POST /v1/completions", phase)]
            counted = metrics.registry.get_sample_value(
                "slipstream_rejections_total", {"reason": phase}
            )
            assert counted == 2
    finally:
        call(http.stop())
        call(server.stop(0))  # type: ignore[attr-defined]
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def test_the_model_is_not_told_before_the_server_serves() -> None:
    """Between the model's load and its engine's start (a warm-up that can
    take seconds) /v1/models answered 200 while /health and a completion
    said 503 loading: a client polling it for readiness was refused."""
    from types import SimpleNamespace

    from slipstream.service.api.http.app import HttpFront
    from slipstream.service.api.lifecycle import Lifecycle

    starting, started = threading.Event(), threading.Event()

    class StartingEngine:
        info = SimpleNamespace(name="tiny", max_model_len=1024)

        def start(self) -> None:
            starting.set()
            assert started.wait(30)

    lifecycle = Lifecycle()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()  # type: ignore[arg-type]

    http = HttpFront(lifecycle)
    front = type("Front", (), {"base_url": f"http://127.0.0.1:{call(http.start('127.0.0.1', 0))}"})

    def answers() -> list[tuple[int, object]]:
        """/health's and /v1/models' statuses and error codes."""
        codes = []
        for path in ("/health", "/v1/models"):
            status, _, body = raw(front, path, method="GET")  # type: ignore[arg-type]
            codes.append((status, json.loads(body).get("error", {}).get("code")))
        return codes

    try:
        serving = asyncio.run_coroutine_threadsafe(lifecycle.serve(StartingEngine()), loop)  # type: ignore[arg-type]
        assert starting.wait(30)
        assert answers() == [(503, "loading"), (503, "loading")]
        started.set()
        serving.result(30)
        assert answers() == [(200, None), (200, None)]
    finally:
        started.set()
        call(http.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join()

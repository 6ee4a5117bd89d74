"""Tool calling on the HTTP chat endpoint, driven by the official ``openai``
SDK against a live front on ``tiny``: bad tools and choices refused naming
the field; a named function's and "required"'s output constrained to the
calls, whole and streamed (the SDK's stream accumulator reads the deltas);
"auto" reading ``<tool_call>`` blocks out of the text a model writes
(scripted here: tiny writes none); a conversation with earlier calls and
their results rendered by a template that takes them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from http_front_thread import FrontThread

from slipstream.scheduler.request import FinishReason
from slipstream.service.api.http.tools import nests_deeper
from slipstream.service.api.limits import Limits
from slipstream.service.engine.chat import ChatMessage, ToolCall, render_chat
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import FinishEvent, RequestSpec, TokenEvent

# fp32: greedy and seeded output cannot depend on how requests are batched.
CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)
# ChatML with Qwen2.5's way of showing tools, calls and results.
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Parameters tiny fills in a few tokens: a closed set of keys and values.
WEATHER = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "local"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "time", "description": "The time now", "parameters": TIME},
    },
]
SCHEMAS = {"weather": WEATHER, "time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
ARGS = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60}


class Front(FrontThread):
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)

    def post(self, body: dict[str, object]) -> tuple[int, dict[str, object]]:
        status, reply = self.post_bytes("/v1/chat/completions", json.dumps(body).encode())
        return status, json.loads(reply)


@pytest.fixture(scope="module")
def front(engine: object) -> Iterator[Front]:
    srv = Front(engine, Limits(max_constraint_bytes=4096))
    yield srv
    srv.stop()


@pytest.fixture
def oai(front: Front) -> Iterator[openai.OpenAI]:
    with front.client() as client:
        yield client


@pytest.fixture
def tools_template(engine: object, monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setattr(engine.tokenizer, "chat_template", TOOLS_CHATML)  # type: ignore[attr-defined]
    return engine.tokenizer  # type: ignore[attr-defined]


@pytest.fixture
def plain_template(engine: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHATML)  # type: ignore[attr-defined]


def _tool(name: str, parameters: object = None, **function: object) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "parameters": parameters, **function}}


NAMED = {"type": "function", "function": {"name": "time"}}


def _assistant(arguments: str) -> dict[str, object]:
    """An earlier assistant message calling ``f`` with ``arguments``."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _nested(depth: int) -> dict[str, object]:
    """Parameters of ``depth`` objects, one within the other."""
    parameters: dict[str, object] = {}
    for _ in range(depth - 1):
        parameters = {"a": parameters}
    return parameters


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": []}, "tools", "tools must be a non-empty list of functions"),
        ({"tools": {"type": "function"}}, "tools", "tools must be a non-empty list"),
        ({"tools": [_tool(f"f{i}") for i in range(129)]}, "tools", "more than the 128 allowed"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "tools[0].type must"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object"),
        ({"tools": [_tool("a b")]}, "tools", "tools[0].function.name is required"),
        ({"tools": [_tool("x" * 65)]}, "tools", "tools[0].function.name is required"),
        ({"tools": [_tool("f"), _tool("f")]}, "tools", "tools[1].function.name 'f' is given twice"),
        ({"tools": [_tool("f", [1])]}, "tools", "tools[0].function.parameters must be a JSON"),
        ({"tools": [_tool("f", description=3)]}, "tools", "description must be a string"),
        ({"tools": [_tool("f", strict="yes")]}, "tools", "strict must be a boolean"),
        ({"tools": [_tool("f", returns={})]}, "tools", "tools[0].function.returns is not"),
        ({"tools": [{**_tool("f"), "cache": 1}]}, "tools", "tools[0].cache is not supported"),
        ({"tools": [_tool("f", description="a\ud800")]}, "tools", "not valid Unicode"),
        ({"tools": [_tool("f", {"description": "x" * 5000})]}, "tools", "over this server's"),
        (  # each function within the limit, "required"'s schema of all of them over it
            {
                "tools": [_tool(f"f{i}", {"description": "x" * 1500}) for i in range(3)],
                "tool_choice": "required",
            },
            "tools",
            "the constraint is",
        ),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when tools"),
        ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls", "must be a boolean"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "tool_choice must be none"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "a named"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "tool_choice names function 'nope', which is not in tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "response_format",
            "response_format cannot be combined with tool_choice required",
        ),
        (
            {"tools": [_tool("f", {"type": "nonsense"})], "tool_choice": "required"},
            "tools",
            "json_schema",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
            "messages",
            "messages[0].tool_calls is only allowed in an assistant message",
        ),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
            "messages",
            "messages[0].tool_calls[0] must be an object with a function",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "\ud800"},
                            }
                        ],
                    }
                ]
            },
            "messages",
            "messages[0].tool_calls[0] is not valid Unicode",
        ),
        *(
            (
                {"messages": [{"role": "assistant", "content": "x", "tool_calls": calls}]},
                "messages",
                "messages[0].tool_calls must be a list",
            )
            for calls in ({}, 0, False, "", "abc", {"id": "c"})
        ),
        (  # the template is handed them decoded, and copies them recursively
            {"messages": [MESSAGES[0], _assistant('{"a": ' + "[" * 128 + "]" * 128 + "}")]},
            "messages",
            "messages[1].tool_calls[0].function.arguments nests arrays or objects more than 128",
        ),
        (
            {"messages": [MESSAGES[0], _assistant("[" * 600 + "]" * 600)]},
            "messages",
            "messages[1].tool_calls[0].function.arguments nests arrays or objects more than 128",
        ),
        (  # shown to the template even where not called
            {"tools": [_tool("f", _nested(200))], "tool_choice": "none"},
            "tools",
            "tools[0].function.parameters nests arrays or objects more than 128 deep",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages",
            "messages[0].tool_call_id is only allowed in a tool message",
        ),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
            "messages",
            "messages[0].tool_call_id must be a string",
        ),
    ],
)
def test_bad_tools_are_400_naming_the_field(
    front: Front, tools_template: object, fields: dict[str, object], param: str, message: str
) -> None:
    status, reply = front.post({**ARGS, "tools": None, **fields})
    assert status == 400, reply
    error = reply["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error  # type: ignore[index]
    assert message in error["message"], error  # type: ignore[index]


def test_auto_needs_a_template_that_renders_tools(front: Front, plain_template: None) -> None:
    status, reply = front.post(ARGS)  # auto: OpenAI's default with tools
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == "tool_choice"  # type: ignore[index]
    assert "chat template renders tools" in error["message"]  # type: ignore[index]
    assert "required or a named function work with any model" in error["message"]  # type: ignore[index]
    for choice in ("none", "required", NAMED):
        status, reply = front.post({**ARGS, "tool_choice": choice})
        assert status == 200, (choice, reply)


def _arguments(call: object) -> dict[str, object]:
    """A call's arguments, checked against its function's schema."""
    arguments = json.loads(call.function.arguments)  # type: ignore[attr-defined]
    jsonschema.validate(arguments, SCHEMAS[call.function.name])  # type: ignore[attr-defined]
    return arguments


@pytest.mark.parametrize("temperature", [0, 1])
def test_a_named_function_is_called_with_valid_arguments(
    oai: openai.OpenAI, tools_template: object, temperature: float
) -> None:
    reply = oai.chat.completions.create(**ARGS, tool_choice=NAMED, temperature=temperature, seed=5)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "time"
    assert call.id.startswith("call_") and len(call.id) > 20
    _arguments(call)


def test_required_calls_are_valid_and_parallel_ones_can_be_turned_off(
    oai: openai.OpenAI, tools_template: object
) -> None:
    """tiny, sampled, goes on adding calls to the array until cut off: each
    call but the one cut off is whole and valid."""
    seen = set()
    for seed in range(4):
        one = oai.chat.completions.create(
            **ARGS, tool_choice="required", temperature=1, seed=seed, parallel_tool_calls=False
        )
        choice = one.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        _arguments(call)
        seen.add(call.function.name)
        several = oai.chat.completions.create(
            **ARGS, tool_choice="required", temperature=1, seed=seed
        )
        choice = several.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        calls = choice.message.tool_calls
        assert len(calls) > 1
        for call in calls[:-1]:
            _arguments(call)
            seen.add(call.function.name)
        assert len({call.id for call in calls}) == len(calls)
    assert seen == {"weather", "time"}, seen


def _streamed(oai: openai.OpenAI, **fields: object) -> tuple[list[object], object]:
    """The chunks of a streamed request, and the message the SDK's own
    accumulator (``chat.completions.stream``) makes of them."""
    chunks = list(oai.chat.completions.create(**ARGS, stream=True, **fields))  # type: ignore[call-overload]
    with oai.chat.completions.stream(**ARGS, **fields) as stream:  # type: ignore[arg-type]
        for _ in stream:  # (get_final_completion raises on a "length" finish)
            pass
        final = stream.current_completion_snapshot
    return chunks, final


@pytest.mark.parametrize(
    ("fields", "finish"),
    [
        ({"tool_choice": NAMED}, "tool_calls"),
        ({"tool_choice": "required", "parallel_tool_calls": False}, "tool_calls"),
        ({"tool_choice": "required"}, "length"),  # several calls, the last cut off
    ],
)
def test_streamed_calls_are_what_the_whole_answer_holds(
    oai: openai.OpenAI, tools_template: object, fields: dict[str, object], finish: str
) -> None:
    fields = {**fields, "temperature": 1, "seed": 3}
    whole = oai.chat.completions.create(**ARGS, **fields)  # type: ignore[arg-type]
    chunks, final = _streamed(oai, **fields)
    first = chunks[0].choices[0].delta  # type: ignore[attr-defined]
    assert first.role == "assistant" and first.content is None
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]  # type: ignore[attr-defined]
    opening = deltas[0][0]
    assert opening.id.startswith("call_") and opening.function.name and opening.type == "function"
    assert len(deltas) > 2  # the arguments come as they are written
    assert chunks[-1].choices[0].finish_reason == finish  # type: ignore[attr-defined]
    answer = final.choices[0]  # type: ignore[attr-defined]
    assert answer.finish_reason == finish and answer.message.content is None
    expected = whole.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in answer.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in expected
    ]
    assert [c.index for c in answer.message.tool_calls] == list(range(len(expected)))
    whole_calls = expected if finish == "tool_calls" else expected[:-1]
    for call in whole_calls:
        _arguments(call)


def test_a_call_cut_off_by_max_tokens_finishes_length(
    oai: openai.OpenAI, tools_template: object
) -> None:
    weather = {"type": "function", "function": {"name": "weather"}}
    reply = oai.chat.completions.create(
        **{**ARGS, "max_tokens": 3}, tool_choice=weather, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and call.function.arguments.startswith('{"')
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    # Cut off before a first call's name: no call, and no content either.
    reply = oai.chat.completions.create(
        **{**ARGS, "max_tokens": 2}, tool_choice="required", temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.content, choice.message.tool_calls) == (None, None)


def test_a_call_cut_off_by_a_stop_string_finishes_stop(
    oai: openai.OpenAI, tools_template: object
) -> None:
    """A stop string (or stop token id) ends a constrained output before its
    grammar's end: the call is shown as far as it came, and the finish is
    the request's own ("stop"), not "tool_calls", whole and streamed. (The
    engine reports a grammar's end as a stop too: the output tells them
    apart.)"""
    weather = {"type": "function", "function": {"name": "weather"}}
    fields = {"tool_choice": weather, "temperature": 0, "stop": [","]}
    whole = oai.chat.completions.create(**ARGS, **fields)  # type: ignore[arg-type]
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and call.function.arguments.startswith('{"')
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    chunks, final = _streamed(oai, **fields)
    assert chunks[-1].choices[0].finish_reason == "stop"  # type: ignore[attr-defined]
    answer = final.choices[0]  # type: ignore[attr-defined]
    assert answer.finish_reason == "stop"
    assert answer.message.tool_calls[0].function.arguments == call.function.arguments
    # Without the stop string the same call is whole: "tool_calls".
    whole = oai.chat.completions.create(**ARGS, tool_choice=weather, temperature=0)
    assert whole.choices[0].finish_reason == "tool_calls"
    _arguments(whole.choices[0].message.tool_calls[0])


def test_none_renders_the_tools_and_answers_text(
    oai: openai.OpenAI, tools_template: object, engine: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[RequestSpec] = []
    original = engine.submit  # type: ignore[attr-defined]

    def spy(request: RequestSpec, on_event: object) -> None:
        seen.append(request)
        original(request, on_event)

    monkeypatch.setattr(engine, "submit", spy)
    reply = oai.chat.completions.create(**ARGS, tool_choice="none", temperature=0)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")
    with_tools = render_chat(tools_template, [ChatMessage("user", "Weather in Paris?")], TOOLS)
    assert seen[0].prompt_token_ids == with_tools and seen[0].constraint is None
    assert reply.usage is not None and reply.usage.prompt_tokens == len(with_tools)


# What a model that writes hermes calls answered, token by token.
SCRIPT = [
    "Let me",
    " check.",
    "\n<tool",
    "_call>\n",
    '{"name": "weather", "arguments": {"unit": "c", ',
    '"days": 3}}\n</tool_call>',
    "\n<tool_call>\n",
    '{"name": "time", "arguments": {"zone": "utc"}}',
    "\n</tool_call>",
]


@pytest.fixture
def scripted(engine: object, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The engine answers every request with ``SCRIPT``'s texts, then EOS."""
    script = list(SCRIPT)

    def submit(request: RequestSpec, on_event: object) -> None:
        for i, text in enumerate(script):
            on_event(TokenEvent(request.req_id, [5], text, i, i, 0, 1, 0.0))  # type: ignore[operator]
        finish = FinishEvent(request.req_id, FinishReason.EOS, num_output_tokens=len(script))
        on_event(finish)  # type: ignore[operator]

    monkeypatch.setattr(engine, "submit", submit)
    return script


def test_auto_reads_hermes_calls_whole_and_streamed(
    oai: openai.OpenAI, tools_template: object, scripted: list[str]
) -> None:
    whole = oai.chat.completions.create(**ARGS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("weather", {"unit": "c", "days": 3}), ("time", {"zone": "utc"})]
    chunks, final = _streamed(oai)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # type: ignore[attr-defined]
    assert text == "Let me check."
    answer = final.choices[0]  # type: ignore[attr-defined]
    assert answer.finish_reason == "tool_calls" and answer.message.content == "Let me check."
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls
    ] == calls
    assert [c.index for c in answer.message.tool_calls] == [0, 1]


def test_auto_without_a_call_is_a_plain_answer(
    oai: openai.OpenAI, tools_template: object, scripted: list[str]
) -> None:
    scripted[:] = ["Sunny, ", "<tool", " no, ", '<tool_call>{"name": "rain"}</tool_call>', " \n"]
    whole = oai.chat.completions.create(**ARGS).choices[0]
    expected = 'Sunny, <tool no, <tool_call>{"name": "rain"}</tool_call> \n'  # rain: no tool
    assert (whole.message.content, whole.message.tool_calls) == (expected, None)
    assert whole.finish_reason == "stop"
    chunks, _ = _streamed(oai)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected  # type: ignore[attr-defined]
    assert chunks[-1].choices[0].finish_reason == "stop"  # type: ignore[attr-defined]


def test_a_conversation_with_calls_and_results_renders(
    oai: openai.OpenAI, tools_template: object, engine: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's own assistant message (content null, tool_calls) and the
    tool's result go back; the template sees the call's arguments as an
    object, and the result's id."""
    first = oai.chat.completions.create(**ARGS, tool_choice=NAMED, temperature=0)
    assistant = first.choices[0].message.model_dump(exclude_none=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *MESSAGES,
        assistant,
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    seen: list[RequestSpec] = []
    original = engine.submit  # type: ignore[attr-defined]

    def spy(request: RequestSpec, on_event: object) -> None:
        seen.append(request)
        original(request, on_event)

    monkeypatch.setattr(engine, "submit", spy)
    reply = oai.chat.completions.create(**{**ARGS, "messages": messages}, tool_choice="none")
    assert reply.choices[0].finish_reason in ("stop", "length")
    text = tools_template.decode(seen[0].prompt_token_ids)  # type: ignore[attr-defined]
    arguments = json.dumps(json.loads(call.function.arguments))  # tojson of the object
    assert f'{{"name": "time", "arguments": {arguments}}}' in text, text
    assert f"12:00 ({call.id})" in text, text
    conversation = [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", (ToolCall(call.id, "time", call.function.arguments),)),
        ChatMessage("tool", "12:00", tool_call_id=call.id),
    ]
    assert seen[0].prompt_token_ids == render_chat(tools_template, conversation, TOOLS)


def test_each_choice_calls_on_its_own_with_logprobs_per_token(
    oai: openai.OpenAI, tools_template: object
) -> None:
    fields = {"tool_choice": "required", "parallel_tool_calls": False, "n": 2, "seed": 1}
    whole = oai.chat.completions.create(**ARGS, **fields, temperature=1)  # type: ignore[arg-type]
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        _arguments(call)
    # Streamed with logprobs: every token's, though the chunks carry calls.
    chunks = list(
        oai.chat.completions.create(
            **ARGS,
            tool_choice=NAMED,
            temperature=0,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    entries = [
        entry
        for chunk in chunks
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    assert chunks[-1].usage is not None
    assert len(entries) == chunks[-1].usage.completion_tokens
    arguments = "".join(
        call.function.arguments or ""
        for chunk in chunks
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
    )
    assert "".join(entry.token for entry in entries) == arguments


def test_required_follows_references_inside_parameters(
    oai: openai.OpenAI, tools_template: object
) -> None:
    """A function's ``$ref``s point into its own parameters, wherever
    "required"'s schema puts them."""
    unit = {
        "type": "object",
        "$defs": {"unit": {"enum": ["c", "f"]}},
        "properties": {"unit": {"$ref": "#/$defs/unit"}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    tools = [_tool("first", unit), _tool("second", unit)]
    for seed in range(3):
        reply = oai.chat.completions.create(
            **{**ARGS, "tools": tools},
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1,
            seed=seed,
        )
        (call,) = reply.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), unit)


def test_nesting_is_bounded_at_128(oai: openai.OpenAI, tools_template: object) -> None:
    """128 levels are accepted (in a function's parameters, in an earlier
    call's arguments): the bound is far below what the template survives."""
    deep = "[" * 127 + "]" * 127  # within the arguments' object
    messages = [
        *MESSAGES,
        _assistant(f'{{"a": {deep}}}'),
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    tools = [_tool("f", _nested(128))]
    reply = oai.chat.completions.create(
        **{**ARGS, "messages": messages, "tools": tools, "max_tokens": 2}, tool_choice="none"
    )
    assert reply.choices[0].finish_reason == "length"


def test_nests_deeper_counts_brackets_outside_strings() -> None:
    assert not nests_deeper("{}", 1) and nests_deeper("[[]]", 1) and not nests_deeper("[[]]", 2)
    assert not nests_deeper('{"a": "[[[[[[", "b": [{}, [], {"c": "]]]"}]}', 3)
    assert nests_deeper('{"a": "[[[[[[", "b": [{}, [], {"c": [1]}]}', 3)
    assert not nests_deeper('["\\"[[[", {}]', 2)  # an escaped quote: still inside the string
    assert not nests_deeper("[" * 50 + "]" * 50 + "[]" * 1000, 50)
    assert nests_deeper("[" * 51 + "]" * 51 + "[]" * 1000, 50)
    assert nests_deeper("[[[ not json", 2) and not nests_deeper("]]]][[ not json", 2)


def test_required_keeps_what_parameters_hold_as_written(
    oai: openai.OpenAI, tools_template: object
) -> None:
    """Nothing in a function's parameters is rewritten for "required": a
    value shaped as a reference stays one (a const here), an anchor
    resolves, and parameters with an ``$id`` of their own keep it."""
    const = {
        "type": "object",
        "properties": {"k": {"const": {"$ref": "#/x"}}},
        "required": ["k"],
        "additionalProperties": False,
    }
    anchor = {
        "type": "object",
        "$defs": {"n": {"$anchor": "node", "type": "integer", "minimum": 1, "maximum": 3}},
        "properties": {"k": {"$ref": "#node"}},
        "required": ["k"],
        "additionalProperties": False,
    }
    own_id = {
        **anchor,
        "$id": "https://example.com/own.json",
        "properties": {"k": {"$ref": "#/$defs/n"}},
    }
    for name, schema in {"const": const, "anchor": anchor, "own_id": own_id}.items():
        reply = oai.chat.completions.create(
            **{**ARGS, "tools": [_tool(name, schema)]},
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
        )
        (call,) = reply.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema)

"""An OpenAI request body (plus Slipstream's headers) as a ``pb.Submit``
without its prompt, so the engine request is then built by the very code
the gRPC service uses (``wire.to_generation_request``).

Accepted: ``model``, ``prompt`` (a string, a list of token ids, or a
list of either, each one prompt) or ``messages``, ``stream``,
``stream_options.include_usage``, ``max_tokens`` / ``max_completion_tokens``,
``temperature`` (0 to 2), ``top_p``, ``seed``, ``stop``, ``n`` (prompts
times ``n`` at most ``Limits.max_choices``), ``user``, ``logprobs``
(completions: 0 to 20 alternatives; chat: a boolean, with ``top_logprobs``
0 to 20), ``presence_penalty`` and ``frequency_penalty`` (-2 to 2),
``logit_bias`` (token ids, as strings, to -100 to 100); vLLM's
``repetition_penalty`` (1/100 to 100), ``min_p`` (0 to 1), ``min_tokens``
(at most the request's max tokens) and ``stop_token_ids`` (at most 64);
``response_format`` (response_format.py); chat's ``tools``, ``tool_choice``
and ``parallel_tool_calls`` (tools.py), and messages' ``tool_calls`` and
``tool_call_id``; the Slipstream extensions ``priority``,
``deadline_ms``, ``expected_output_tokens``, ``top_k`` and ``ignore_eos``.
Anything else that would change the answer (``echo``, ``suffix``,
``best_of`` > 1,
...; in chat, any ``echo``, ``suffix`` or ``best_of``,
which are completions' alone) is refused with a 400 naming the field: this
engine does not implement it, and ignoring it would silently change the
request's meaning. A field set to ``null`` is absent, as on OpenAI's API
(in a message, so is an empty list such as ``tool_calls: []``): a message
the SDK returned can be sent back as ``message.model_dump()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from slipstream.scheduler.errors import PromptTooLong
from slipstream.scheduler.request import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)
from slipstream.service.api.http.errors import ApiError, from_domain, invalid, valid_unicode
from slipstream.service.api.http.response_format import set_response_format
from slipstream.service.api.http.tools import FIELDS as TOOL_FIELDS
from slipstream.service.api.http.tools import (
    Tools,
    message_tool_calls,
    parse_tools,
    set_tool_constraint,
)
from slipstream.service.engine.chat import ChatMessage, ToolCall
from slipstream.v1 import inference_pb2 as pb

# OpenAI's documented defaults where they differ from the gRPC API's.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0  # OpenAI's bound: the SDK's callers expect a 400 past it
MAX_INT32 = 2**31 - 1
MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1
HEADER_PRIORITY = "x-slipstream-priority"
HEADER_DEADLINE_MS = "x-slipstream-deadline-ms"
HEADER_EXPECTED_OUTPUT_TOKENS = "x-slipstream-expected-output-tokens"
TRACE_HEADERS = ("traceparent", "tracestate")

_COMMON = frozenset(
    {
        "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed",
        "stop", "n", "user", "priority", "deadline_ms", "expected_output_tokens", "top_k",
        "ignore_eos", "logprobs", "response_format", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "min_p", "min_tokens", "stop_token_ids",
    }
)  # fmt: skip
# Accepted only at the value that means "off" (or null, as any field). Chat
# has no echo, suffix or best_of: OpenAI's SDK never sends them there.
_COMPLETION_OFF_VALUES: dict[str, tuple[object, ...]] = {
    "echo": (False,),
    "suffix": (),
    "best_of": (1,),
}
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"} | TOOL_FIELDS

Prompt = str | list[int] | list[ChatMessage]
_T = TypeVar("_T", int, float)


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One parsed request. ``prompts`` are text or token ids (completions,
    one or more) or messages (chat, one); ``submit`` has every field but
    the prompt. It asks for ``n`` choices of each prompt; ``tools``: the
    functions a chat request offers, and what it asks of them."""

    is_chat: bool
    model: str
    prompts: list[Prompt]
    submit: pb.Submit
    is_stream: bool
    include_usage: bool
    n: int = 1
    tools: Tools | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def parse(
    body: object,
    headers: Mapping[str, str],
    is_chat: bool,
    max_model_len: int = MAX_UINT32,
    max_choices: int = MAX_UINT32,
) -> OpenAIRequest:
    """Raises ``ApiError`` (400) naming the first field that is wrong.
    ``max_model_len``: the served model's context, the most tokens a
    request may ask for (in the field it used: ``max_tokens`` or
    ``max_completion_tokens``); ``max_choices``: the most prompts times
    ``n`` it may ask for."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    if is_chat:
        _check_fields(body, CHAT_FIELDS, {})
    else:
        _check_fields(body, COMPLETION_FIELDS, _COMPLETION_OFF_VALUES)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (a string; see GET /v1/models)", "model")
    valid_unicode(model, "model", "model")
    n = _int(body, "n", 1, max_choices) or 1  # this server's bound, in its message
    _optional(body, "user", str)
    is_stream = bool(_optional(body, "stream", bool))
    include_usage = _stream_options(body, is_stream)
    submit = pb.Submit()
    # Before the prompt: a token-id prompt's refusal names its max_tokens.
    _stopping(body, submit.stopping, is_chat, max_model_len)
    tools = None
    if is_chat:
        _check_choices(1, n, max_choices)
        prompts: list[Prompt] = [_messages(body)]
        tools = parse_tools(body)
    else:
        prompts = _prompts(body, n, max_choices, max_model_len, submit.stopping.max_new_tokens)
    priority = _controls_int(body, headers, "priority", HEADER_PRIORITY, MAX_INT32)
    if priority is not None:
        submit.priority = priority
    _sampling(body, submit.sampling)
    _logprobs(body, submit, is_chat)
    set_response_format(body, submit)
    set_tool_constraint(tools, body, submit)
    deadline_ms = _deadline_ms(body, headers)
    if deadline_ms is not None:
        submit.timeout.FromNanoseconds(round(deadline_ms * 1e6))
    expected = _controls_int(
        body, headers, "expected_output_tokens", HEADER_EXPECTED_OUTPUT_TOKENS, MAX_UINT32
    )
    if expected is not None:
        submit.expected_output_tokens = expected
    for name, value in caller_trace_context(headers).items():
        # Bytes that are not UTF-8 arrive as lone surrogates.
        submit.trace_context[name] = valid_unicode(value, name, name)
    return OpenAIRequest(is_chat, model, prompts, submit, is_stream, include_usage, n, tools)


def caller_trace_context(headers: Mapping[str, str]) -> dict[str, str]:
    """The caller's W3C trace headers as they came, for a request refused
    before its body parsed: its refusal still joins the caller's trace."""
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


def _check_fields(
    body: dict[str, object], known: frozenset[str], off_values: dict[str, tuple[object, ...]]
) -> None:
    for name, value in body.items():
        if name in known or value is None:  # null is absent, as on OpenAI's API
            continue
        if name in off_values:
            if value not in off_values[name]:
                raise invalid(f"{name} is not supported by this server", name)
            continue
        raise invalid(f"unsupported parameter: {name}", name)


def _optional(body: Mapping[str, object], name: str, kind: type) -> object:
    value = body.get(name)
    if value is not None and not (isinstance(value, kind) and _not_bool_for_number(value, kind)):
        raise invalid(f"{name} must be {_KIND_NAMES.get(kind, kind.__name__)}", name)
    if isinstance(value, str):
        valid_unicode(value, name, name)
    return value


_KIND_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}


def _not_bool_for_number(value: object, kind: type) -> bool:
    return kind is bool or not isinstance(value, bool)


def _int(body: Mapping[str, object], name: str, low: int, high: int) -> int | None:
    value = _optional(body, name, int)
    if value is not None and not low <= value <= high:  # type: ignore[operator]
        raise invalid(f"{name} must be in [{low}, {high}], got {value}", name)
    return value  # type: ignore[return-value]


def _number(body: Mapping[str, object], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"{name} must be a number", name)
    if not math.isfinite(value):
        raise invalid(f"{name} must be finite", name)
    return float(value)


def _stream_options(body: Mapping[str, object], is_stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not is_stream:
        raise invalid("stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid("stream_options takes only include_usage", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise invalid("stream_options.include_usage must be a boolean", "stream_options")
    return include


def _prompts(
    body: Mapping[str, object], n: int, max_choices: int, max_model_len: int, max_new: int
) -> list[str | list[int]]:
    """``prompt``: one prompt, or a list of them (strings or token-id lists).
    Counts and lengths are checked before any element is: a body of
    millions of ids is refused in microseconds, not read id by id."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        _check_choices(len(prompt), n, max_choices)
        if len(prompt) == 1:
            return [_prompt(prompt[0], "prompt", max_model_len, max_new)]
        return [
            _prompt(one, f"prompt[{i}]", max_model_len, max_new) for i, one in enumerate(prompt)
        ]
    _check_choices(1, n, max_choices)
    return [_prompt(prompt, "prompt", max_model_len, max_new)]


def _prompt(prompt: object, name: str, max_model_len: int, max_new: int) -> str | list[int]:
    """One prompt; ``name`` says where it is in the request."""
    if isinstance(prompt, str):
        if not prompt:
            raise invalid(f"{name} is empty", "prompt")
        return valid_unicode(prompt, name, "prompt")
    if isinstance(prompt, list) and prompt:
        if len(prompt) > max_model_len:  # as the gRPC front's check (wire._prompt_ids)
            raise _over_context(PromptTooLong.over_context(len(prompt), max_new, max_model_len))
        # the wire's uint32 (the model's vocabulary is checked later)
        ids_ok = (
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_UINT32 for t in prompt
        )
        if not all(ids_ok):
            message = f"a token-id {name} must be a list of integers in [0, 2**32)"
            raise invalid(message, "prompt")
        return prompt
    raise invalid(f"{name} must be a non-empty string or list of token ids", "prompt")


def _over_context(exc: PromptTooLong) -> ApiError:
    """The answer (and the recorded refusal) a prompt over the context gets later."""
    error = from_domain(exc, "prompt")
    assert error is not None  # PromptTooLong is mapped
    return error


def _check_choices(num_prompts: int, n: int, max_choices: int) -> None:
    """Each prompt's ``n`` choices are an engine request each: at most
    ``max_choices`` in all, the one at fault named."""
    if num_prompts * n > max_choices:
        message = (
            f"{num_prompts} prompts with n={n} ask for {num_prompts * n} choices, "
            f"more than the {max_choices} this server allows"
        )
        raise invalid(message, "n" if n > 1 else "prompt")


def _messages(body: Mapping[str, object]) -> list[ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object", "messages")
        # A ``name`` would be dropped by the renderer. What the SDK's own
        # message holds when unused is absent.
        extra = {
            key
            for key, value in message.items()
            if key not in _MESSAGE_KEYS and value is not None and value != []
        }
        if extra:
            raise invalid(f"{where}.{sorted(extra)[0]} is not supported", "messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid(f"{where}.role must be a string", "messages")
        valid_unicode(role, f"{where}.role", "messages")
        out.append(_message(message, role, where))
    return out


_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id"})


def _message(message: Mapping[str, object], role: str, where: str) -> ChatMessage:
    """An assistant's may hold ``tool_calls`` (its content then may be
    null), a tool result's its ``tool_call_id``."""
    calls: tuple[ToolCall, ...] = ()
    if message.get("tool_calls") not in (None, []):  # {}, 0 or "" are no list: refused
        if role != "assistant":
            refusal = f"{where}.tool_calls is only allowed in an assistant message"
            raise invalid(refusal, "messages")
        calls = message_tool_calls(message["tool_calls"], where)
        for j, call in enumerate(calls):
            for text in (call.id, call.name, call.arguments):
                valid_unicode(text, f"{where}.tool_calls[{j}]", "messages")
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if role != "tool":
            raise invalid(f"{where}.tool_call_id is only allowed in a tool message", "messages")
        if not isinstance(call_id, str):
            raise invalid(f"{where}.tool_call_id must be a string", "messages")
        valid_unicode(call_id, f"{where}.tool_call_id", "messages")
    content = message.get("content")
    text = "" if content is None and calls else _content(content, where)
    return ChatMessage(role, text, calls, call_id)


def _content(content: object, where: str) -> str:
    """Text content: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return valid_unicode(content, f"{where}.content", "messages")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise invalid(f"{where}.content: only text parts are supported", "messages")
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.content text parts need a string text", "messages")
            texts.append(text)
        return valid_unicode("".join(texts), f"{where}.content", "messages")
    raise invalid(f"{where}.content must be a string or a list of text parts", "messages")


def _sampling(body: Mapping[str, object], sampling: pb.SamplingParams) -> None:
    temperature = _number(body, "temperature")
    temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    if not 0 <= temperature <= MAX_TEMPERATURE:
        message = f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature:g}"
        raise invalid(message, "temperature")
    sampling.temperature = temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise invalid("top_p must be in (0, 1]", "top_p")
        sampling.top_p = top_p
    top_k = _int(body, "top_k", 0, MAX_UINT32)
    if top_k is not None:
        sampling.top_k = top_k
    seed = _int(body, "seed", 0, MAX_UINT64)
    if seed is not None:
        sampling.seed = seed
    min_p = _number(body, "min_p")
    if min_p is not None:
        if not 0.0 <= min_p <= 1.0:
            raise invalid(f"min_p must be in [0, 1] (0 is off), got {min_p!r}", "min_p")
        sampling.min_p = min_p
    _penalties(body, sampling)


def _penalties(body: Mapping[str, object], sampling: pb.SamplingParams) -> None:
    """OpenAI's presence and frequency penalties and logit bias, vLLM's
    repetition penalty; the bias's token ids are checked against the
    vocabulary with the prompt's (``wire``)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name)
        if value is not None:
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                message = f"{name} must be in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}"
                raise invalid(message, name)
            setattr(sampling, name, value)
    repetition = _number(body, "repetition_penalty")
    if repetition is not None:
        low, high = 1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        if not low <= repetition <= high:
            bounds = f"[{low:g}, {high:g}]"
            message = f"repetition_penalty must be in {bounds} (1 is off), got {repetition!r}"
            raise invalid(message, "repetition_penalty")
        sampling.repetition_penalty = repetition
    bias = body.get("logit_bias")
    if bias is not None:
        sampling.logit_bias.update(_logit_bias(bias))


def _logit_bias(bias: object) -> dict[int, float]:
    """OpenAI's ``logit_bias``: an object of token ids (strings of digits,
    as JSON's keys are) to biases in [-100, 100]. Two keys naming one token
    ("5" and "05") are refused: one of them would be dropped unseen."""
    if not isinstance(bias, dict):
        raise invalid("logit_bias must be an object of token ids to biases", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        message = (
            f"logit_bias has {len(bias)} tokens, more than the {MAX_LOGIT_BIAS_TOKENS} allowed"
        )
        raise invalid(message, "logit_bias")
    out = {}
    for key, value in bias.items():
        # 10 digits at most: the wire's uint32, and no int() of a huge string
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= MAX_UINT32):
            message = (
                f"logit_bias keys must be token ids (integers in [0, 2**32)), got {key[:24]!r}"
            )
            raise invalid(message, "logit_bias")
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (is_number and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):  # NaN fails too
            shown = repr(value) if is_number else type(value).__name__
            bounds = f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            message = f"logit_bias[{key!r}] must be a number in {bounds}, got {shown}"
            raise invalid(message, "logit_bias")
        token = int(key)
        if token in out:
            raise invalid(f"logit_bias names token {token} twice (as {key!r})", "logit_bias")
        out[token] = float(value)
    return out


def _logprobs(body: Mapping[str, object], submit: pb.Submit, is_chat: bool) -> None:
    """Completions' ``logprobs: k`` or chat's ``logprobs: true, top_logprobs: k``
    as the gRPC fields (``return_logprobs``, ``top_logprobs``)."""
    if is_chat:
        wanted = bool(_optional(body, "logprobs", bool))
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not wanted:  # as OpenAI's and vLLM's; 0 asks for nothing
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        if body.get("logprobs") is False:  # "off", accepted before logprobs were
            return
        top = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        wanted = top is not None
    if wanted:
        submit.return_logprobs = True
        submit.top_logprobs = top or 0


def _stopping(
    body: Mapping[str, object], stopping: pb.StoppingCriteria, is_chat: bool, longest: int
) -> None:
    max_tokens = _int(body, "max_tokens", 1, longest)
    max_name = "max_tokens"  # the body's own name for it, for min_tokens' message
    if is_chat:
        newer = _int(body, "max_completion_tokens", 1, longest)
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise invalid("max_tokens and max_completion_tokens differ", "max_completion_tokens")
        if newer is not None:
            max_tokens, max_name = newer, "max_completion_tokens"
    elif max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    # Chat without a limit: up to the context, set once the prompt's length is known.
    if max_tokens is not None:
        stopping.max_new_tokens = max_tokens
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid("stop must be a non-empty string or a list of them", "stop")
        for i, text in enumerate(stops):
            valid_unicode(text, "stop" if isinstance(stop, str) else f"stop[{i}]", "stop")
        stopping.stop_sequences.extend(stops)
    stopping.ignore_eos = bool(_optional(body, "ignore_eos", bool))
    # vLLM's; a chat without max_tokens has its bound checked once it is set.
    min_tokens = _int(body, "min_tokens", 0, longest)
    if min_tokens is not None:
        if max_tokens is not None and min_tokens > max_tokens:
            message = f"min_tokens ({min_tokens}) must be at most {max_name} ({max_tokens})"
            raise invalid(message, "min_tokens")
        stopping.min_tokens = min_tokens
    stopping.stop_token_ids.extend(_stop_token_ids(body.get("stop_token_ids")))


def _stop_token_ids(ids: object) -> list[int]:
    """vLLM's ``stop_token_ids``: a list of token ids (checked against the
    vocabulary with the prompt's, ``wire``); null or absent is none."""
    if ids is None:
        return []
    is_list = isinstance(ids, list)
    if not is_list or len(ids) > MAX_STOP_TOKEN_IDS:
        count = f"has {len(ids)}" if is_list else "is not a list"  # type: ignore[arg-type]
        message = (
            f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids ({count})"
        )
        raise invalid(message, "stop_token_ids")
    for i, value in enumerate(ids):  # type: ignore[arg-type]
        if not (
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_UINT32
        ):
            message = (
                f"stop_token_ids[{i}] must be a token id (an integer in [0, 2**32)), got {value!r}"
            )
            raise invalid(message, "stop_token_ids")
    return ids  # type: ignore[return-value]


def _deadline_ms(body: Mapping[str, object], headers: Mapping[str, str]) -> float | None:
    value = _number(body, "deadline_ms")
    name = "deadline_ms"  # where the value came from, for the range's message
    header = headers.get(HEADER_DEADLINE_MS)
    if header is not None:
        try:
            from_header = float(header)
        except ValueError:
            raise invalid(f"{HEADER_DEADLINE_MS} must be a number", HEADER_DEADLINE_MS) from None
        if not math.isfinite(from_header):
            raise invalid(f"{HEADER_DEADLINE_MS} must be finite", HEADER_DEADLINE_MS)
        value = _agree("deadline_ms", HEADER_DEADLINE_MS, value, from_header)
        name = HEADER_DEADLINE_MS
    if value is not None and not 0 <= value <= 1e13:  # ~300 years: Duration's range holds it
        raise invalid(f"{name} must be in [0, 1e13] milliseconds", name)
    return value


def _controls_int(
    body: Mapping[str, object], headers: Mapping[str, str], name: str, header: str, high: int
) -> int | None:
    value = _int(body, name, 0, high)
    raw = headers.get(header)
    if raw is None:
        return value
    try:
        from_header = int(raw)
    except ValueError:
        raise invalid(f"{header} must be an integer", header) from None
    if not 0 <= from_header <= high:
        raise invalid(f"{header} must be in [0, {high}], got {from_header}", header)
    return _agree(name, header, value, from_header)


def _agree(name: str, header: str, in_body: _T | None, in_header: _T) -> _T:
    if in_body is not None and in_body != in_header:
        raise invalid(f"{name} in the body and {header} disagree", name)
    return in_header

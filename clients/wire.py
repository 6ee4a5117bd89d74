"""What the sync and asyncio clients share: building a submit from keyword
arguments, and the chunk/result records a caller sees."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict, TypeGuard

import grpc
from google.protobuf.duration_pb2 import Duration

from slipstream.v1 import MAX_DURATION_S as MAX_DURATION_S  # exported too
from slipstream.v1 import REJECT_REASON_KEY, RETRY_AFTER_KEY
from slipstream.v1 import inference_pb2 as pb

Prompt = str | Sequence[int]
# A conversation: (role, content) pairs or {"role": ..., "content": ...} dicts.
Messages = Sequence[tuple[str, str] | Mapping[str, str]]
Metadata = Sequence[tuple[str, str]] | Mapping[str, str] | None
# A JSON Schema: its JSON text, or the schema itself (a mapping; true or
# false, the schemas that allow anything or nothing).
JsonSchema = str | Mapping[str, object] | bool

# The server's bounds on sampling's logit adjustments (inference.proto's
# SamplingParams), mirrored: they live in slipstream.scheduler.request, which
# the client does not import (it needs only the stubs and grpcio). A test
# holds the two equal.
MAX_PENALTY = 2.0  # presence and frequency penalties are in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit bias is in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one request may bias
MAX_REPETITION_PENALTY = 100.0  # a repetition penalty is in [1 / 100, 100]
MAX_STOP_TOKEN_IDS = 64  # stop token ids one request may name


def trace_context() -> dict[str, str]:
    """The active OpenTelemetry context as W3C headers (``traceparent``,
    ``tracestate``); empty when OpenTelemetry is absent or no span is active."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


# Asks a Generate call's server for Batch responses (several events in one
# message), which the readers below take apart: servers that predate them
# ignore it.
BATCH_METADATA = (("slipstream-batch", "1"),)


def unbatched(response: pb.GenerateResponse) -> Sequence[pb.GenerateResponse]:
    """The responses ``response`` stands for, in order: a Batch's, else itself."""
    if response.WhichOneof("event") == "batch":
        return response.batch.responses
    return (response,)


def call_metadata(*parts: Metadata) -> list[tuple[str, str]]:
    """gRPC call metadata: the given parts in order, then the trace context
    unless a part already set ``traceparent``."""
    merged: list[tuple[str, str]] = []
    for part in parts:
        if part:
            merged.extend(part.items() if isinstance(part, Mapping) else part)
    if not any(key == "traceparent" for key, _ in merged):
        merged.extend(trace_context().items())
    return merged


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat prompt: the server renders it with the model's chat template."""

    messages: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, messages: Messages) -> Conversation:
        """Raises ``ValueError`` for an item that is neither a pair nor a
        role/content mapping (the server checks roles and templates)."""
        pairs = []
        for i, message in enumerate(messages):
            if isinstance(message, Mapping):
                if set(message) != {"role", "content"}:
                    raise ValueError(f"messages[{i}] must have exactly 'role' and 'content'")
                role, content = message["role"], message["content"]
            elif isinstance(message, tuple | list) and len(message) == 2:
                role, content = message
            else:
                raise ValueError(f"messages[{i}] is not a (role, content) pair or mapping")
            if not (isinstance(role, str) and isinstance(content, str)):
                raise ValueError(f"messages[{i}]: role and content must be strings")
            pairs.append((role, content))
        return cls(tuple(pairs))


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """Keyword arguments of ``generate``; ``deadline_s`` (the whole response)
    and ``first_token_timeout_s`` (the first token) are relative to the
    moment the server receives the submit."""

    max_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = ()  # a str is one stop sequence, None none (OpenAI's)
    ignore_eos: bool = False
    priority: int | None = None  # unset: the server's default (see inference.proto)
    deadline_s: float | None = None
    expected_tokens: int | None = None
    first_token_timeout_s: float | None = None
    logprobs: bool = False  # each token's log-probability (Chunk.logprobs, Result.logprobs)
    top_logprobs: int = 0  # with logprobs: this many likeliest tokens at each position (<= 20)
    # Logit adjustments, made before temperature, top-k and top-p (greedy too).
    presence_penalty: float = 0.0  # in [-2, 2], 0 off: once per token generated so far
    frequency_penalty: float = 0.0  # in [-2, 2], 0 off: per time a token was generated
    repetition_penalty: float | None = None  # in [0.01, 100]; unset: the server's 1 (off)
    logit_bias: Mapping[int, float] | None = None  # token id -> bias in [-100, 100]
    # vLLM's: min_p in [0, 1] (0 off) keeps the tokens at least that likely
    # relative to the likeliest, after temperature, before top-k and top-p;
    # the first min_tokens (<= max_tokens) outputs can be neither EOS nor a
    # stop token id; sampling one of stop_token_ids ends the request ("stop").
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    # Structured output, at most one: what the whole output must match.
    json_schema: JsonSchema | None = None  # a JSON Schema: a dict, or its JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # a regular expression (Rust regex syntax)


class Options(TypedDict, total=False):
    """``generate``'s keyword arguments, for type checkers: ``**options:
    Unpack[Options]`` lets mypy catch ``max_token=8`` or ``max_tokens="8"``.
    The same names and types as ``GenerateOptions``' fields."""

    max_tokens: int | None
    temperature: float
    top_k: int
    top_p: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    ignore_eos: bool
    priority: int | None
    deadline_s: float | None
    expected_tokens: int | None
    first_token_timeout_s: float | None
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float | None
    logit_bias: Mapping[int, float] | None
    min_p: float
    min_tokens: int
    stop_token_ids: Sequence[int]
    json_schema: JsonSchema | None
    json_object: bool
    regex: str | None


# Integer keyword arguments: (name, smallest, largest value of their wire field).
_INTEGERS = (
    ("max_tokens", 0, 2**32 - 1),
    ("min_tokens", 0, 2**32 - 1),
    ("expected_tokens", 0, 2**32 - 1),
    ("top_k", 0, 2**32 - 1),
    ("seed", 0, 2**64 - 1),
    ("top_logprobs", 0, 2**32 - 1),
    ("priority", -(2**31), 2**31 - 1),
)
# Duration keyword arguments; MAX_DURATION_S (the wire's) bounds them.
_DURATIONS = ("deadline_s", "first_token_timeout_s")
# gRPC keeps a call's deadline as int64 nanoseconds since the epoch: a longer
# timeout overflowed into one that had already passed. A century is plenty.
_MAX_CALL_TIMEOUT_S = 100 * 365 * 86_400


def _check_integers(options: GenerateOptions) -> None:
    """A count past its field raises naming the argument (protobuf's own
    error names none: "Value out of range: -1")."""
    for name, smallest, largest in _INTEGERS:
        value = getattr(options, name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if not smallest <= value <= largest:
            raise ValueError(f"{name} must be in [{smallest}, {largest}], got {value}")


def check_seconds(name: str, value: object, largest: float) -> None:
    """A duration in seconds that is not a finite number within
    ``±largest`` raises naming the argument."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and -largest <= value <= largest):
        raise ValueError(f"{name} must be a finite number of seconds up to {largest}, got {value}")


def check_call_timeout(timeout: float | None) -> None:
    """A gRPC call's ``timeout`` gRPC can keep (else it has passed at once)."""
    if timeout is not None:
        check_seconds("timeout", timeout, _MAX_CALL_TIMEOUT_S)


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, bytes | bytearray):
        raise TypeError("prompt must be a str or a sequence of token ids, not bytes: decode it")
    if not isinstance(prompt, Sequence):
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {prompt!r}")


def is_token_id(value: object) -> bool:
    """Whether ``value`` is a token id the wire carries (an int in uint32's
    range; the model's vocabulary is the server's to check)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _check_token_ids(token_ids: Sequence[int]) -> None:
    """A token id the wire cannot carry raises naming its place in the
    prompt, as ``_check_integers`` does for the counts."""
    for i, token_id in enumerate(token_ids):
        if not is_token_id(token_id):
            raise ValueError(f"prompt[{i}] must be a token id in [0, 2**32), got {token_id}")


def _stop_sequences(stop: object) -> list[str]:
    """``stop`` as a list: a str is one stop sequence, None none (as in
    OpenAI's API); anything but strs raises naming the argument."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or isinstance(stops, bytes | bytearray):
        raise TypeError(f"stop must be a str or a sequence of str, got {stop!r}")
    for i, value in enumerate(stops):
        if not isinstance(value, str):
            raise TypeError(f"stop[{i}] must be a str, got {value!r}")
    return list(stops)


def _sampling(options: GenerateOptions) -> pb.SamplingParams:
    """The submit's ``sampling``, its logit adjustments and min-p checked first."""
    check_penalty("presence_penalty", options.presence_penalty)
    check_penalty("frequency_penalty", options.frequency_penalty)
    if options.repetition_penalty is not None:
        check_repetition_penalty(options.repetition_penalty)
    check_min_p(options.min_p)
    return pb.SamplingParams(
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,  # None leaves it unset
        seed=options.seed,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,  # None leaves it unset
        logit_bias=check_logit_bias(options.logit_bias),
        min_p=options.min_p or None,  # 0 leaves it unset
    )


def check_min_p(value: object) -> None:
    """A min-p that is not a number in [0, 1] raises (the server's bound)."""
    if not _is_number(value):
        raise TypeError(f"min_p must be a number, got {value!r}")
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(f"min_p must be in [0, 1] (0 is off), got {value}")


def check_min_tokens(min_tokens: int, max_tokens: int | None) -> None:
    """``min_tokens`` above ``max_tokens`` raises (unset: the server's
    default, which it checks)."""
    if max_tokens is not None and min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})")


def check_stop_token_ids(ids: object) -> list[int]:
    """``stop_token_ids`` as a list: at most ``MAX_STOP_TOKEN_IDS`` token ids
    (the vocabulary is the server's to check)."""
    if not isinstance(ids, Sequence) or isinstance(ids, str | bytes | bytearray):
        raise TypeError(f"stop_token_ids must be a sequence of token ids, got {ids!r}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(
            f"stop_token_ids has {len(ids)} ids, more than the {MAX_STOP_TOKEN_IDS} allowed"
        )
    for i, token_id in enumerate(ids):
        if not is_token_id(token_id):
            raise ValueError(
                f"stop_token_ids[{i}] must be a token id in [0, 2**32), got {token_id}"
            )
    return list(ids)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_penalty(name: str, value: object) -> None:
    """A presence or frequency penalty (``name``) that is not a number in
    [-2, 2] raises naming it (NaN is not in it)."""
    if not _is_number(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not -MAX_PENALTY <= value <= MAX_PENALTY:
        raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")


def check_repetition_penalty(value: object) -> None:
    """A repetition penalty outside [1 / 100, 100] raises (the server's
    bounds: past them a logit may become infinite)."""
    if not _is_number(value):
        raise TypeError(f"repetition_penalty must be a number, got {value!r}")
    low, high = 1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY
    if not low <= value <= high:  # NaN included
        bounds = f"[{low:g}, {high:g}]"
        raise ValueError(f"repetition_penalty must be in {bounds} (1 is off), got {value}")


def check_logit_bias(bias: object) -> dict[int, float]:
    """``logit_bias`` as the wire's map (None: empty): a mapping of token
    ids (ints) to numbers, else ``TypeError``; more than 1024 tokens, an id
    the wire cannot carry or a bias outside [-100, 100] raise ``ValueError``
    naming the token. The server checks the ids against its vocabulary."""
    if bias is None:
        return {}
    if not isinstance(bias, Mapping):
        raise TypeError(f"logit_bias must be a dict of token ids to biases, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(
            f"logit_bias has {len(bias)} tokens, more than the {MAX_LOGIT_BIAS_TOKENS} allowed"
        )
    for token_id, value in bias.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise TypeError(f"logit_bias keys must be token ids (ints), got {token_id!r}")
        if not is_token_id(token_id):
            raise ValueError(f"logit_bias: {token_id} is not a token id in [0, 2**32)")
        if not _is_number(value):
            raise TypeError(f"logit_bias[{token_id}] must be a number, got {value!r}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN fails too
            raise ValueError(
                f"logit_bias[{token_id}] must be in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}"
            )
    return dict(bias)


def _constraint(options: GenerateOptions) -> pb.OutputConstraint | None:
    """The submit's ``constraint``, or None for none. Two kinds at once, or
    a schema that is not JSON, raise ``ValueError`` naming the argument; the
    server compiles it and refuses what does not (INVALID_ARGUMENT)."""
    schema, json_object, regex = options.json_schema, options.json_object, options.regex
    if not isinstance(json_object, bool):
        raise TypeError(f"json_object must be a bool, got {json_object!r}")
    given = [
        name
        for name, value in (("json_schema", schema), ("json_object", json_object), ("regex", regex))
        if value is not None and value is not False
    ]
    if len(given) > 1:
        both = " and ".join(given)
        raise ValueError(f"give at most one of json_schema, json_object and regex, not {both}")
    if json_object:
        return pb.OutputConstraint(json_object=True)
    if regex is not None:
        if not isinstance(regex, str):
            raise TypeError(f"regex must be a str, got {regex!r}")
        if not regex:
            raise ValueError("regex is empty (leave it None for no constraint)")
        return pb.OutputConstraint(regex=regex)
    if schema is None:
        return None
    return pb.OutputConstraint(json_schema=_schema_text(schema))


def _schema_text(schema: object) -> str:
    """``json_schema`` as the JSON text the wire carries: a str must parse as
    JSON; a mapping or bool is serialised (NaN and infinities are not JSON)."""
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except RecursionError:  # nested deeper than Python's stack
            raise ValueError("json_schema is nested too deeply") from None
        except ValueError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        return schema
    if not isinstance(schema, Mapping | bool):
        raise TypeError(f"json_schema must be a dict, a bool or JSON text, got {schema!r}")
    try:
        return json.dumps(schema, allow_nan=False)
    except RecursionError:
        raise ValueError("json_schema is nested too deeply") from None
    except (TypeError, ValueError) as exc:  # a set, bytes, a cycle, NaN...
        raise ValueError(f"json_schema is not JSON-serialisable: {exc}") from None


def build_submit(
    request_id: str, prompt: Prompt | Conversation, options: GenerateOptions
) -> pb.GenerateRequest:
    _check_integers(options)
    check_min_tokens(options.min_tokens, options.max_tokens)
    for name in _DURATIONS:
        if getattr(options, name) is not None:
            check_seconds(name, getattr(options, name), MAX_DURATION_S)
    submit = pb.Submit(
        request_id=request_id,
        priority=options.priority,  # None leaves it unset
        sampling=_sampling(options),
        stopping=pb.StoppingCriteria(
            max_new_tokens=options.max_tokens,
            stop_sequences=_stop_sequences(options.stop),
            ignore_eos=options.ignore_eos,
            min_tokens=options.min_tokens,
            stop_token_ids=check_stop_token_ids(options.stop_token_ids),
        ),
        expected_output_tokens=options.expected_tokens,
        trace_context=trace_context(),
        return_logprobs=options.logprobs,
        top_logprobs=options.top_logprobs,
        constraint=_constraint(options),  # None leaves it unset
    )
    if isinstance(prompt, Conversation):
        submit.messages.SetInParent()  # selects the oneof even for an empty conversation
        submit.messages.messages.extend(
            pb.ChatMessage(role=role, content=content) for role, content in prompt.messages
        )
    elif isinstance(prompt, str):
        submit.text = prompt
    else:
        _check_prompt(prompt)
        _check_token_ids(prompt)
        submit.token_ids.ids.extend(prompt)
    if options.deadline_s is not None:
        submit.timeout.CopyFrom(_duration(options.deadline_s))
    if options.first_token_timeout_s is not None:
        submit.first_token_timeout.CopyFrom(_duration(options.first_token_timeout_s))
    return pb.GenerateRequest(submit=submit)


def build_one(
    request_id: str, prompt: Prompt | Conversation, options: GenerateOptions
) -> pb.Submit:
    """The ``Submit`` of a ``GenerateOne`` call."""
    return build_submit(request_id, prompt, options).submit


def _duration(seconds: float) -> Duration:
    duration = Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def cancel_message(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(cancel=pb.Cancel(request_id=request_id))


def finish_reason_name(wire_reason: int) -> str:
    """``FINISH_REASON_MAX_TOKENS`` -> ``"max_tokens"`` (the CLI's spelling)."""
    return pb.FinishReason.Name(wire_reason).removeprefix("FINISH_REASON_").lower()


def reject_reason_name(wire_reason: int) -> str | None:
    if wire_reason == pb.REJECT_REASON_UNSPECIFIED:
        return None
    return pb.RejectReason.Name(wire_reason).removeprefix("REJECT_REASON_").lower()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """An output token's log-probability under the model (before temperature,
    top-k and top-p), and, if asked for, the likeliest tokens at its position
    as ``(token_id, logprob)`` pairs, likeliest first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one request from one engine step; ``logprobs``, one per
    token id, where the request asked for them. The last chunk may carry
    text and no ids: the tail held back while it could still become a stop
    sequence, so the chunks' texts join into ``Result.text``."""

    request_id: str
    token_ids: list[int]
    text: str
    index: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


def _token_logprobs(chunk: pb.TokenChunk) -> list[TokenLogprob]:
    tops = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in chunk.top_logprobs]
    return [
        TokenLogprob(token_id, logprob, tops[i] if i < len(tops) else [])
        for i, (token_id, logprob) in enumerate(zip(chunk.token_ids, chunk.logprobs, strict=False))
    ]


@dataclass(frozen=True, slots=True)
class Result:
    """A request's outcome. ``text`` is the whole output (chunks + held-back tail).

    A ``generate_one`` call cancelled by its caller or past its gRPC deadline
    gets no ``Finished``: its result is built by the client from what it
    saw (``Accumulator``): ``prompt_tokens`` as the server's ``Accepted``
    counted them (0 when the call ended before the request was accepted,
    as for any request the server never admitted), the tokens and times
    received; ``cached_tokens``, ``queue_wait_s``, ``preemptions`` and
    ``held_back_steps``, which only the server knows, are 0 then."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    reject_reason: str | None = None
    status_code: str = "OK"
    message: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    queue_wait_s: float = 0.0
    ttft_s: float | None = None
    total_s: float = 0.0
    queue_position: int | None = None
    retry_after_s: float | None = None  # a rejection's hint: a retry may succeed after this
    preemptions: int = 0
    # Steps the scheduler kept it out of the batch for more urgent work.
    held_back_steps: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, if asked

    @property
    def is_ok(self) -> bool:
        return self.status_code == "OK"


def is_past_deadline(error: grpc.RpcError) -> bool:
    """Whether a ``GenerateOne`` call ended because its gRPC deadline passed
    (a rejection for an infeasible deadline names its reason: not this)."""
    trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    is_deadline = error.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    return is_deadline and REJECT_REASON_KEY not in trailers


def call_outcome(request_id: str, error: grpc.RpcError) -> Result | StreamError:
    """What a ``GenerateOne`` call that ended with ``error`` means for its
    request: a rejection (the server named its reason) is an ordinary
    ``Result``, as on ``Generate``; anything else is a ``StreamError``."""
    code = error.code()  # type: ignore[attr-defined]
    details = error.details() or ""  # type: ignore[attr-defined]
    trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    reason = trailers.get(REJECT_REASON_KEY)
    if reason is None:
        return stream_error(error)
    return Result(
        request_id=request_id,
        token_ids=[],
        text="",
        finish_reason="rejected",
        reject_reason=str(reason),
        status_code=code.name,
        message=details,
        retry_after_s=_retry_after_s(trailers.get(RETRY_AFTER_KEY)),
    )


def stream_error(error: grpc.RpcError) -> StreamError:
    """A failed call as the ``StreamError`` of its unfinished requests."""
    code = error.code()  # type: ignore[attr-defined]
    details = error.details() or ""  # type: ignore[attr-defined]
    if code is grpc.StatusCode.UNKNOWN and details.startswith("Stream removed"):
        # The HTTP/2 stream ended with no gRPC status: the replica (or the
        # proxy's connection to it) went away mid-call. Say so as gRPC does
        # for a lost connection, so callers handle it like any other.
        return StreamError("UNAVAILABLE", f"the connection to the server was lost ({details})")
    return StreamError(code.name, details)


def _retry_after_s(value: str | bytes | None) -> float | None:
    """A ``slipstream-retry-after-ms`` trailer in seconds; None when absent
    or not a positive number of milliseconds."""
    try:
        ms = int(value) if value is not None else 0
    except ValueError:
        return None
    return ms / 1000 if ms > 0 else None


# The details of the StreamError of a request cut off by its client's close().
CLIENT_CLOSED = "the client was closed before the request finished"


class StreamError(Exception):
    """The stream ended before this request finished (a whole-call error)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


@dataclass(slots=True)
class Accumulator:
    """Collects one request's events into its ``Result`` (not thread-safe:
    fed by a single reader). Created as its request is sent: the monotonic
    times it keeps time ``cancelled_by_caller``'s result."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    queue_position: int | None = None
    prompt_tokens: int = 0  # as the server counted them in Accepted
    started_at: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None

    def accept(self, accepted: pb.Accepted) -> None:
        self.queue_position = accepted.queue_position
        self.prompt_tokens = accepted.num_prompt_tokens

    def add_chunk(self, chunk: pb.TokenChunk) -> Chunk:
        if self.first_chunk_at is None:
            self.first_chunk_at = time.monotonic()
        ids = list(chunk.token_ids)
        self.token_ids.extend(ids)
        self.text.append(chunk.text)
        logprobs = _token_logprobs(chunk)
        self.logprobs.extend(logprobs)
        return Chunk(self.request_id, ids, chunk.text, chunk.index, logprobs)

    def tail_chunk(self, done: pb.Finished) -> Chunk | None:
        """The text that comes only with ``done`` (held back for stop
        sequences) as a chunk of no ids, or None when there is none."""
        if not done.text:
            return None
        return Chunk(self.request_id, [], done.text, len(self.token_ids))

    def cancelled_by_caller(self) -> Result:
        """How a ``GenerateOne`` call the caller cancelled ends for its
        request: CANCELLED, as a cancel on a stream ends."""
        return self._ended_by_call(pb.FINISH_REASON_CANCELLED, "cancelled by the caller")

    def deadline_passed(self) -> Result:
        """How a ``GenerateOne`` call whose gRPC deadline passed ends for its
        request: DEADLINE_EXCEEDED, as the server's own expiry of it ends
        (whichever side saw the deadline first)."""
        return self._ended_by_call(pb.FINISH_REASON_DEADLINE_EXCEEDED, "deadline exceeded")

    def _ended_by_call(self, reason: pb.FinishReason, message: str) -> Result:
        """No ``Finished`` comes, so usage and timings are what this client
        saw: the prompt's tokens as Accepted counted them, the tokens
        received, the time to the first of them and the time until now."""
        status_code = pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_")
        done = pb.Finished(reason=reason, status_code=status_code, message=message)
        done.usage.prompt_tokens = self.prompt_tokens
        done.usage.output_tokens = len(self.token_ids)
        if self.first_chunk_at is not None:
            done.timings.time_to_first_token.CopyFrom(
                _duration(self.first_chunk_at - self.started_at)
            )
        done.timings.total.CopyFrom(_duration(time.monotonic() - self.started_at))
        return self.finish(done)

    def ends_request(self, done: pb.Finished) -> bool:
        """False for the rejection of a second submit under the id of this
        request once it is accepted: that answers the other submit, and this
        request goes on (inference.proto, ``Submit.request_id``)."""
        is_accepted = self.queue_position is not None  # set by Accepted
        return not (is_accepted and done.reject_reason == pb.REJECT_REASON_DUPLICATE_REQUEST_ID)

    def finish(self, done: pb.Finished) -> Result:
        self.text.append(done.text)
        timings = done.timings
        ttft = timings.time_to_first_token if timings.HasField("time_to_first_token") else None
        return Result(
            request_id=self.request_id,
            token_ids=self.token_ids,
            text="".join(self.text),
            finish_reason=finish_reason_name(done.reason),
            reject_reason=reject_reason_name(done.reject_reason),
            status_code=done.status_code or "OK",
            message=done.message,
            prompt_tokens=done.usage.prompt_tokens,
            output_tokens=done.usage.output_tokens,
            cached_tokens=done.usage.cached_tokens,
            queue_wait_s=timings.queue_wait.ToNanoseconds() / 1e9,
            ttft_s=None if ttft is None else ttft.ToNanoseconds() / 1e9,
            total_s=timings.total.ToNanoseconds() / 1e9,
            queue_position=self.queue_position,
            retry_after_s=done.retry_after_ms / 1000 if done.retry_after_ms else None,
            preemptions=done.usage.preemptions,
            held_back_steps=done.usage.held_back_steps,
            logprobs=self.logprobs,
        )

"""Conversions between the wire (``slipstream.v1`` protos) and the engine's
domain objects. Pure functions: no engine, no event loop.

A submit that the wire layer itself finds malformed raises ``ValueError``
(``ChatError``, a ``ValueError``, for a conversation that cannot be rendered);
the engine raises the rest (domain errors) when it is submitted.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from slipstream.scheduler.admission import adjustment_problem
from slipstream.scheduler.errors import (
    AtCapacity,
    DeadlineInfeasible,
    InvalidRequest,
    PromptTooLong,
)
from slipstream.scheduler.request import (
    MAX_TOP_LOGPROBS,
    ConstraintKind,
    ExpiredLimit,
    FinishReason,
    OutputConstraint,
    SamplingParams,
)
from slipstream.service.api.auth import QuotaExceeded
from slipstream.service.api.limits import Limits, OverLimit
from slipstream.service.api.status import rejection_for_cause, wire_finish
from slipstream.service.engine.chat import render_chat
from slipstream.service.engine.encoding import token_ids
from slipstream.service.engine.events import (
    EngineStats,
    FinishEvent,
    ModelInfo,
    RequestSpec,
    TokenEvent,
)
from slipstream.v1 import MAX_DURATION_S
from slipstream.v1 import inference_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 64
MAX_REQUEST_ID_BYTES = Limits().max_request_id_bytes  # echoed in every event of the request
# (lowest seconds, highest seconds, lowest nanos) that google.protobuf.Duration
# (±10,000 years) and Timestamp (years 1-9999) define.
DURATION_RANGE = (-MAX_DURATION_S, MAX_DURATION_S, -999_999_999)
TIMESTAMP_RANGE = (-62_135_596_800, 253_402_300_799, 0)


def encode_prompt(tokenizer: object, text: str) -> list[int]:
    """Token ids of a text prompt as ``AutoTokenizer`` gives them by default
    (special tokens added); ``slipstream generate --local`` uses the same."""
    return token_ids(tokenizer, text)


def _reject_unknown_fields(message: Message, where: str) -> None:
    # A field this server does not know (a newer client) would otherwise be
    # silently ignored and change the request's meaning without a word. Nested
    # messages (token ids, timeout, deadline, ...) are checked too.
    if len(UnknownFieldSet(message)):
        raise ValueError(f"{where} has fields this server does not understand")
    for field, value in message.ListFields():
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for item in value if field.is_repeated else (value,):
                _reject_unknown_fields(item, f"{where}.{field.name}")


def check_request_id(request_id: str, max_bytes: int = MAX_REQUEST_ID_BYTES) -> None:
    """Raises ValueError for an empty id or one over ``max_bytes``."""
    if not request_id:
        raise ValueError("request_id is empty")
    if len(request_id) > max_bytes or len(request_id.encode()) > max_bytes:
        raise ValueError(f"request_id is longer than {max_bytes} bytes")


class BadFrame:
    """A frame that does not parse as its method's request message; the
    handler ends only that stream (or call), INVALID_ARGUMENT, with ``reason``."""

    __slots__ = ("num_bytes", "reason")

    def __init__(self, reason: str, num_bytes: int) -> None:
        self.reason = reason
        self.num_bytes = num_bytes


def parse_generate_request(data: bytes) -> pb.GenerateRequest | BadFrame:
    """gRPC's request deserializer for ``Generate``: never raises, so a bad
    frame reaches the handler as a value rather than as an exception inside
    gRPC's receive loop (which ends the call UNKNOWN and logs a traceback)."""
    return _parse(pb.GenerateRequest, data)


def parse_submit(data: bytes) -> pb.Submit | BadFrame:
    """``GenerateOne``'s request deserializer, as ``parse_generate_request``."""
    return _parse(pb.Submit, data)


def _parse(message_type: type[Any], data: bytes) -> Any:
    try:
        return message_type.FromString(data)
    except DecodeError as exc:
        detail = str(exc).rstrip(".") or "malformed protobuf"
        return BadFrame(f"{detail} (not valid protobuf, or a string that is not UTF-8)", len(data))


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def prompt_bytes(submit: pb.Submit) -> int:
    """How much text the prompt conversion will read (0 for token ids)."""
    kind = submit.WhichOneof("prompt")
    if kind == "text":
        return utf8_len(submit.text)
    if kind == "messages":
        return sum(utf8_len(m.role) + utf8_len(m.content) for m in submit.messages.messages)
    return 0


def check_limits(request: pb.GenerateRequest, submit: pb.Submit, limits: Limits) -> None:
    """Size limits of ``limits``, checked on the cheap fields before any
    tokenizing; raises ValueError (``OverLimit`` for a limit) naming it."""
    if len(UnknownFieldSet(request)):
        raise ValueError("the GenerateRequest has fields this server does not understand")
    check_sizes(submit, prompt_bytes(submit), limits)
    if any(not s for s in submit.stopping.stop_sequences):
        raise ValueError("stop sequences must be non-empty")


def check_sizes(submit: pb.Submit, num_prompt_bytes: int, limits: Limits) -> None:
    """``OverLimit`` naming the first limit of ``limits`` the submit is over;
    its prompt is ``num_prompt_bytes`` of text (passed in: the HTTP front
    holds its prompt beside the submit until it is tokenized)."""
    if num_prompt_bytes > limits.max_prompt_bytes:
        raise OverLimit(
            f"prompt is {num_prompt_bytes} bytes, over this server's limit of "
            f"{limits.max_prompt_bytes}",
            "prompt",
        )
    stops = submit.stopping.stop_sequences
    if len(stops) > limits.max_stop_sequences:
        raise OverLimit(
            f"{len(stops)} stop sequences, over this server's limit of {limits.max_stop_sequences}",
            "stop_sequences",
        )
    if any(utf8_len(s) > limits.max_stop_sequence_bytes for s in stops):
        raise OverLimit(
            f"a stop sequence is longer than {limits.max_stop_sequence_bytes} bytes",
            "stop_sequences",
        )
    trace = submit.trace_context
    if len(trace) > limits.max_trace_context_entries:
        raise OverLimit(
            f"trace_context has {len(trace)} entries, over {limits.max_trace_context_entries}",
            "trace_context",
        )
    if sum(utf8_len(k) + utf8_len(v) for k, v in trace.items()) > limits.max_trace_context_bytes:
        raise OverLimit(
            f"trace_context is longer than {limits.max_trace_context_bytes} bytes", "trace_context"
        )
    constraint = submit.constraint
    num_bytes = utf8_len(constraint.json_schema) + utf8_len(constraint.regex)  # one is set
    if num_bytes > limits.max_constraint_bytes:
        raise OverLimit(
            f"the constraint is {num_bytes} bytes, over this server's limit of "
            f"{limits.max_constraint_bytes}",
            "constraint",
        )


def _seconds(value: Message, what: str, valid: tuple[int, int, int]) -> float:
    """A Duration or Timestamp as float seconds, checked against its proto range
    (no timedelta: a huge value must be a clear error, not an OverflowError)."""
    seconds, nanos = value.seconds, value.nanos  # type: ignore[attr-defined]
    low, high, min_nanos = valid
    if not (low <= seconds <= high and min_nanos <= nanos <= 999_999_999):
        raise ValueError(f"{what} is out of range")
    # A Duration's nanos carry the sign of its seconds (a Timestamp's are never
    # negative): {seconds: 1, nanos: -5} is invalid, not 0.999999995 s.
    if min_nanos < 0 and seconds * nanos < 0:
        raise ValueError(
            f"{what} is invalid: its nanos ({nanos}) and seconds ({seconds}) differ in sign"
        )
    return seconds + nanos / 1e9


def _prompt_ids(submit: pb.Submit, tokenizer: object, info: ModelInfo) -> list[int]:
    kind = submit.WhichOneof("prompt")
    if kind == "text":
        if not submit.text:
            raise ValueError("prompt text is empty")
        return encode_prompt(tokenizer, submit.text)
    if kind == "token_ids":
        # Length first: a list no context can hold is refused before it is
        # read, as the scheduler's own check (admission.py) would.
        if len(submit.token_ids.ids) > info.max_model_len:
            stopping = submit.stopping
            max_new = (
                stopping.max_new_tokens
                if stopping.HasField("max_new_tokens")
                else DEFAULT_MAX_NEW_TOKENS
            )
            raise PromptTooLong.over_context(len(submit.token_ids.ids), max_new, info.max_model_len)
        return list(submit.token_ids.ids)  # Engine.submit checks them against the vocabulary
    if kind == "messages":
        # Rendered here, beside text tokenization, so both move together.
        messages = [(m.role, m.content) for m in submit.messages.messages]
        return render_chat(tokenizer, messages)
    raise ValueError("submit has no prompt (set text, token_ids or messages)")


def _sampling(
    submit: pb.Submit, req_id: str, vocab_size: int, max_new_tokens: int
) -> SamplingParams:
    """The sampling a submit asks for (``min_tokens`` and ``stop_token_ids``
    from its stopping criteria: the sampler masks them). Its penalties,
    bias, min-p and stop ids are checked here, before any work, by the
    scheduler's own bounds (its admission checks them again for in-process
    callers): an ``InvalidRequest`` naming the field."""
    params = submit.sampling
    stopping = submit.stopping
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if not (math.isfinite(params.temperature) and math.isfinite(top_p)):
        raise ValueError("temperature and top_p must be finite")
    sampling = SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=top_p,
        seed=params.seed if params.HasField("seed") else None,
        logprobs=_logprobs(submit),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=(
            params.repetition_penalty if params.HasField("repetition_penalty") else 1.0
        ),
        logit_bias=tuple(params.logit_bias.items()),
        min_p=params.min_p,
        min_tokens=stopping.min_tokens,
        stop_token_ids=tuple(stopping.stop_token_ids),
    )
    problem = adjustment_problem(sampling)  # the bias's count first, before any sort
    if problem is not None:
        field, detail = problem
        raise InvalidRequest(req_id, detail, field)
    if sampling.min_tokens > max_new_tokens:
        detail = (
            f"min_tokens ({sampling.min_tokens}) must be at most max_new_tokens ({max_new_tokens})"
        )
        raise InvalidRequest(req_id, detail, "min_tokens")
    for token in sampling.stop_token_ids:
        if token >= vocab_size:
            detail = f"stop_token_ids: token id {token} is not in the vocabulary [0, {vocab_size})"
            raise InvalidRequest(req_id, detail, "stop_token_ids")
    if not sampling.logit_bias:
        return sampling
    for token, _ in sampling.logit_bias:
        if token >= vocab_size:
            detail = f"logit_bias: token id {token} is not in the vocabulary [0, {vocab_size})"
            raise InvalidRequest(req_id, detail, "logit_bias")
    return dataclasses.replace(sampling, logit_bias=tuple(sorted(sampling.logit_bias)))


def _logprobs(submit: pb.Submit) -> int | None:
    """The alternatives each token's log-probability carries (None: none asked)."""
    if submit.top_logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {submit.top_logprobs}"
        )
    if not submit.return_logprobs:
        if submit.top_logprobs:
            raise ValueError("top_logprobs needs return_logprobs")
        return None
    return submit.top_logprobs


def _constraint(submit: pb.Submit) -> OutputConstraint | None:
    """What the output must match (None: anything); compiled later, off the
    event loop (service/api/constraints.py)."""
    if not submit.HasField("constraint"):
        return None
    message = submit.constraint
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ValueError("constraint names no kind (set json_schema, json_object or regex)")
    if kind == "json_object":
        if not message.json_object:
            raise ValueError("constraint.json_object must be true (unset the constraint for text)")
        return OutputConstraint(ConstraintKind.JSON_OBJECT)
    text = message.json_schema if kind == "json_schema" else message.regex
    return OutputConstraint(ConstraintKind(kind), text)


def _max_new_tokens(stopping: pb.StoppingCriteria, info: ModelInfo) -> int:
    if not stopping.HasField("max_new_tokens"):
        return DEFAULT_MAX_NEW_TOKENS
    value = stopping.max_new_tokens
    if not 1 <= value <= info.max_model_len:
        raise ValueError(f"max_new_tokens must be in [1, {info.max_model_len}], got {value}")
    return value


def _deadline(submit: pb.Submit, now: float, call_deadline: float | None) -> float | None:
    """The earliest of the submit's timeout, its absolute deadline and the
    call's deadline, as absolute ``time.monotonic()`` seconds."""
    candidates = [] if call_deadline is None else [call_deadline]
    if submit.HasField("timeout"):
        timeout_s = _seconds(submit.timeout, "timeout", DURATION_RANGE)
        if timeout_s < 0:
            raise ValueError("timeout must not be negative")
        candidates.append(now + timeout_s)
    if submit.HasField("deadline"):
        wall_s = _seconds(submit.deadline, "deadline", TIMESTAMP_RANGE)
        candidates.append(now + (wall_s - time.time()))
    return min(candidates, default=None)


def _first_token_deadline(submit: pb.Submit, now: float) -> float | None:
    """``now`` plus the submit's first-token timeout, or None without one."""
    if not submit.HasField("first_token_timeout"):
        return None
    timeout_s = _seconds(submit.first_token_timeout, "first_token_timeout", DURATION_RANGE)
    if timeout_s < 0:
        raise ValueError("first_token_timeout must not be negative")
    return now + timeout_s


def priority_of(submit: pb.Submit, default: int) -> int:
    """The class ``submit`` asks for, or ``default`` where it names none."""
    return submit.priority if submit.HasField("priority") else default


def to_generation_request(
    submit: pb.Submit,
    req_id: str,
    tokenizer: object,
    info: ModelInfo,
    now: float,
    call_deadline: float | None,
    default_priority: int = 0,
) -> RequestSpec:
    """The engine request for a submit; raises ``ValueError`` if malformed.
    A submit without a priority takes ``default_priority`` (a tenant's most
    urgent permitted class, ``TenantGate.default_priority``)."""
    _reject_unknown_fields(submit, "submit")
    prompt_token_ids = _prompt_ids(submit, tokenizer, info)
    max_new_tokens = _max_new_tokens(submit.stopping, info)
    return RequestSpec(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        max_new_tokens=max_new_tokens,
        sampling=_sampling(submit, req_id, info.vocab_size, max_new_tokens),
        stop_sequences=tuple(submit.stopping.stop_sequences),
        ignore_eos=submit.stopping.ignore_eos,
        priority=priority_of(submit, default_priority),
        deadline=_deadline(submit, now, call_deadline),
        expected_output_tokens=(
            submit.expected_output_tokens if submit.HasField("expected_output_tokens") else None
        ),
        arrival_time=now,
        first_token_deadline=_first_token_deadline(submit, now),
        constraint=_constraint(submit),
    )


# ---------------------------------------------------------------- responses


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(max(seconds, 0.0) * 1e9))
    return d


def accepted(request_id: str, queue_position: int, num_prompt_tokens: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id,
        accepted=pb.Accepted(queue_position=queue_position, num_prompt_tokens=num_prompt_tokens),
    )


_EXPIRED_LIMITS = {
    ExpiredLimit.DEADLINE: pb.EXPIRED_LIMIT_DEADLINE,
    ExpiredLimit.FIRST_TOKEN: pb.EXPIRED_LIMIT_FIRST_TOKEN,
}


def _retry_after_ms(seconds: float | None) -> int:
    return 0 if seconds is None else max(1, math.ceil(seconds * 1000))


def refusal_hints(error: Exception | None) -> tuple[ExpiredLimit | None, float | None]:
    """The time limit a refused submit cannot meet and the retry hint it is
    given (seconds), where its domain error has them."""
    expired = error.expired_limit if isinstance(error, DeadlineInfeasible) else None
    retry = error.retry_after_s if isinstance(error, AtCapacity | QuotaExceeded) else None
    return expired, retry


def rejected(
    request_id: str,
    reject_reason: int,
    status_name: str,
    message: str,
    error: Exception | None = None,
) -> pb.GenerateResponse:
    """A submit refused before it queued; ``error`` (the domain error, if
    any) supplies the expired limit and the retry-after hint."""
    finished = pb.Finished(
        reason=pb.FINISH_REASON_REJECTED,
        reject_reason=reject_reason,
        status_code=status_name,
        message=message,
    )
    expired, retry_after_s = refusal_hints(error)
    if expired is not None:
        finished.expired_limit = _EXPIRED_LIMITS[expired]
    if retry_after_s is not None:
        finished.retry_after_ms = _retry_after_ms(retry_after_s)
    return pb.GenerateResponse(request_id=request_id, finished=finished)


def token_chunk(request_id: str, event: TokenEvent) -> pb.GenerateResponse:
    chunk = pb.TokenChunk(
        token_ids=event.token_ids,
        text=event.text,
        index=event.index,
        step=event.step,
        batch_size=event.batch_size,
    )
    for token in event.logprobs or ():
        chunk.logprobs.append(token.logprob)
        if token.top_token_ids:
            chunk.top_logprobs.add(token_ids=token.top_token_ids, logprobs=token.top_logprobs)
    return pb.GenerateResponse(request_id=request_id, chunk=chunk)


def finished(request_id: str, event: FinishEvent) -> pb.GenerateResponse:
    reason, status = wire_finish(event.reason)
    reject_reason = pb.REJECT_REASON_UNSPECIFIED
    if event.reason is FinishReason.REJECTED and event.reject_cause is not None:
        rejection = rejection_for_cause(event.reject_cause)
        reject_reason, status = rejection.reject_reason, rejection.status
    timings = pb.Timings(queue_wait=_duration(event.queue_wait_s), total=_duration(event.total_s))
    if event.ttft_s is not None:
        timings.time_to_first_token.CopyFrom(_duration(event.ttft_s))
    limit = event.expired_limit
    return pb.GenerateResponse(
        request_id=request_id,
        finished=pb.Finished(
            reason=reason,
            reject_reason=reject_reason,
            expired_limit=pb.EXPIRED_LIMIT_UNSPECIFIED if limit is None else _EXPIRED_LIMITS[limit],
            retry_after_ms=_retry_after_ms(event.retry_after_s),
            status_code=status.name,
            message=event.message,
            text=event.text,
            usage=pb.Usage(
                prompt_tokens=event.num_prompt_tokens,
                output_tokens=event.num_output_tokens,
                cached_tokens=event.num_cached_tokens,
                preemptions=event.num_preemptions,
                held_back_steps=event.num_held_back,
            ),
            timings=timings,
        ),
    )


def model_info(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        name=info.name,
        architecture=info.architecture,
        max_context=info.max_model_len,
        vocab_size=info.vocab_size,
        dtype=info.dtype,
        block_size=info.block_size,
        attention_backend=info.attention_backend,
        eos_token_ids=info.eos_token_ids,
        requested_dtype=info.requested_dtype,
        weights_packed=info.weights_packed,
        has_chat_template=info.has_chat_template,
        kv_cache_dtype=info.kv_cache_dtype,
        cpu=pb.CpuInfo(
            model=str(info.cpu.get("model", "")),
            flags=list(info.cpu.get("flags", [])),  # type: ignore[call-overload]
            torch_capability=str(info.cpu.get("torch_capability", "")),
            native_bf16=bool(info.cpu.get("native_bf16", False)),
        ),
        device=_device_info(info.device),
    )


def _device_info(device: dict[str, Any]) -> pb.DeviceInfo:
    graphs = device.get("cuda_graphs") or {}
    layer = device.get("layer_graphs") or {}
    layer_on = bool(layer.get("enabled", False))
    return pb.DeviceInfo(
        type=str(device.get("type", "")),
        name=str(device.get("name", "")),
        index=int(device.get("index", 0)),
        total_memory_bytes=int(device.get("total_memory_bytes", 0)),
        free_memory_bytes=int(device.get("free_memory_bytes", 0)),
        capability=str(device.get("capability", "")),
        cuda_graphs=bool(graphs.get("enabled", False)),
        graph_batch_sizes=list(graphs.get("batch_sizes", [])),
        graph_capture_seconds=float(graphs.get("capture_seconds", 0.0)),
        graph_memory_bytes=int(graphs.get("memory_bytes", 0)),
        prefill_graph_token_sizes=list(layer.get("batch_sizes", [])) if layer_on else [],
        prefill_graph_capture_seconds=float(layer.get("capture_seconds", 0.0)),
        prefill_graph_memory_bytes=int(layer.get("memory_bytes", 0)),
        prefill_graphs_disabled_reason=str(layer.get("disabled_reason", "")),
    )


def server_stats(stats: EngineStats) -> pb.ServerStats:
    return pb.ServerStats(
        waiting=stats.waiting,
        running=stats.running,
        swapped=stats.swapped,
        kv_blocks_used=pb.BlockCounts(device=stats.device_blocks.used, host=stats.host_blocks.used),
        kv_blocks_free=pb.BlockCounts(device=stats.device_blocks.free, host=stats.host_blocks.free),
        by_priority={
            priority: pb.QueueCounts(
                waiting=counts.get("waiting", 0),
                running=counts.get("running", 0),
                swapped=counts.get("swapped", 0),
            )
            for priority, counts in stats.by_priority.items()
        },
        step=stats.step,
        draining=stats.is_draining,
    )

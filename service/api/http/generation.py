"""``POST /v1/completions`` and ``POST /v1/chat/completions``: parse, check
the server's size limits (``wire.check_sizes``, as gRPC), turn the prompt
into token ids off the event loop, build the engine request with
the gRPC service's own ``wire.to_generation_request``, submit, and relay
the engine's events as one JSON body or as server-sent events.

A request of several choices (``n``, or a list of prompts) is fanned out
here: one engine request per choice, each prompt tokenized once, all on one
relay; the engine and the gRPC API know nothing of it. The first choice to
fail aborts the others and the request is answered with its failure.

A client that goes away cancels its requests at once: aiohttp cancels the
handler (``handler_cancellation``) or the next write fails, and the
``finally`` aborts them, which frees their KV within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from slipstream.scheduler.errors import InvalidRequest, PromptTooLong, QueueFull, SchedulerError
from slipstream.scheduler.request import FinishReason, OutputConstraint, RejectCause
from slipstream.service.api import wire
from slipstream.service.api.auth import Grant, TenantGate, Tenants, Unauthenticated
from slipstream.service.api.constraints import compile_constraint
from slipstream.service.api.http.errors import (
    ApiError,
    from_domain,
    invalid,
    model_not_found,
    retry_after,
    too_large,
)
from slipstream.service.api.http.logprobs import LogprobsBuilder, TokenTexts
from slipstream.service.api.http.params import (
    MAX_UINT64,
    OpenAIRequest,
    Prompt,
    caller_trace_context,
    parse,
)
from slipstream.service.api.http.relay import EventRelay
from slipstream.service.api.http.response_format import PARAM as RESPONSE_FORMAT
from slipstream.service.api.http.responses import (
    OPENAI_FINISH,
    ChunkEncoder,
    Envelope,
    error_line,
    finish_reason,
)
from slipstream.service.api.http.tool_output import Piece, ToolCallDelta, ToolReply, readers_for
from slipstream.service.api.http.tools import CHOICE_PARAM as TOOL_CHOICE
from slipstream.service.api.http.tools import PARAM as TOOLS
from slipstream.service.api.http.tools import ToolChoice, Tools, check_tools
from slipstream.service.api.lifecycle import Lifecycle, NotServing
from slipstream.service.api.limits import Limits, OverLimit
from slipstream.service.engine.chat import (
    ChatMessage,
    has_chat_template,
    render_chat,
    renders_tools,
)
from slipstream.service.engine.events import Event, FinishEvent, RequestSpec, TokenEvent
from slipstream.service.telemetry.request_trace import Refusal
from slipstream.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from slipstream.service.api.workers import WorkerPool
    from slipstream.service.engine.engine import Engine
    from slipstream.service.telemetry.tracing import Telemetry

log = structlog.get_logger(__name__)

# A text longer than this many characters per context token cannot fit the
# context whatever the tokenizer; refused (413) before any tokenizing.
MAX_CHARS_PER_TOKEN = 32
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
}
# "auto" reads calls out of the text a model writes where its template
# shows it the tools; without, it would never write one.
NO_TOOLS_IN_TEMPLATE = (
    "tool_choice auto needs a model whose chat template renders tools, and this "
    "model's renders none; tool_choice required or a named function work with any model"
)
# How requests that ended without a complete answer are reported.
_FAILED: dict[FinishReason, tuple[int, str, str]] = {
    FinishReason.DEADLINE_EXCEEDED: (504, "deadline_exceeded", "deadline_exceeded"),
    FinishReason.CANCELLED: (503, "service_unavailable", "cancelled"),
    FinishReason.SHUTDOWN: (503, "service_unavailable", "cancelled"),  # as before it had a name
    FinishReason.REJECTED: (503, "service_unavailable", "rejected"),
    FinishReason.ERROR: (500, "server_error", "internal_error"),
    FinishReason.OUT_OF_MEMORY: (503, "service_unavailable", "out_of_memory"),
}
# A queued request the scheduler rejected: the code is its reject reason, as
# a refusal at the door names its own (``queue_full``, ``overloaded``).
_REJECT_CODES = {
    RejectCause.SHED: "shed",
    RejectCause.DEADLINE_INFEASIBLE: "deadline_infeasible",
}

# 401/403 hook: called with the Authorization header before any work; it
# raises ApiError (401 unknown token, 403 not allowed) or returns the tenant.
Authenticator = Callable[[str | None], object]


def _encode(tokenizer: object, prompt: Prompt, tools: Tools | None) -> list[int]:
    if isinstance(prompt, str):
        return wire.encode_prompt(tokenizer, prompt)
    assert isinstance(prompt[0], ChatMessage)
    definitions = None if tools is None else tools.definitions
    return render_chat(tokenizer, prompt, definitions)  # type: ignore[arg-type]


async def prompt_token_ids(
    engine: Engine, prompt: Prompt, workers: WorkerPool | None = None, tools: Tools | None = None
) -> list[int]:
    """The one place a prompt becomes token ids, off the event loop so a
    large input never stalls it: on the server's bounded tokenizer pool (the
    one gRPC uses; full → ``WorkersBusy``) or, without one, a plain thread.
    Size is checked first (the functions offered count: they are rendered)."""
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        return prompt  # type: ignore[return-value]
    max_chars = engine.info.max_model_len * MAX_CHARS_PER_TOKEN
    num_chars = prompt_bytes(prompt, tools, measure=len)
    if num_chars > max_chars:
        param = "prompt" if isinstance(prompt, str) else "messages"
        raise too_large(f"the prompt is over {max_chars} characters, more than fits", param)
    if workers is None:
        return await asyncio.to_thread(_encode, engine.tokenizer, prompt, tools)
    return await workers.run(lambda: _encode(engine.tokenizer, prompt, tools), num_chars)


def prompt_bytes(
    prompt: Prompt, tools: Tools | None = None, measure: Callable[[str], int] = wire.utf8_len
) -> int:
    """The UTF-8 bytes ``wire.prompt_bytes`` counts for the same prompt over
    gRPC: the text, or every role and content (and what tool calling adds:
    earlier calls, result ids, the functions offered); 0 for token ids.
    ``measure``: ``len`` counts characters instead."""
    if isinstance(prompt, str):
        return measure(prompt)
    messages = [m for m in prompt if isinstance(m, ChatMessage)]
    num_bytes = sum(measure(m.role) + measure(m.content) for m in messages)
    for message in messages:
        num_bytes += measure(message.tool_call_id or "")
        for call in message.tool_calls:
            num_bytes += measure(call.id) + measure(call.name) + measure(call.arguments)
    return num_bytes + (0 if tools is None else tools.num_bytes(measure))


def engine_id(envelope: Envelope) -> str:
    """The engine's (and the logs') id for an HTTP request."""
    return f"http-{envelope.id}"


def choice_request(spec: RequestSpec, index: int, sample: int, num_choices: int) -> RequestSpec:
    """Choice ``index``'s engine request, ``sample`` of its prompt: ``spec``
    (the prompt's) under an id of its own, seeded ``seed + sample`` (wrapped)
    so that a prompt's seeded choices differ yet repeat, and a prompt in a
    list samples as it does sent alone. A request of one choice is ``spec``."""
    if num_choices == 1:
        return spec
    sampling = spec.sampling
    if sampling.seed is not None:
        sampling = replace(sampling, seed=(sampling.seed + sample) % (MAX_UINT64 + 1))
    return replace(spec, req_id=f"{spec.req_id}-{index}", sampling=sampling)


def not_serving(exc: NotServing, request: web.Request, telemetry: Telemetry | None) -> ApiError:
    """The 503 of a call refused while loading or draining, counted and
    logged as a gRPC call's refusal is (reason ``loading`` or ``draining`` on both)."""
    error = _domain(exc)
    if telemetry is not None:
        where = f"{request.method} {request.path}"
        telemetry.not_serving(where, request.remote or "", error.rejection.reason_name, str(exc))
    return error


def finish_error(event: FinishEvent) -> ApiError:
    status, kind, code = _FAILED[event.reason]
    if event.reject_cause is not None:
        code = _REJECT_CODES[event.reject_cause]
    message = event.message or f"the request ended: {event.reason.name.lower()}"
    headers = {} if event.retry_after_s is None else retry_after(event.retry_after_s)  # shed
    return ApiError(status, message, kind, None, code, headers)


class Generations:
    """The two generation endpoints over one lifecycle (and so one engine)."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        telemetry: Telemetry | None = None,
        authenticate: Authenticator | None = None,
        tenants: Tenants | None = None,
        workers: WorkerPool | None = None,
        limits: Limits | None = None,
    ) -> None:
        self._lifecycle = lifecycle
        self._telemetry = telemetry
        self._authenticate = authenticate
        self._tenants = tenants  # bearer tokens and limits, as on gRPC
        self._workers = workers  # the server's tokenizer pool, shared with gRPC
        self._limits = limits or Limits()  # the sizes gRPC enforces, from serve's flags
        self._token_texts: TokenTexts | None = None  # the served tokenizer's, made when asked

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, is_chat=True)

    def check_token(self, request: web.Request) -> TenantGate | None:
        """The request's tenant on a server with tenants (None without), bound
        to its token: a missing or unknown bearer token is a 401, logged and
        counted as a gRPC call's is."""
        if self._authenticate is not None:
            self._authenticate(request.headers.get("Authorization"))
        if self._tenants is None:
            return None
        try:
            return self._tenants.gate(request.headers.get("Authorization"))
        except Exception as exc:
            if isinstance(exc, Unauthenticated) and self._telemetry is not None:
                where = f"{request.method} {request.path}"
                self._telemetry.unauthenticated(where, request.remote or "", str(exc))
            raise _domain(exc) from None

    async def _generate(self, request: web.Request, is_chat: bool) -> web.StreamResponse:
        now = time.monotonic()  # a deadline counts from arrival, tokenizing included
        try:
            engine = self._lifecycle.require_serving()
        except NotServing as exc:
            raise not_serving(exc, request, self._telemetry) from None
        gate = self.check_token(request)  # 401 before any work
        try:
            body = await _json(request, self._limits.http_read_timeout_s)
            max_model_len, max_choices = engine.info.max_model_len, self._limits.max_choices
            parsed = parse(body, request.headers, is_chat, max_model_len, max_choices)
            if parsed.model != engine.info.name:
                raise model_not_found(parsed.model)
        except ApiError as exc:  # counted and logged as a gRPC submit's refusal is
            trace_context = caller_trace_context(request.headers)
            self._rejected(exc, Envelope.new("", is_chat), trace_context, gate, now)
            raise
        envelope = Envelope.new(parsed.model, is_chat)
        try:
            priority = 0 if gate is None else gate.default_priority  # where none is given
            specs = await self._requests(engine, parsed, envelope, now, priority)
            admitted = self._admit(gate, specs)
            req_ids = [spec.req_id for spec, _ in admitted]
            relay = EventRelay(asyncio.get_running_loop(), req_ids)
            self._submit(engine, admitted, relay, parsed, envelope)
        except ApiError as exc:
            self._rejected(exc, envelope, parsed.submit.trace_context, gate, now)
            raise
        try:
            logprobs = None
            if admitted[0][0].sampling.logprobs is not None:
                texts = self._texts(engine)
                logprobs = [LogprobsBuilder(texts, is_chat) for _ in req_ids]
            choices = Choices(engine, relay, req_ids, logprobs, parsed.tools)
            if parsed.is_stream:
                return await self._stream(request, parsed, envelope, choices)
            return await self._whole(parsed, envelope, choices)
        finally:
            abort_unfinished(engine, relay, "the client disconnected")

    def _texts(self, engine: Engine) -> TokenTexts:
        """Token texts for log-probabilities, kept across requests (one tokenizer)."""
        if self._token_texts is None or self._token_texts.tokenizer is not engine.tokenizer:
            self._token_texts = TokenTexts(engine.tokenizer)
        return self._token_texts

    def _rejected(
        self,
        error: ApiError,
        envelope: Envelope,
        trace_context: Mapping[str, str],
        gate: TenantGate | None,
        arrival: float,
    ) -> None:
        """A request refused before the engine took it, recorded with its
        reason, from its ``arrival``."""
        if self._telemetry is None:
            return
        rejection = error.rejection
        self._telemetry.rejected(
            envelope.id,
            rejection.reason_name,
            rejection.wire_status,
            error.message,
            (),
            trace_context,
            tenant="" if gate is None else gate.tenant.name,
            req_id=engine_id(envelope),
            refusal=Refusal(arrival),
        )

    async def _requests(
        self,
        engine: Engine,
        parsed: OpenAIRequest,
        envelope: Envelope,
        now: float,
        default_priority: int = 0,
    ) -> list[RequestSpec]:
        """One engine request per choice, in index order: every prompt's size
        checked before any work, each distinct prompt tokenized once."""
        for prompt in parsed.prompts:
            try:
                num_bytes = prompt_bytes(prompt, parsed.tools)
                wire.check_sizes(parsed.submit, num_bytes, self._limits)
            except OverLimit as exc:
                raise _domain(exc, _param(exc.field, parsed)) from None
        if parsed.is_chat and not has_chat_template(engine.tokenizer):
            # render_chat's own message names the gRPC fields (text, token_ids).
            message = "this model has no chat template; use /v1/completions with prompt"
            raise invalid(message, "messages", "invalid_messages")
        if parsed.tools is not None:
            check_tools(parsed.tools, self._limits.max_constraint_bytes)
            if parsed.tools.choice is ToolChoice.AUTO and not renders_tools(engine.tokenizer):
                raise invalid(NO_TOOLS_IN_TEMPLATE, TOOL_CHOICE)
        prompts = parsed.prompts
        prompt_specs: list[RequestSpec] = []  # one per prompt
        for i, prompt in enumerate(prompts):
            first = prompts.index(prompt)  # 16 prompts at most
            if first < i:
                prompt_specs.append(prompt_specs[first])
                continue
            submit = parsed.submit
            if len(prompts) > 1:  # each prompt's token ids in a submit of its own
                submit = pb.Submit()
                submit.CopyFrom(parsed.submit)
            req_id = engine_id(envelope)
            prompt_specs.append(
                await self._request(engine, parsed, prompt, submit, req_id, now, default_priority)
            )
        constraint = prompt_specs[0].constraint
        if constraint is not None:  # compiled once; each choice's matcher starts from it
            grammar = await self._compile(engine, constraint, _param("constraint", parsed))
            prompt_specs = [replace(spec, constraint=grammar) for spec in prompt_specs]
        num_choices = parsed.num_choices
        return [
            choice_request(spec, p * parsed.n + sample, sample, num_choices)
            for p, spec in enumerate(prompt_specs)
            for sample in range(parsed.n)
        ]

    async def _request(
        self,
        engine: Engine,
        parsed: OpenAIRequest,
        prompt: Prompt,
        submit: pb.Submit,
        req_id: str,
        now: float,
        default_priority: int,
    ) -> RequestSpec:
        """``prompt``'s engine request, its token ids put into ``submit``."""
        try:
            ids = await prompt_token_ids(engine, prompt, self._workers, parsed.tools)
        except (ValueError, QueueFull) as exc:  # ChatError: bad roles, no template; pool full
            raise _domain(exc, "messages" if parsed.is_chat else "prompt") from None
        submit.token_ids.ids.extend(ids)
        if not submit.stopping.HasField("max_new_tokens"):
            # Chat's OpenAI default: as much as the context leaves.
            room = engine.info.max_model_len - len(ids)
            min_tokens = submit.stopping.min_tokens
            if 0 < room < min_tokens:  # (no room at all: the prompt is over the context)
                message = (
                    f"min_tokens ({min_tokens}) must be at most the {room} tokens the "
                    f"context ({engine.info.max_model_len}) leaves after the prompt's "
                    f"{len(ids)}: no max_tokens was given"
                )
                raise invalid(message, "min_tokens")
            submit.stopping.max_new_tokens = max(1, room)
        try:
            return wire.to_generation_request(
                submit, req_id, engine.tokenizer, engine.info, now, None, default_priority
            )
        except (ValueError, SchedulerError) as exc:  # PromptTooLong: over the context
            raise _domain(exc, _prompt_param(exc, parsed)) from None

    async def _compile(
        self, engine: Engine, constraint: OutputConstraint, param: str
    ) -> OutputConstraint:
        """``response_format`` (or the tools' schema) compiled off the event
        loop; a 400 naming ``param`` where it does not compile (429 with the
        pool full)."""
        try:
            return await compile_constraint(engine, constraint, self._workers)
        except (ValueError, QueueFull) as exc:  # InvalidConstraint; WorkersBusy
            raise _domain(exc, param) from None

    def _admit(
        self, gate: TenantGate | None, specs: list[RequestSpec]
    ) -> list[tuple[RequestSpec, Grant | None]]:
        """Each choice through the tenant's gate (403 never allowed, 429 over
        quota); one refused gives back the grants of those before it."""
        if gate is None:
            return [(spec, None) for spec in specs]
        most = gate.tenant.max_inflight
        if most is not None and len(specs) > most:  # a 429 no retry could pass
            message = (
                f"{len(specs)} choices are more than this tenant may have in flight "
                f"(max_inflight {most}); ask for at most {most}"
            )
            raise invalid(message, "n")
        admitted: list[tuple[RequestSpec, Grant | None]] = []
        try:
            for spec in specs:
                admitted.append(gate.admit(spec))
        except Exception as exc:
            for _, grant in admitted:
                assert grant is not None
                grant.release()
            raise _domain(exc) from None
        return admitted

    def _submit(
        self,
        engine: Engine,
        admitted: list[tuple[RequestSpec, Grant | None]],
        relay: EventRelay,
        parsed: OpenAIRequest,
        envelope: Envelope,
    ) -> None:
        """Every choice to the engine, or none: one the engine refuses
        aborts those before it and gives back the grants of those after."""
        telemetry = self._telemetry
        for i, (gen_request, grant) in enumerate(admitted):
            if telemetry is not None:
                telemetry.begin(gen_request, envelope.id, (), parsed.submit.trace_context)
            on_event = relay.on_event if grant is None else grant.wrap(relay.on_event)
            try:
                engine.submit(gen_request, on_event)
            except Exception as exc:
                for _, later in admitted[i:]:
                    if later is not None:
                        later.release()
                if telemetry is not None:
                    telemetry.abandon(gen_request.req_id)
                for earlier, _ in admitted[:i]:
                    engine.abort(earlier.req_id, message="another choice of the request failed")
                relay.give_up()
                raise _domain(exc, _prompt_param(exc, parsed)) from None

    async def _whole(
        self, parsed: OpenAIRequest, envelope: Envelope, choices: Choices
    ) -> web.Response:
        texts: list[list[str]] = [[] for _ in range(choices.num_choices)]
        async for batch in choices.relay.batches():
            for event in batch:
                index = choices.index(event)
                texts[index].append(event.text)
                if isinstance(event, TokenEvent):
                    if choices.logprobs is not None:
                        choices.logprobs[index].add(event)
                elif event.reason in OPENAI_FINISH:
                    choices.finishes[index] = event
                else:
                    raise choices.fail(event)
        wholes = choices.whole_logprobs()
        answers = ["".join(pieces) for pieces in texts]
        messages = None
        if choices.readers is not None:  # the same pieces a stream would have had
            messages = []
            tools = parsed.tools
            assert tools is not None
            for index, answer in enumerate(answers):
                reply = ToolReply(tools.is_constrained)
                reply.add(choices.read(index, answer, is_last=True))
                messages.append(reply.message())
        body = envelope.completion(
            answers, choices.finished(), wholes, parsed.n, messages, choices.has_tool_calls
        )
        return web.Response(text=json.dumps(body), content_type="application/json")

    async def _stream(
        self, request: web.Request, parsed: OpenAIRequest, envelope: Envelope, choices: Choices
    ) -> web.StreamResponse:
        """Headers go out with the first event, so a request refused or
        expired before its first token still gets its own status. Choices'
        chunks go out as their tokens come, each with its ``index``."""
        encoder = ChunkEncoder(envelope, parsed.include_usage, choices.num_choices)
        response: web.StreamResponse | None = None
        try:
            async for batch in choices.relay.batches():
                out = []
                if response is None:
                    first = batch[0]
                    if isinstance(first, FinishEvent) and first.reason not in OPENAI_FINISH:
                        raise choices.fail(first)
                    response = web.StreamResponse(headers=SSE_HEADERS)
                    await response.prepare(request)
                    tools = parsed.tools
                    content = None if tools is not None and tools.is_constrained else ""
                    out.extend(encoder.first(i, content) for i in range(choices.num_choices))
                failure = None
                for event in batch:
                    index = choices.index(event)
                    if isinstance(event, TokenEvent):
                        logprobs = choices.logprobs
                        chunk = None if logprobs is None else logprobs[index].chunk(event)
                        if choices.readers is None:
                            out.append(encoder.token(event.text, chunk, index))
                        else:
                            pieces = choices.read(index, event.text)
                            out.append(encoder.pieces(pieces, chunk, index))
                    elif event.reason in OPENAI_FINISH:
                        choices.finishes[index] = event
                        if choices.readers is None:
                            out.append(encoder.finish(event.text, event, index))
                        else:
                            pieces = choices.read(index, event.text, is_last=True)
                            out.append(encoder.pieces(pieces, None, index))
                            reason = finish_reason(event, choices.has_tool_calls[index])
                            out.append(encoder.finish("", event, index, reason))
                    else:
                        failure = choices.fail(event)
                        out.append(error_line(failure.body()))
                        break
                if failure is None and choices.relay.is_finished:
                    out.append(encoder.end(choices.finished(), parsed.n))
                await response.write(b"".join(out))
                if failure is not None:
                    break
            assert response is not None
            await response.write_eof()
        except ConnectionResetError:
            log.debug("http_client_gone", id=envelope.id)
        assert response is not None
        return response


class Choices:
    """One request's choices in flight: which engine request is which
    choice, each one's log-probabilities (where asked), tool-call reader
    (where tools are called) and finish."""

    def __init__(
        self,
        engine: Engine,
        relay: EventRelay,
        req_ids: list[str],
        logprobs: list[LogprobsBuilder] | None,
        tools: Tools | None = None,
    ) -> None:
        self.relay = relay
        self.logprobs = logprobs
        self.num_choices = len(req_ids)
        self.finishes: list[FinishEvent | None] = [None] * len(req_ids)
        self.readers = readers_for(tools, len(req_ids))
        # Whole calls came (none of them cut off): a "tool_calls" finish.
        self.has_tool_calls = [False] * len(req_ids)
        self._engine = engine
        self._indexes = {req_id: index for index, req_id in enumerate(req_ids)}

    def index(self, event: Event) -> int:
        return self._indexes[event.req_id]

    def read(self, index: int, text: str, is_last: bool = False) -> list[Piece]:
        """Choice ``index``'s next pieces (its reader's) from ``text``;
        ``is_last``: the finish event's, after which the reader is done."""
        assert self.readers is not None
        reader = self.readers[index]
        pieces = reader.feed(text)
        if is_last:
            pieces += reader.finish()
        if any(isinstance(piece, ToolCallDelta) for piece in pieces):
            self.has_tool_calls[index] = True
        if is_last and reader.is_cut():
            self.has_tool_calls[index] = False
        return pieces

    def fail(self, event: FinishEvent) -> ApiError:
        """The answer to a choice that ended without one; the others are
        aborted at once, of no use now."""
        abort_unfinished(self._engine, self.relay, "another choice of the request failed")
        return finish_error(event)

    def finished(self) -> list[FinishEvent]:
        """Every choice's finish, once all have come."""
        assert all(event is not None for event in self.finishes)
        return self.finishes  # type: ignore[return-value]

    def whole_logprobs(self) -> list[object]:
        if self.logprobs is None:
            return [None] * self.num_choices
        return [builder.whole() for builder in self.logprobs]


def abort_unfinished(engine: Engine, relay: EventRelay, message: str) -> None:
    """Aborts the relay's requests that have not finished."""
    for req_id in relay.give_up():
        engine.abort(req_id, message=message)


async def _json(request: web.Request, timeout_s: float | None = None) -> object:
    # A body over the size limit raises HTTPRequestEntityTooLarge (413, app.py).
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:  # aiohttp reads what is left for a while, then closes
        message = f"the request body did not arrive within {timeout_s:g} s"
        raise ApiError(408, message, code="request_timeout") from None
    charset = request.charset or "utf-8"
    try:
        # A leading byte order mark is skipped, as OpenAI's servers do.
        text = raw.decode("utf-8-sig" if charset.lower() in ("utf-8", "utf8") else charset)
    except LookupError:  # a charset in Content-Type that Python has no codec for
        raise invalid(f"the request body's charset {request.charset!r} is unknown") from None
    except UnicodeDecodeError as exc:
        message = f"the request body is not valid {charset} (at byte {exc.start})"
        raise invalid(message) from None
    try:
        with _gc_paused():
            return json.loads(text)
    except json.JSONDecodeError:
        raise invalid("the request body is not valid JSON") from None
    except ValueError:  # valid JSON that Python's json refuses
        digits = sys.get_int_max_str_digits()
        raise invalid(f"the request body has an integer of more than {digits} digits") from None
    except RecursionError:
        raise invalid("the request body nests arrays or objects too deeply") from None


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic collection while a body parses. It runs on the event loop
    (a thread would not help: the C parser holds the GIL), and a body of
    a million small lists (``[[0],[0],...]``) starts collections that walk
    all it has made so far: 5 MiB took ~1 s, not ~0.15 s. What a parse
    makes holds no cycles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _param(field: str, parsed: OpenAIRequest) -> str:
    """The request's own name (parameter or header) for a ``Submit`` field
    (``prompt``, ``prompt_token_ids``, ``stop_sequences``, ``trace_context``,
    ``constraint``)."""
    if field == "stop_sequences":
        return "stop"
    if field == "constraint":  # the tools' call, or response_format
        tools = parsed.tools
        return TOOLS if tools is not None and tools.is_constrained else RESPONSE_FORMAT
    if field == "trace_context":  # the larger of the two headers
        trace = parsed.submit.trace_context
        return max(trace, key=lambda name: len(trace[name]))
    return "messages" if parsed.is_chat else "prompt"


# Fields the OpenAI body, the wire and SamplingParams all name alike.
_SAMPLING_PARAMS = frozenset(
    (
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p",
        "min_tokens", "stop_token_ids",
    )
)  # fmt: skip


def _prompt_param(exc: Exception, parsed: OpenAIRequest) -> str | None:
    """The parameter a refused conversion or submit names: ``messages`` or
    ``prompt`` for a prompt over the context, as OpenAI names it; the field
    of an ``InvalidRequest`` that has one (``logit_bias`` for a biased token
    outside the vocabulary, ``prompt`` for a prompt's)."""
    if isinstance(exc, PromptTooLong):
        return _param("prompt", parsed)
    field = exc.field if isinstance(exc, InvalidRequest) else None
    if field is None or field in _SAMPLING_PARAMS:
        return field
    return _param(field, parsed)


def _domain(exc: Exception, param: str | None = None) -> ApiError:
    error = from_domain(exc, param)
    if error is None:
        raise exc
    return error

"""``POST /v1/completions`` and ``POST /v1/chat/completions``: parse, check
the server's size limits (``wire.check_sizes``, as gRPC), turn the prompt
into token ids off the event loop, build the engine request with
the gRPC service's own ``wire.to_generation_request``, submit, and relay
the engine's events as one JSON body or as server-sent events.

A client that goes away cancels its request at once: aiohttp cancels the
handler (``handler_cancellation``) or the next write fails, and the
``finally`` aborts the request, which frees its KV within one engine step.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from slipstream.scheduler.errors import InvalidRequest, PromptTooLong, QueueFull, SchedulerError
from slipstream.scheduler.request import FinishReason
from slipstream.service.api import wire
from slipstream.service.api.auth import Grant, Tenant, TenantGate, Tenants, Unauthenticated
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
    OpenAIRequest,
    Prompt,
    caller_trace_context,
    parse,
)
from slipstream.service.api.http.relay import EventRelay
from slipstream.service.api.http.responses import (
    OPENAI_FINISH,
    ChunkEncoder,
    Envelope,
    error_line,
)
from slipstream.service.api.lifecycle import Lifecycle, NotServing
from slipstream.service.api.limits import Limits, OverLimit
from slipstream.service.engine.chat import has_chat_template, render_chat
from slipstream.service.engine.events import FinishEvent, RequestSpec, TokenEvent
from slipstream.service.telemetry.request_trace import Refusal

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
# How requests that ended without a complete answer are reported.
_FAILED: dict[FinishReason, tuple[int, str, str]] = {
    FinishReason.DEADLINE_EXCEEDED: (504, "deadline_exceeded", "deadline_exceeded"),
    FinishReason.CANCELLED: (503, "service_unavailable", "cancelled"),
    FinishReason.SHUTDOWN: (503, "service_unavailable", "cancelled"),  # as before it had a name
    FinishReason.REJECTED: (503, "service_unavailable", "rejected"),
    FinishReason.ERROR: (500, "server_error", "internal_error"),
    FinishReason.OUT_OF_MEMORY: (503, "service_unavailable", "out_of_memory"),
}

# 401/403 hook: called with the Authorization header before any work; it
# raises ApiError (401 unknown token, 403 not allowed) or returns the tenant.
Authenticator = Callable[[str | None], object]


def _encode(tokenizer: object, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        return wire.encode_prompt(tokenizer, prompt)
    return render_chat(tokenizer, prompt)


async def prompt_token_ids(
    engine: Engine, prompt: Prompt, workers: WorkerPool | None = None
) -> list[int]:
    """The one place a prompt becomes token ids, off the event loop so a
    large input never stalls it: on the server's bounded tokenizer pool (the
    one gRPC uses; full → ``WorkersBusy``) or, without one, a plain thread.
    Size is checked first."""
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        return prompt
    texts = [prompt] if isinstance(prompt, str) else [content for _, content in prompt]
    max_chars = engine.info.max_model_len * MAX_CHARS_PER_TOKEN
    num_chars = sum(len(t) for t in texts)
    if num_chars > max_chars:
        param = "prompt" if isinstance(prompt, str) else "messages"
        raise too_large(f"the prompt is over {max_chars} characters, more than fits", param)
    if workers is None:
        return await asyncio.to_thread(_encode, engine.tokenizer, prompt)
    return await workers.run(lambda: _encode(engine.tokenizer, prompt), num_chars)


def prompt_bytes(prompt: Prompt) -> int:
    """The UTF-8 bytes ``wire.prompt_bytes`` counts for the same prompt over
    gRPC: the text, or every role and content; 0 for token ids."""
    if isinstance(prompt, str):
        return wire.utf8_len(prompt)
    pairs = (p for p in prompt if isinstance(p, tuple))
    return sum(wire.utf8_len(role) + wire.utf8_len(content) for role, content in pairs)


def engine_id(envelope: Envelope) -> str:
    """The engine's (and the logs') id for an HTTP request."""
    return f"http-{envelope.id}"


def not_serving(exc: NotServing, request: web.Request, telemetry: Telemetry | None) -> ApiError:
    """The 503 of a call refused while loading or draining, counted and
    logged as a gRPC call's refusal is (reason ``draining`` on both)."""
    error = _domain(exc)
    if telemetry is not None:
        where = f"{request.method} {request.path}"
        telemetry.not_serving(where, request.remote or "", error.rejection.reason_name, str(exc))
    return error


def finish_error(event: FinishEvent) -> ApiError:
    status, kind, code = _FAILED[event.reason]
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

    def check_token(self, request: web.Request) -> Tenant | None:
        """The request's tenant on a server with tenants (None without):
        a missing or unknown bearer token is a 401, logged and counted as a
        gRPC call's is."""
        if self._authenticate is not None:
            self._authenticate(request.headers.get("Authorization"))
        if self._tenants is None:
            return None
        try:
            return self._tenants.authenticate(request.headers.get("Authorization"))
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
        tenant = self.check_token(request)  # 401 before any work
        gate = (
            None if self._tenants is None or tenant is None else TenantGate(self._tenants, tenant)
        )
        try:
            body = await _json(request)
            parsed = parse(body, request.headers, is_chat, engine.info.max_model_len)
            if parsed.model != engine.info.name:
                raise model_not_found(parsed.model)
        except ApiError as exc:  # counted and logged as a gRPC submit's refusal is
            trace_context = caller_trace_context(request.headers)
            self._rejected(exc, Envelope.new("", is_chat), trace_context, gate, now)
            raise
        envelope = Envelope.new(parsed.model, is_chat)
        try:
            priority = 0 if gate is None else gate.default_priority  # where none is given
            gen_request = await self._request(engine, parsed, envelope, now, priority)
            grant = None
            if gate is not None:  # 403 never allowed, 429 over quota
                try:
                    gen_request, grant = gate.admit(gen_request)
                except Exception as exc:
                    raise _domain(exc) from None
            relay = EventRelay(asyncio.get_running_loop())
            self._submit(engine, gen_request, relay, parsed, envelope, grant)
        except ApiError as exc:
            self._rejected(exc, envelope, parsed.submit.trace_context, gate, now)
            raise
        try:
            logprobs = None
            if gen_request.sampling.logprobs is not None:
                logprobs = LogprobsBuilder(self._texts(engine), is_chat)
            if parsed.is_stream:
                return await self._stream(request, parsed, envelope, relay, logprobs)
            return await self._whole(envelope, relay, logprobs)
        finally:
            if not relay.is_finished:
                engine.abort(gen_request.req_id, message="the client disconnected")

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

    async def _request(
        self,
        engine: Engine,
        parsed: OpenAIRequest,
        envelope: Envelope,
        now: float,
        default_priority: int = 0,
    ) -> RequestSpec:
        try:
            wire.check_sizes(parsed.submit, prompt_bytes(parsed.prompt), self._limits)
        except OverLimit as exc:
            raise _domain(exc, _param(exc.field, parsed)) from None
        if parsed.is_chat and not has_chat_template(engine.tokenizer):
            # render_chat's own message names the gRPC fields (text, token_ids).
            message = "this model has no chat template; use /v1/completions with prompt"
            raise invalid(message, "messages", "invalid_messages")
        try:
            ids = await prompt_token_ids(engine, parsed.prompt, self._workers)
        except (ValueError, QueueFull) as exc:  # ChatError: bad roles, no template; pool full
            raise _domain(exc, "messages" if parsed.is_chat else "prompt") from None
        submit = parsed.submit
        submit.token_ids.ids.extend(ids)
        if not submit.stopping.HasField("max_new_tokens"):
            # Chat's OpenAI default: as much as the context leaves.
            submit.stopping.max_new_tokens = max(1, engine.info.max_model_len - len(ids))
        try:
            return wire.to_generation_request(
                submit,
                engine_id(envelope),
                engine.tokenizer,
                engine.info,
                now,
                None,
                default_priority,
            )
        except (ValueError, SchedulerError) as exc:  # PromptTooLong: over the context
            raise _domain(exc, _prompt_param(exc, parsed)) from None

    def _submit(
        self,
        engine: Engine,
        gen_request: RequestSpec,
        relay: EventRelay,
        parsed: OpenAIRequest,
        envelope: Envelope,
        grant: Grant | None = None,
    ) -> None:
        telemetry = self._telemetry
        if telemetry is not None:
            telemetry.begin(gen_request, envelope.id, (), parsed.submit.trace_context)
        on_event = relay.on_event if grant is None else grant.wrap(relay.on_event)
        try:
            engine.submit(gen_request, on_event)
        except Exception as exc:
            if grant is not None:
                grant.release()
            if telemetry is not None:
                telemetry.abandon(gen_request.req_id)
            field = exc.field if isinstance(exc, InvalidRequest) else None  # ids out of vocabulary
            param = _prompt_param(exc, parsed) if field is None else _param(field, parsed)
            raise _domain(exc, param) from None

    async def _whole(
        self, envelope: Envelope, relay: EventRelay, logprobs: LogprobsBuilder | None = None
    ) -> web.Response:
        texts: list[str] = []
        async for batch in relay.batches():
            texts.extend(event.text for event in batch)
            if logprobs is not None:
                for event in batch:
                    if isinstance(event, TokenEvent):
                        logprobs.add(event)
        finish = batch[-1]
        assert isinstance(finish, FinishEvent)
        if finish.reason not in OPENAI_FINISH:
            raise finish_error(finish)
        whole = None if logprobs is None else logprobs.whole()
        body = envelope.completion("".join(texts), finish, whole)
        return web.Response(text=json.dumps(body), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        parsed: OpenAIRequest,
        envelope: Envelope,
        relay: EventRelay,
        logprobs: LogprobsBuilder | None = None,
    ) -> web.StreamResponse:
        """Headers go out with the first event, so a request refused or
        expired before its first token still gets its own status."""
        encoder = ChunkEncoder(envelope, parsed.include_usage)
        response: web.StreamResponse | None = None
        try:
            async for batch in relay.batches():
                out = []
                if response is None:
                    first = batch[0]
                    if isinstance(first, FinishEvent) and first.reason not in OPENAI_FINISH:
                        raise finish_error(first)
                    response = web.StreamResponse(headers=SSE_HEADERS)
                    await response.prepare(request)
                    out.append(encoder.first())
                for event in batch:
                    if isinstance(event, TokenEvent):
                        chunk = None if logprobs is None else logprobs.chunk(event)
                        out.append(encoder.token(event.text, chunk))
                    elif event.reason in OPENAI_FINISH:
                        out.append(encoder.finish(event.text, event))
                    else:
                        out.append(error_line(finish_error(event).body()))
                await response.write(b"".join(out))
            assert response is not None
            await response.write_eof()
        except ConnectionResetError:
            log.debug("http_client_gone", id=envelope.id)
        assert response is not None
        return response


async def _json(request: web.Request) -> object:
    # A body over the size limit raises HTTPRequestEntityTooLarge (413, app.py).
    raw = await request.read()
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
        return json.loads(text)
    except json.JSONDecodeError:
        raise invalid("the request body is not valid JSON") from None
    except ValueError:  # valid JSON that Python's json refuses
        digits = sys.get_int_max_str_digits()
        raise invalid(f"the request body has an integer of more than {digits} digits") from None
    except RecursionError:
        raise invalid("the request body nests arrays or objects too deeply") from None


def _param(field: str, parsed: OpenAIRequest) -> str:
    """The request's own name (parameter or header) for a ``Submit`` field
    (``prompt``, ``prompt_token_ids``, ``stop_sequences``, ``trace_context``)."""
    if field == "stop_sequences":
        return "stop"
    if field == "trace_context":  # the larger of the two headers
        trace = parsed.submit.trace_context
        return max(trace, key=lambda name: len(trace[name]))
    return "messages" if parsed.is_chat else "prompt"


def _prompt_param(exc: Exception, parsed: OpenAIRequest) -> str | None:
    """``messages`` or ``prompt`` for a prompt over the context, as OpenAI names it."""
    return _param("prompt", parsed) if isinstance(exc, PromptTooLong) else None


def _domain(exc: Exception, param: str | None = None) -> ApiError:
    error = from_domain(exc, param)
    if error is None:
        raise exc
    return error

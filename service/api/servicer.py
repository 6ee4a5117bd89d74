"""``slipstream.v1.Inference``: thin handlers. Validation and conversion live
in ``wire``, per-call request bookkeeping in ``session``, the mapping of
errors to statuses in ``status``."""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
import structlog

from slipstream.service.api import wire
from slipstream.service.api.auth import TenantGate, Tenants, Unauthenticated, authorization_header
from slipstream.service.api.lifecycle import Lifecycle, NotServing
from slipstream.service.api.limits import Limits
from slipstream.service.api.session import StreamSession, wants_batches
from slipstream.service.api.status import reject_reason_name, rejection_for
from slipstream.service.api.tokenize import AnswerTooLarge, TokenCosts, tokenize
from slipstream.service.api.workers import WorkerPool, WorkersBusy
from slipstream.v1 import REJECT_REASON_KEY, RETRY_AFTER_KEY
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from slipstream.service.engine.engine import Engine
    from slipstream.service.telemetry.tracing import Telemetry

log = structlog.get_logger(__name__)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(
        self,
        lifecycle: Lifecycle,
        telemetry: Telemetry | None = None,
        limits: Limits | None = None,
        tenants: Tenants | None = None,
        workers: WorkerPool | None = None,
    ) -> None:
        self._lifecycle = lifecycle
        self._telemetry = telemetry
        self._tenants = tenants
        self.limits = limits or Limits()
        self.workers = workers or WorkerPool.for_limits(self.limits)
        self._token_costs: tuple[Tokenizer, TokenCosts] | None = None

    async def _session(self, context: grpc.aio.ServicerContext, method: str) -> StreamSession:
        """The call's session: its tenant checked, the engine serving (else the
        call ends UNAUTHENTICATED / UNAVAILABLE)."""
        gate = await self._gate(context, method)
        try:
            engine = self._lifecycle.require_serving()
        except NotServing as exc:
            await self._abort_not_serving(context, method, exc)
        return StreamSession(
            engine,
            asyncio.get_running_loop(),
            _call_deadline(context),
            self._telemetry,
            context.invocation_metadata() or (),
            self.limits,
            self.workers,
            gate,
        )

    async def Generate(
        self,
        request_iterator: AsyncIterator[pb.GenerateRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        session = await self._session(context, "Generate")
        # A dropped client or a passed call deadline cancels this handler
        # (its finally frees the requests) or fails its write (see
        # _ends_quietly); the callback frees them whatever ends the call.
        context.add_done_callback(_aborts_when_done(session))
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            async with _ends_quietly(session, "Generate"):
                batches = wants_batches(context.invocation_metadata() or ())
                async for response in session.responses(batches):
                    await context.write(response)
                if session.error is not None:
                    # One line per failed stream; no traceback: the client sent it.
                    error = str(session.error)
                    log.warning("stream_invalid", stream_id=session.stream_id, error=error)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        finally:
            session.abort_all()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def GenerateOne(
        self, request: pb.Submit | wire.BadFrame, context: grpc.aio.ServicerContext
    ) -> None:
        """One request on its own call: the events of ``Generate``, then OK.

        A rejected submit sends no event: the call ends with the rejection's
        gRPC status (UNAVAILABLE while draining, RESOURCE_EXHAUSTED for a full
        queue, INVALID_ARGUMENT, ...), the reason in the trailing metadata
        ``slipstream-reject-reason``. A call that sent no message is one that
        clients' retry policies and proxies may retry on another replica;
        a Finished event would commit it to this one. (A request the
        scheduler refuses after accepting it finishes REJECTED as an event,
        as on ``Generate``.)
        """
        session = await self._session(context, "GenerateOne")
        if isinstance(request, wire.BadFrame):
            message = (
                f"a {request.num_bytes}-byte message does not parse as a "
                f"slipstream.v1.Submit: {request.reason}"
            )
            # One line per bad call; no traceback: the client sent it.
            log.warning("call_invalid", method="GenerateOne", error=message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        # Cancelled, disconnected or past its deadline: abort at once.
        context.add_done_callback(_aborts_when_done(session))
        try:
            async with _ends_quietly(session, "GenerateOne"):
                await session.submit_one(request)
                is_first = True
                async for response in session.responses():
                    if is_first and _is_rejection(response):
                        await _abort_rejected(context, response.finished)
                    is_first = False
                    await context.write(response)
        finally:
            session.abort_all()

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        engine = await self._engine_or_abort(context, "Tokenize")
        num_bytes = len(request.text.encode())
        if num_bytes > self.limits.max_prompt_bytes:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"text is {num_bytes} bytes, over this server's limit of "
                f"{self.limits.max_prompt_bytes}",
            )
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        tokenizer = engine.tokenizer.backend_tokenizer
        max_bytes = self.limits.max_message_bytes

        def run() -> pb.TokenizeResponse:
            costs = self._token_costs_of(tokenizer)
            return tokenize(tokenizer, costs, request.text, add_special, max_bytes)

        try:
            return await self.workers.run(run, num_bytes)
        except WorkersBusy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except AnswerTooLarge as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _token_costs_of(self, tokenizer: Tokenizer) -> TokenCosts:
        """``tokenizer``'s table, built once (on a worker: a large vocabulary
        takes tens of ms); two workers may both build it, to the same end."""
        cached = self._token_costs
        if cached is None or cached[0] is not tokenizer:
            cached = self._token_costs = (tokenizer, TokenCosts(tokenizer))
        return cached[1]

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        engine = await self._engine_or_abort(context, "GetModelInfo")
        return wire.model_info(engine.info)

    async def GetServerStats(
        self, request: pb.GetServerStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerStats:
        engine = await self._engine_or_abort(context, "GetServerStats")
        return wire.server_stats(engine.stats())

    async def _gate(self, context: grpc.aio.ServicerContext, method: str) -> TenantGate | None:
        """The call's tenant (None on a server without tenants); aborts the
        call UNAUTHENTICATED without a known bearer token. Every method calls
        it first (a test holds every method of the service to that)."""
        if self._tenants is None:
            return None
        try:
            header = authorization_header(context.invocation_metadata() or ())
            return self._tenants.gate(header)
        except Unauthenticated as exc:
            if self._telemetry is not None:
                self._telemetry.unauthenticated(method, context.peer(), str(exc))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    async def _engine_or_abort(self, context: grpc.aio.ServicerContext, method: str) -> Engine:
        await self._gate(context, method)
        try:
            return self._lifecycle.engine
        except NotServing as exc:
            await self._abort_not_serving(context, method, exc)

    async def _abort_not_serving(
        self, context: grpc.aio.ServicerContext, method: str, exc: NotServing
    ) -> None:
        """Ends a call refused while loading or draining, UNAVAILABLE: counted,
        logged and trailed with its reason, as a refused submit is."""
        rejection = rejection_for(exc)
        assert rejection is not None  # NotServing has its row in the table
        if self._telemetry is not None:
            self._telemetry.not_serving(method, context.peer(), rejection.reason_name, str(exc))
        trailers = ((REJECT_REASON_KEY, rejection.reason_name),)
        await context.abort(rejection.status, str(exc), trailing_metadata=trailers)


def _aborts_when_done(session: StreamSession) -> Callable[[object], None]:
    """A call's done callback that aborts ``session``'s requests. It holds the
    session weakly: grpc keeps the last call's callbacks until the next call
    comes, and an ended stream's buffers must go when it ends. (A session
    with requests in the engine is held by their callbacks.)"""
    ref = weakref.ref(session)

    def abort_all(_: object) -> None:
        if (alive := ref()) is not None:
            alive.abort_all()

    return abort_all


@contextlib.asynccontextmanager
async def _ends_quietly(session: StreamSession, method: str) -> AsyncIterator[None]:
    """Ends a streaming handler whose call ended under one of its writes
    (or its abort) as grpc ends a call it sees cancelled: CancelledError,
    which grpc logs at debug. The write fails so when the client cancelled
    or dropped the call, or its deadline passed, while the write waited on
    flow control (a client that stopped reading); grpc's own write loop
    (async generator handlers) logged an ERROR traceback for it,
    ``ExecuteBatchError raised in core``, unless it had seen the cancel
    first. The requests' own ends (CANCELLED) are logged as usual."""
    try:
        yield
    except grpc.aio.InternalError as exc:  # ExecuteBatchError: the call is gone in core
        log.debug("call_ended_while_writing", method=method, stream_id=session.stream_id)
        raise asyncio.CancelledError from exc


def _is_rejection(response: pb.GenerateResponse) -> bool:
    return (
        response.WhichOneof("event") == "finished"
        and response.finished.reason == pb.FINISH_REASON_REJECTED
    )


async def _abort_rejected(context: grpc.aio.ServicerContext, finished: pb.Finished) -> None:
    trailers = [(REJECT_REASON_KEY, reject_reason_name(finished.reject_reason))]
    if finished.retry_after_ms:
        trailers.append((RETRY_AFTER_KEY, str(finished.retry_after_ms)))
    code = grpc.StatusCode[finished.status_code]
    await context.abort(code, finished.message, trailing_metadata=tuple(trailers))


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """``add_InferenceServicer_to_server``, except that the frames of
    ``Generate`` and ``GenerateOne`` are parsed by ``wire``'s deserializers: a
    frame that does not parse reaches the handler as a ``BadFrame`` and ends
    its stream (or call) alone, INVALID_ARGUMENT."""
    recorder = _HandlerRecorder()
    pb_grpc.add_InferenceServicer_to_server(servicer, recorder)
    handlers = dict(recorder.handlers)
    handlers["Generate"] = handlers["Generate"]._replace(
        request_deserializer=wire.parse_generate_request
    )
    handlers["GenerateOne"] = handlers["GenerateOne"]._replace(
        request_deserializer=wire.parse_submit
    )
    service = pb.DESCRIPTOR.services_by_name["Inference"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


class _HandlerRecorder:
    """Stands in for a server to catch the generated code's method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, _handlers: object) -> None:
        pass

    def add_registered_method_handlers(
        self, _service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.handlers.update(handlers)


def _call_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's gRPC deadline as absolute ``time.monotonic()`` seconds."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining

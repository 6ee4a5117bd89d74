"""The requests of one ``Generate`` call and the hand-off of their events from
the engine thread to the call's asyncio task.

Engine thread                          event loop (this call)
  on_event(ev) ─▶ outbox.put(ev)         responses(): wait wakeup, drain outbox,
                 └─ one call_soon_threadsafe(wakeup.set) per burst, not per token

A request's tokens that are still unread when the next ones come are sent
with them, as one chunk: a reader that falls behind writes a response a
request, not a token (outbox.py says why).

Backpressure: when the client stops reading, ``yield`` in ``responses()``
stops returning and the outbox fills. At its bound (``Limits.max_outbox_*``)
the stream's requests are paused in the engine (not decoded, KV kept); when
the client has read half of it they resume. The bound holds for every
response, not only the engine's: an Accepted, a refusal or a cancel's
Finished counts too, and while the stream is paused its submits wait
unanswered (and, past ``MAX_WAITING_SUBMITS``, unread). A stream paused for
longer than ``Limits.slow_reader_grace_s`` has its requests cancelled
SLOW_READER and their unread chunks dropped.

Inbound: the reader never waits for a submit's prompt to be tokenized. It
queues each submit in ``_waiting`` and goes on reading; one admission task
per stream takes them in the order they came (a large prompt on the worker
pool, as before), so the stream's Accepted and refusal events keep the order
of its submits. A cancel acts at once: on a running request through the
engine, on a submit still waiting (or being tokenized) by finishing it
CANCELLED there and then; it is never admitted. A submit whose id names an
unfinished request, waiting or running, is refused DUPLICATE_REQUEST_ID in
its turn. While the waiting submits hold ``MAX_WAITING_SUBMITS`` or
``Limits.max_message_bytes``, the reader stops reading (HTTP/2 flow control
holds the client back, as a tokenization used to).

    reader ──submit──▶ _waiting ──▶ admission task: tokenize, admit or refuse
      └────cancel───▶ engine.abort (running) / finished CANCELLED (waiting)

Invariants: every request in ``_live`` has a Finished event still to come;
a request leaves ``_live`` only when its Finished event is drained on the
loop, so the dict is touched by the loop thread alone. A submit in
``_pending`` is waiting, has no event yet and will have exactly one
Finished; a submit leaves it when admitted, refused or cancelled. A call
that ends with submits still unanswered (waiting, or a ``GenerateOne``'s
prompt being tokenized) ends each as its turn would have been counted:
refused if its id alone refuses it, else CANCELLED, never admitted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from slipstream.scheduler.errors import DuplicateRequest
from slipstream.scheduler.request import FinishReason
from slipstream.service.api import wire
from slipstream.service.api.constraints import compile_constraint
from slipstream.service.api.limits import Limits
from slipstream.service.api.outbox import Outbox, event_bytes
from slipstream.service.api.status import Rejection, caller_message, rejection_for
from slipstream.service.engine.events import Event, EventCallback, FinishEvent, TokenEvent
from slipstream.service.telemetry.request_trace import Refusal
from slipstream.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from collections.abc import Sequence

    from slipstream.service.api.auth import TenantGate
    from slipstream.service.api.workers import WorkerPool
    from slipstream.service.engine.engine import Engine
    from slipstream.service.telemetry.tracing import Telemetry

log = structlog.get_logger(__name__)

# Why a request ends when its call does before it finished. grpc.aio tells
# the server nothing more: a caller's cancel, a dropped connection, a passed
# gRPC deadline and the connection closed at the end of
# --max-connection-age-grace-s all look the same (docs/operations.md), so the
# line names them all.
CALL_ENDED = (
    "the call ended before the request finished: cancelled or disconnected by the "
    "client, or its connection closed by the server"
)
# The same, for a submit the call never had answered (waiting behind others,
# paused, or its prompt still being tokenized).
CALL_ENDED_UNADMITTED = (
    "the call ended before it was admitted: cancelled or disconnected by the "
    "client, or its connection closed by the server"
)

_Item = tuple[str, Event] | pb.GenerateResponse

# A Batch response holds at most this many responses, and stops taking more
# once past this size (well under gRPC's default 4 MiB receive limit).
MAX_BATCH_RESPONSES = 512
MAX_BATCH_BYTES = 1 << 20
# The call metadata by which a Generate call asks for Batch responses.
BATCH_KEY = "slipstream-batch"
# Submits read but not yet admitted or refused, beyond which the reader stops
# reading (their bytes are bounded too, by Limits.max_message_bytes).
MAX_WAITING_SUBMITS = 256


def wants_batches(metadata: Sequence[tuple[str, str | bytes]]) -> bool:
    """Whether the call's metadata asks for ``Batch`` responses."""
    return any(key == BATCH_KEY and value == "1" for key, value in metadata)


class ProtocolViolation(Exception):
    """A client message that concerns the whole call (INVALID_ARGUMENT)."""


@dataclass(slots=True, eq=False)
class _Waiting:
    """A submit read from the stream, not yet admitted or refused."""

    submit: pb.Submit
    message: pb.GenerateRequest
    num_bytes: int
    is_duplicate: bool  # its id named an unfinished request when it was read
    read_at: float = field(default_factory=time.monotonic)
    is_cancelled: bool = False  # finished CANCELLED while waiting; never admitted


class StreamSession:
    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        call_deadline: float | None,
        telemetry: Telemetry | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        limits: Limits | None = None,
        workers: WorkerPool | None = None,
        gate: TenantGate | None = None,
    ) -> None:
        self._engine = engine
        self._limits = limits or Limits()
        self._workers = workers  # None: prompts are converted inline
        self._gate = gate  # the call's tenant, on a server with tenants
        self._telemetry = telemetry
        self._metadata = metadata  # the call's, for trace context
        self._loop = loop
        self._call_deadline = call_deadline
        self.stream_id = uuid.uuid4().hex
        self._live: dict[str, str] = {}  # client request id -> engine req_id
        # Submits in the order read; the first is the one being admitted.
        self._waiting: deque[_Waiting] = deque()
        self._waiting_bytes = 0
        self._pending: dict[str, _Waiting] = {}  # client request id -> its waiting submit
        self._admitting: asyncio.Task[None] | None = None
        self._has_room = asyncio.Event()  # set as waiting submits are answered
        # Set while the stream is not paused: its requests decode and its
        # waiting submits are answered.
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._failure: BaseException | None = None  # the admission task's, not the client's
        # Items are (client id, engine event) from the engine thread or
        # ready responses from the loop.
        self._outbox: Outbox[_Item] = Outbox(
            self._limits.max_outbox_events, self._limits.max_outbox_bytes
        )
        self._wakeup = asyncio.Event()
        self._wake_pending = False
        self._full_pending = False
        self._grace_timer: asyncio.TimerHandle | None = None
        self._is_closed = False  # the client half-closed its side
        self._is_ended = False  # the call ended; nothing more is submitted
        self.error: Exception | None = None

    # -- engine thread ----------------------------------------------------

    def _callback(self, request_id: str) -> EventCallback:
        def on_event(event: Event) -> None:
            # A request's unread tokens go out as one chunk (see outbox.py).
            merge = _merge_tokens if isinstance(event, TokenEvent) else None
            is_full = self._outbox.put((request_id, event), event_bytes(event), request_id, merge)
            if is_full and not (self._full_pending or self._is_paused):
                self._full_pending = True
                self._loop.call_soon_threadsafe(self._on_full)
            if not self._wake_pending:
                self._wake_pending = True
                self._loop.call_soon_threadsafe(self._wakeup.set)

        return on_event

    # -- loop: inbound ----------------------------------------------------

    async def read(self, requests: AsyncIterator[pb.GenerateRequest | wire.BadFrame]) -> None:
        """Consume the client's messages until it half-closes."""
        try:
            async for message in requests:
                if isinstance(message, wire.BadFrame):
                    raise ProtocolViolation(
                        f"a {message.num_bytes}-byte message does not parse as a "
                        f"slipstream.v1.GenerateRequest: {message.reason}"
                    )
                kind = message.WhichOneof("kind")
                if kind == "submit":
                    self._enqueue(message.submit, message)
                    while self._is_waiting_full():
                        self._has_room.clear()
                        await self._has_room.wait()
                elif kind == "cancel":
                    self.cancel(message.cancel.request_id)
                else:
                    raise ProtocolViolation("a message must be a submit or a cancel")
        except ProtocolViolation as exc:
            self.error = exc
        finally:
            self._is_closed = True
            self._wakeup.set()

    def _enqueue(self, submit: pb.Submit, message: pb.GenerateRequest) -> None:
        request_id = submit.request_id
        is_duplicate = request_id in self._live or request_id in self._pending
        waiting = _Waiting(submit, message, message.ByteSize(), is_duplicate)
        if not is_duplicate and self._is_valid_id(request_id):  # else refused in its turn
            self._pending[request_id] = waiting
        self._waiting.append(waiting)
        self._waiting_bytes += waiting.num_bytes
        if self._admitting is None:
            self._admitting = asyncio.create_task(self._admit_waiting())
            self._admitting.add_done_callback(self._admission_done)

    def _is_valid_id(self, request_id: str) -> bool:
        try:
            wire.check_request_id(request_id, self._limits.max_request_id_bytes)
        except ValueError:
            return False
        return True

    def _is_waiting_full(self) -> bool:
        return (
            len(self._waiting) >= MAX_WAITING_SUBMITS
            or self._waiting_bytes >= self._limits.max_message_bytes
        )

    async def _admit_waiting(self) -> None:
        """Admits or refuses the waiting submits one at a time, in the order
        they were read; a cancelled one is skipped (it has had its Finished).
        While the stream is paused none is answered: a client that does not
        read would otherwise have each answer buffered."""
        while self._waiting:
            waiting = self._waiting[0]
            if not waiting.is_cancelled:
                await self._unpaused.wait()
            if not waiting.is_cancelled:  # perhaps cancelled while paused
                await self.submit(waiting)
            self._waiting.popleft()
            self._waiting_bytes -= waiting.num_bytes
            if self._pending.get(waiting.submit.request_id) is waiting:
                del self._pending[waiting.submit.request_id]
            self._has_room.set()
        self._admitting = None

    def _admission_done(self, task: asyncio.Task[None]) -> None:
        # An error no rejection covers (a bug): the call fails with it, as a
        # request's would, instead of leaving the submits behind it unanswered.
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            self._wakeup.set()

    async def submit(self, waiting: _Waiting) -> None:
        """Admits ``waiting``'s submit or refuses it with a Finished event."""
        submit = waiting.submit
        try:
            self._check_id(waiting)
            wire.check_limits(waiting.message, submit, self._limits)
            await self._admit(waiting)
        except Exception as exc:
            rejection = rejection_for(exc)
            if rejection is None:
                raise
            if waiting.is_cancelled:
                return  # cancelled while it was tokenized: it has had its Finished
            detail = caller_message(exc)
            self._reject(submit.request_id, rejection, detail, exc)
            self._record_refusal(waiting, exc, rejection, detail)

    def _check_id(self, waiting: _Waiting) -> None:
        """Raises what refuses a submit by its id alone: invalid, or naming
        an unfinished request."""
        request_id = waiting.submit.request_id
        wire.check_request_id(request_id, self._limits.max_request_id_bytes)
        if request_id in self._live:
            raise DuplicateRequest(
                f"request_id {request_id!r} is already running on this stream; "
                "that request goes on, this submit is refused"
            )
        if waiting.is_duplicate:  # its namesake ended since
            raise DuplicateRequest(
                f"request_id {request_id!r} named an unfinished request on this "
                "stream when this submit came; this submit is refused"
            )

    def _record_refusal(
        self, waiting: _Waiting, exc: Exception, rejection: Rejection, detail: str
    ) -> None:
        """Traces, logs and counts a refused submit."""
        if self._telemetry is None:
            return
        submit = waiting.submit
        expired, retry_after_s = wire.refusal_hints(exc)
        refusal = Refusal(
            waiting.read_at,  # the wait behind the submits ahead of it shows
            wire.priority_of(submit, self._default_priority),
            None if expired is None else expired.name.lower(),
            retry_after_s,
        )
        self._telemetry.rejected(
            submit.request_id,
            rejection.reason_name,
            rejection.wire_status,
            detail,
            self._metadata,
            submit.trace_context,
            tenant="" if self._gate is None else self._gate.tenant.name,
            req_id=self.engine_id(submit.request_id),
            refusal=refusal,
        )

    @property
    def _is_paused(self) -> bool:
        """The stream's requests are held in the engine (read by its thread too)."""
        return not self._unpaused.is_set()

    @property
    def num_waiting(self) -> int:
        """Submits read and not yet admitted or refused (cancelled ones
        included until the admission task passes them)."""
        return len(self._waiting)

    @property
    def num_unread(self) -> int:
        """Responses queued for the client and not yet taken to send."""
        return len(self._outbox)

    def engine_id(self, request_id: str) -> str:
        """The engine's id for this stream's ``request_id`` (ids are per stream)."""
        return f"{self.stream_id}/{request_id}"

    @property
    def _default_priority(self) -> int:
        """The class of a submit that names none: the tenant's most urgent
        permitted one (``TenantGate.default_priority``), else 0."""
        return 0 if self._gate is None else self._gate.default_priority

    async def _admit(self, waiting: _Waiting) -> None:
        engine = self._engine
        submit, request_id = waiting.submit, waiting.submit.request_id
        convert = functools.partial(
            wire.to_generation_request,
            submit,
            self.engine_id(request_id),
            engine.tokenizer,
            engine.info,
            # Its clock (queue wait, deadline, span) starts when it was read,
            # not after the submits ahead of it on the stream were tokenized.
            waiting.read_at,
            self._call_deadline,
            self._default_priority,
        )
        # Tokenizing (or rendering) a large prompt would stall every stream
        # of the server: it goes to the worker pool. Submits of one stream
        # stay in order; the stream's other requests keep streaming, and its
        # cancels act, meanwhile.
        num_bytes = wire.prompt_bytes(submit)
        if self._workers is not None and num_bytes > self._limits.inline_prompt_bytes:
            request = await self._workers.run(convert, num_bytes)
            if self._is_ended or waiting.is_cancelled:
                return
        else:
            request = convert()
        if request.constraint is not None:  # compiled off the loop too (up to a second)
            grammar = await compile_constraint(engine, request.constraint, self._workers)
            if self._is_ended or (waiting is not None and waiting.is_cancelled):
                return
            request = dataclasses.replace(request, constraint=grammar)
        grant = None
        if self._gate is not None:  # PermissionDenied, QuotaExceeded: this request alone
            request, grant = self._gate.admit(request)
        on_event = self._callback(request_id)
        if grant is not None:
            on_event = grant.wrap(on_event)  # releases the tenant's quota on the finish
        # Accepted goes in first so it precedes any token the engine thread
        # may publish before submit() returns; withdrawn if submit raises.
        ack = wire.accepted(request_id, engine.num_waiting, len(request.prompt_token_ids))
        self._send(ack)
        if self._telemetry is not None:
            self._telemetry.begin(request, request_id, self._metadata, submit.trace_context)
        try:
            engine.submit(request, on_event)
        except Exception:
            if grant is not None:
                grant.release()
            self._outbox.remove(ack)
            if self._telemetry is not None:
                self._telemetry.abandon(request.req_id)
            raise
        self._live[request_id] = request.req_id
        if self._is_paused:
            engine.pause((request.req_id,))
            if self._grace_timer is None:
                self._arm_grace()

    def _reject(
        self, request_id: str, rejection: Rejection, message: str, error: Exception | None = None
    ) -> None:
        reason, status = rejection.reject_reason, rejection.status.name
        self._send(wire.rejected(request_id, reason, status, message, error))

    def _send(self, response: pb.GenerateResponse) -> None:
        """Queues a response made on the loop; it counts against the stream's
        unread bound as an engine event does."""
        if self._outbox.put(response, response.ByteSize()):
            self._on_full()
        self._wakeup.set()

    async def submit_one(self, submit: pb.Submit) -> None:
        """The whole inbound side of a ``GenerateOne`` call: one submit, then
        closed, so ``responses()`` ends when that request has finished. The
        submit waits in ``_waiting`` until answered, so that a call ending
        under its tokenization finishes it (``abort_all``)."""
        self._is_closed = True
        waiting = _Waiting(submit, pb.GenerateRequest(), 0, is_duplicate=False)
        self._waiting.append(waiting)
        await self.submit(waiting)
        self._waiting.remove(waiting)  # answered: admitted, or refused with its Finished

    def cancel(self, request_id: str) -> None:
        req_id = self._live.get(request_id)
        if req_id is not None:
            self._engine.abort(req_id)
        elif (waiting := self._pending.pop(request_id, None)) is not None:
            self._cancel_waiting(request_id, waiting)

    def _cancel_waiting(self, request_id: str, waiting: _Waiting) -> None:
        """Finishes a submit that has not been admitted yet: CANCELLED now,
        never admitted (a tokenization under way runs out unused); traced,
        logged and counted like any cancelled request."""
        event = self._finish_unadmitted(waiting, "cancelled before it was admitted")
        # A ready response, not an engine event: draining it must not take
        # from ``_live`` a later request that reuses the id.
        self._send(wire.finished(request_id, event))

    def _finish_unadmitted(self, waiting: _Waiting, message: str) -> FinishEvent:
        """Ends a submit never admitted CANCELLED with ``message``: traced,
        logged and counted, its whole wait its queue wait; returns its event."""
        waiting.is_cancelled = True
        submit = waiting.submit
        waited_s = time.monotonic() - waiting.read_at
        event = FinishEvent(
            self.engine_id(submit.request_id),
            FinishReason.CANCELLED,
            message,
            queue_wait_s=waited_s,
            total_s=waited_s,
            priority=wire.priority_of(submit, self._default_priority),
        )
        if self._telemetry is not None:
            self._telemetry.unadmitted(
                event,
                submit.request_id,
                waiting.read_at,
                self._metadata,
                submit.trace_context,
                tenant="" if self._gate is None else self._gate.tenant.name,
            )
        return event

    def abort_all(self) -> None:
        """Abort every unfinished request (the call ended early), and end
        every submit not yet answered (``_end_unanswered``). Idempotent."""
        self._is_ended = True
        if self._admitting is not None:
            self._admitting.cancel()
        self._end_unanswered()
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        for req_id in self._live.values():
            self._engine.abort(req_id, message=CALL_ENDED)

    def _end_unanswered(self) -> None:
        """Ends the submits the call took and never answered, as their turn
        would have been counted: one its id alone refuses (invalid, a
        duplicate) is refused; any other is CANCELLED, never admitted (the
        one being tokenized too: its tokenization runs out unused). Nothing
        is sent: the call is over. (A duplicate ended CANCELLED would share
        its engine id with the running request it names.)"""
        self._pending.clear()  # a cancel read from here on finds nothing waiting
        for waiting in self._waiting:
            if waiting.is_cancelled:
                continue  # it has had its Finished
            try:
                self._check_id(waiting)
            except (ValueError, DuplicateRequest) as exc:
                waiting.is_cancelled = True
                rejection = rejection_for(exc)
                assert rejection is not None  # both have their rows in the table
                self._record_refusal(waiting, exc, rejection, caller_message(exc))
                continue
            self._finish_unadmitted(waiting, CALL_ENDED_UNADMITTED)

    # -- loop: backpressure -------------------------------------------------

    def _on_full(self) -> None:
        self._full_pending = False
        if self._is_paused or self._is_ended or not self._outbox.is_full:
            return
        self._unpaused.clear()
        self._engine.pause(self._live.values())
        self._arm_grace()
        log.debug(
            "stream_paused",
            stream_id=self.stream_id,
            buffered_events=len(self._outbox),
            buffered_bytes=self._outbox.num_bytes,
        )

    def _arm_grace(self) -> None:
        self._grace_timer = self._loop.call_later(
            self._limits.slow_reader_grace_s, self._cancel_unread
        )

    def _resume(self) -> None:
        self._unpaused.set()
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        self._engine.resume(self._live.values())
        log.debug("stream_resumed", stream_id=self.stream_id)

    def _cancel_unread(self) -> None:
        """The grace is over: cancel the stream's requests and drop their
        unread chunks; their Finished events still go out."""
        self._grace_timer = None
        victims = dict(self._live)
        if not victims:
            return
        grace = self._limits.slow_reader_grace_s
        for req_id in victims.values():
            self._engine.abort(
                req_id,
                FinishReason.SLOW_READER,
                f"the client did not read its events for {grace:g} s",
            )
        num_dropped = self._outbox.drop(
            lambda item: (
                isinstance(item, tuple) and item[0] in victims and isinstance(item[1], TokenEvent)
            )
        )
        log.warning(
            "slow_reader_cancelled",
            stream_id=self.stream_id,
            num_requests=len(victims),
            dropped_events=num_dropped,
            grace_s=grace,
        )

    # -- loop: outbound ---------------------------------------------------

    async def responses(self, batches: bool = False) -> AsyncIterator[pb.GenerateResponse]:
        """Responses in order until the client has half-closed and every
        request has finished, or a protocol violation (see ``error``).
        ``batches``: whatever is waiting goes out as one ``Batch`` response
        (up to ``MAX_BATCH_RESPONSES`` or about ``MAX_BATCH_BYTES``)."""
        while True:
            # Clear before draining: an event appended after this point
            # schedules a fresh wakeup, one appended before is drained below.
            self._wake_pending = False
            self._wakeup.clear()
            while (item := self._outbox.pop()) is not None:
                response = self._to_response(item)
                if batches:
                    response = self._batched(response)
                if self._is_paused and self._outbox.is_drained:
                    self._resume()
                yield response
            if self._is_paused:
                self._resume()
            if self._failure is not None:
                raise self._failure
            if self.error is not None or (self._is_closed and self._is_answered()):
                return
            await self._wakeup.wait()

    def _is_answered(self) -> bool:
        """Every submit read so far has had its Finished event."""
        return not self._live and all(w.is_cancelled for w in self._waiting)

    def _batched(self, first: pb.GenerateResponse) -> pb.GenerateResponse:
        """``first`` and the responses waiting behind it, as one (``first``
        alone when nothing waits)."""
        batch, size = [first], first.ByteSize()
        while len(batch) < MAX_BATCH_RESPONSES and size < MAX_BATCH_BYTES:
            item = self._outbox.pop()
            if item is None:
                break
            response = self._to_response(item)
            batch.append(response)
            size += response.ByteSize()
        if len(batch) == 1:
            return first
        return pb.GenerateResponse(batch=pb.Batch(responses=batch))

    def _to_response(self, item: _Item) -> pb.GenerateResponse:
        if isinstance(item, pb.GenerateResponse):
            return item
        request_id, event = item
        if isinstance(event, FinishEvent):
            self._live.pop(request_id, None)
            return wire.finished(request_id, event)
        return wire.token_chunk(request_id, event)


def _merge_tokens(earlier: _Item, later: _Item) -> _Item | None:
    """One request's unread token event and its next, as one event: the ids
    and text of both, the first one's index, step and batch (None: not two
    consecutive token events)."""
    if not (isinstance(earlier, tuple) and isinstance(later, tuple)):
        return None
    first, then = earlier[1], later[1]
    if not (isinstance(first, TokenEvent) and isinstance(then, TokenEvent)):
        return None
    if then.index != first.index + len(first.token_ids):
        return None
    if (first.logprobs is None) != (then.logprobs is None):
        return None  # never here (a request asks for every token or none); kept aligned
    logprobs = None if first.logprobs is None else first.logprobs + (then.logprobs or [])
    merged = first._replace(
        token_ids=first.token_ids + then.token_ids, text=first.text + then.text, logprobs=logprobs
    )
    return earlier[0], merged

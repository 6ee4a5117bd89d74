"""The requests of one ``Generate`` call and the hand-off of their events from
the engine thread to the call's asyncio task.

Engine thread                          event loop (this call)
  on_event(ev) ─▶ outbox.append(ev)      responses(): wait wakeup, drain outbox,
                 └─ one call_soon_threadsafe(wakeup.set) per burst, not per token

Invariants: every request in ``_live`` has a Finished event still to come;
a request leaves ``_live`` only when its Finished event is drained on the
loop, so the dict is touched by the loop thread alone.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from slipstream.scheduler.errors import DuplicateRequest
from slipstream.service.api import wire
from slipstream.service.api.status import Rejection, rejection_for
from slipstream.service.engine.events import Event, EventCallback, FinishEvent
from slipstream.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from collections.abc import Sequence

    from slipstream.service.api.auth import TenantGate
    from slipstream.service.engine.engine import Engine
    from slipstream.service.telemetry.tracing import Telemetry


class ProtocolViolation(Exception):
    """A client message that concerns the whole call (INVALID_ARGUMENT)."""


class StreamSession:
    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        call_deadline: float | None,
        telemetry: Telemetry | None = None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
        gate: TenantGate | None = None,
    ) -> None:
        self._engine = engine
        self._gate = gate  # the call's tenant, on a server with tenants
        self._telemetry = telemetry
        self._metadata = metadata  # the call's, for trace context
        self._loop = loop
        self._call_deadline = call_deadline
        self.stream_id = uuid.uuid4().hex
        self._live: dict[str, str] = {}  # client request id -> engine req_id
        # Items are (client id, engine event) from the engine thread or
        # ready responses from the loop; deque appends are thread-safe.
        self._outbox: deque[tuple[str, Event] | pb.GenerateResponse] = deque()
        self._wakeup = asyncio.Event()
        self._wake_pending = False
        self._is_closed = False  # the client half-closed its side
        self.error: Exception | None = None

    # -- engine thread ----------------------------------------------------

    def _callback(self, request_id: str) -> EventCallback:
        def on_event(event: Event) -> None:
            self._outbox.append((request_id, event))
            if not self._wake_pending:
                self._wake_pending = True
                self._loop.call_soon_threadsafe(self._wakeup.set)

        return on_event

    # -- loop: inbound ----------------------------------------------------

    async def read(self, requests: AsyncIterator[pb.GenerateRequest]) -> None:
        """Consume the client's messages until it half-closes."""
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "submit":
                    self.submit(message.submit)
                elif kind == "cancel":
                    self.cancel(message.cancel.request_id)
                else:
                    raise ProtocolViolation("a message must be a submit or a cancel")
        except ProtocolViolation as exc:
            self.error = exc
        finally:
            self._is_closed = True
            self._wakeup.set()

    def submit(self, submit: pb.Submit) -> None:
        request_id = submit.request_id
        try:
            wire.check_request_id(request_id)
            if request_id in self._live:
                raise DuplicateRequest(f"request_id {request_id!r} is already running")
            self._admit(submit, request_id)
        except Exception as exc:
            rejection = rejection_for(exc)
            if rejection is None:
                raise
            self._reject(request_id, rejection, str(exc), exc)
            if self._telemetry is not None:
                self._telemetry.rejected(
                    request_id,
                    rejection.reason_name,
                    rejection.wire_status,
                    str(exc),
                    self._metadata,
                    submit.trace_context,
                    tenant="" if self._gate is None else self._gate.tenant.name,
                )

    def _admit(self, submit: pb.Submit, request_id: str) -> None:
        engine = self._engine
        request = wire.to_generation_request(
            submit,
            f"{self.stream_id}/{request_id}",
            engine.tokenizer,
            engine.info,
            time.monotonic(),
            self._call_deadline,
        )
        grant = None
        if self._gate is not None:  # PermissionDenied, QuotaExceeded: this request alone
            request, grant = self._gate.admit(request)
        on_event = self._callback(request_id)
        if grant is not None:
            on_event = grant.wrap(on_event)  # releases the tenant's quota on the finish
        # Accepted goes in first so it precedes any token the engine thread
        # may publish before submit() returns; withdrawn if submit raises.
        ack = wire.accepted(request_id, engine.stats().waiting, len(request.prompt_token_ids))
        self._outbox.append(ack)
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
        self._wakeup.set()

    def _reject(
        self, request_id: str, rejection: Rejection, message: str, error: Exception | None = None
    ) -> None:
        self._outbox.append(
            wire.rejected(
                request_id, rejection.reject_reason, rejection.status.name, message, error
            )
        )
        self._wakeup.set()

    def submit_one(self, submit: pb.Submit) -> None:
        """The whole inbound side of a ``GenerateOne`` call: one submit, then
        closed, so ``responses()`` ends when that request has finished."""
        self._is_closed = True
        self.submit(submit)

    def cancel(self, request_id: str) -> None:
        req_id = self._live.get(request_id)
        if req_id is not None:
            self._engine.abort(req_id)

    def abort_all(self) -> None:
        """Abort every unfinished request (the call ended early). Idempotent."""
        for req_id in self._live.values():
            self._engine.abort(req_id, message="the stream ended")

    # -- loop: outbound ---------------------------------------------------

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        """Responses in order until the client has half-closed and every
        request has finished, or a protocol violation (see ``error``)."""
        while True:
            # Clear before draining: an event appended after this point
            # schedules a fresh wakeup, one appended before is drained below.
            self._wake_pending = False
            self._wakeup.clear()
            while self._outbox:
                yield self._to_response(self._outbox.popleft())
            if self.error is not None or (self._is_closed and not self._live):
                return
            await self._wakeup.wait()

    def _to_response(self, item: tuple[str, Event] | pb.GenerateResponse) -> pb.GenerateResponse:
        if isinstance(item, pb.GenerateResponse):
            return item
        request_id, event = item
        if isinstance(event, FinishEvent):
            self._live.pop(request_id, None)
            return wire.finished(request_id, event)
        return wire.token_chunk(request_id, event)

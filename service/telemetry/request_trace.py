"""One span per request, tagged at token granularity, and its log lines.

The request span (``{gen_ai.operation.name} {gen_ai.request.model}``, kind
SERVER) starts when the submit arrives, as the child of the caller's
context, and ends when the request finishes::

    text_completion small                         gen_ai.*, slipstream.*
    ├─ slipstream.queue          arrival → first scheduled
    ├─ slipstream.prefill        one per prefill chunk (step, batch, positions,
    │                            tokens found cached), and one per resume after a
    │                            recompute, however few tokens it computes
    ├─ slipstream.preempted      preemption → resume (kind swap | recompute)
    ├─ slipstream.decode         first token → finish
    └─ events: slipstream.scheduled, slipstream.preempt, slipstream.resume,
               slipstream.token × one per generated token

Cost model: the engine thread only appends plain tuples per step
(``on_step``) and hands a finished request over in one queue put
(``on_finish``); the ``slipstream-trace`` thread builds its spans, events and
log line, mostly while the engine thread runs a forward pass without the
GIL, and the batch processor's thread exports them. Sampled-out and
untraced requests are not tracked per step at all. Names of the ``slipstream.token`` event and
its attributes are a contract: dashboards and queries are built on them.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

from slipstream.scheduler.request import FinishReason, RejectCause, Request
from slipstream.service.engine.observer import preemption_kind

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from slipstream.scheduler.plan import RequestOutput, ScheduledSeq, StepPlan
    from slipstream.service.engine.engine import Engine
    from slipstream.service.engine.events import FinishEvent, RequestSpec

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class WireStatus:
    """The gRPC status a request ends with, as the API's status table maps it.

    Telemetry records it on spans but never decides it: the table lives in
    ``service/api/status.py`` and is handed in (``RequestTracer.finish_status``).
    """

    name: str  # "OK", "CANCELLED", ...
    code: int


FinishStatus = Callable[["FinishEvent"], WireStatus]

OPERATION = "text_completion"
PROVIDER = "slipstream"
TOKEN_EVENT = "slipstream.token"
# The reason of a request the scheduler rejected with no cause given.
ENGINE_REJECTION = "scheduler"


def rejection_label(cause: RejectCause | None) -> str:
    """Why the scheduler rejected a request it had queued, as a label: the
    wire's reject reason name (``shed``, ``deadline_infeasible``), as a refusal
    at the door is labelled (``queue_full``) in logs, spans and metrics."""
    return ENGINE_REJECTION if cause is None else cause.name.lower()


@dataclass(slots=True)
class _Preemption:
    """One preemption of a traced request: when and at which step it was
    pushed out, and when and at which step it was scheduled again (None
    while still preempted)."""

    at: float
    step: int
    kind: str
    blocks: int
    resumed: float | None = None
    resume_step: int | None = None

    def attributes(self) -> dict[str, str | int]:
        """The ``slipstream.preempted`` span's and ``slipstream.preempt``
        event's attributes: one set of names for both."""
        return {
            "slipstream.preemption.kind": self.kind,
            "slipstream.preemption.swapped_blocks": self.blocks,
            "slipstream.step": self.step,
        }


class _Prefill(NamedTuple):
    """One prefill chunk of a traced request: its step's times, step and
    batch size, the positions it computed, and how many tokens before them
    admission found in the prefix cache (0 for a chunk that continues one)."""

    start: float
    end: float
    step: int
    size: int
    start_pos: int
    num_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class _Timeline:
    """What happened to one traced request, as plain values (engine thread).

    ``queue_wait_s`` is the wait before first being scheduled plus every
    completed wait while preempted; ``waiting_since`` is set while the
    request is not scheduled (queued or preempted)."""

    span: Span
    arrival: float
    num_prompt_tokens: int
    state: Request | None = None
    waiting_since: float | None = None
    first_scheduled: float | None = None
    queue_wait_s: float = 0.0
    preempt_kind: str = ""
    swapped_bytes: int = 0
    prefills: list[_Prefill] = field(default_factory=list)
    preemptions: list[_Preemption] = field(default_factory=list)
    tokens: list[tuple[float, int, int, float]] = field(default_factory=list)

    def scheduled(self, seq: ScheduledSeq, step: int, size: int, start: float, end: float) -> None:
        # Admitted (first, or again after a recompute preemption): its prefill
        # starts at its first uncached token, and has a span even when the
        # prefix cache held all but the one token a decode step would compute.
        is_admitted = False
        if self.waiting_since is not None:
            if self.first_scheduled is None:
                self.first_scheduled = start
                is_admitted = True
            elif self.preemptions:
                pause = self.preemptions[-1]
                pause.resumed, pause.resume_step = start, step
                is_admitted = pause.kind == "recompute"
            self.queue_wait_s += start - self.waiting_since
            self.waiting_since = None
        # A decode with drafts is no prefill: its one known token and drafts.
        num_known = len(seq.token_ids) - seq.num_drafts
        if is_admitted or num_known > 1 or seq.start_pos < self.num_prompt_tokens:
            cached = seq.start_pos if is_admitted else 0
            self.prefills.append(
                _Prefill(start, end, step, size, seq.start_pos, len(seq.token_ids), cached)
            )

    def preempted(self, step: int, at: float, bytes_per_block: int) -> None:
        kind = "recompute" if self.state is None else preemption_kind(self.state)
        blocks = len(self.state.host_block_ids) if kind == "swap" and self.state else 0
        self.swapped_bytes += blocks * bytes_per_block
        self.preemptions.append(_Preemption(at, step, kind, blocks))
        self.waiting_since = at


@dataclass(frozen=True, slots=True)
class Refusal:
    """What is known of a submit refused at the door: when it arrived
    (monotonic seconds), its priority class, the time limit it cannot meet
    (``deadline``, ``first_token``) and the retry hint it was given."""

    arrival: float | None = None
    priority: int | None = None
    expired_limit: str | None = None
    retry_after_s: float | None = None

    def log_fields(self) -> dict[str, str | int]:
        fields = _limit_fields(self.expired_limit, self.retry_after_s)
        if self.priority is not None:
            fields["priority"] = self.priority
        return fields


@dataclass(frozen=True, slots=True)
class _Finished:
    """A request handed from the engine thread to the trace thread; ``at``
    is when it ended (monotonic seconds)."""

    event: FinishEvent
    timeline: _Timeline | None
    client_request_id: str
    context: SpanContext | None
    at: float
    tenant: str = ""


class RequestTracer:
    """The engine observer that traces requests and writes their log lines."""

    def __init__(self, tracer: Tracer, model: str = "unknown", bytes_per_block: int = 0) -> None:
        self._tracer = tracer
        self._model = model
        self._bytes_per_block = bytes_per_block  # of KV, for slipstream.swapped_bytes
        # Set by the API when it serves (its status table); None: no gRPC status on spans.
        self.finish_status: FinishStatus | None = None
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._timelines: dict[str, _Timeline] = {}  # recording spans only
        # Every begun request: (client request id, log context, tenant).
        self._contexts: dict[str, tuple[str, SpanContext | None, str]] = {}
        self._finished: queue.SimpleQueue[_Finished | threading.Event | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()

    def bind_engine(self, engine: Engine) -> None:
        self._model = engine.info.name
        self._bytes_per_block = engine.info.kv_bytes_per_block

    def _wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    # -- event loop ---------------------------------------------------------

    def begin(self, request: RequestSpec, client_request_id: str, parent: Context) -> None:
        arrival = request.arrival_time if request.arrival_time is not None else time.monotonic()
        span = self._tracer.start_span(
            f"{OPERATION} {self._model}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self._wall_ns(arrival),
            attributes=self._request_attributes(request, client_request_id, arrival),
        )
        self._contexts[request.req_id] = (
            client_request_id,
            _log_context(span, parent),
            request.tenant,
        )
        if span.is_recording():
            self._timelines[request.req_id] = _Timeline(
                span, arrival, len(request.prompt_token_ids), waiting_since=arrival
            )

    def unadmitted(
        self,
        event: FinishEvent,
        client_request_id: str,
        arrival: float,
        parent: Context,
        tenant: str = "",
    ) -> None:
        """Records a request that finished before the engine took it (cancelled
        while its prompt was tokenized) as one that waited its whole life: its
        span, queued from ``arrival`` to its end, and its ``request_finished``
        line, like any cancelled request's."""
        span = self._unadmitted_span(
            parent,
            arrival,
            tenant,
            {
                "slipstream.request.id": event.req_id,
                "slipstream.request.client_id": client_request_id,
                "slipstream.request.priority": event.priority,
            },
        )
        timeline = None
        if span.is_recording():
            timeline = _Timeline(span, arrival, 0, waiting_since=arrival)
        context = _log_context(span, parent)
        self._start_worker()
        self._finished.put(
            _Finished(event, timeline, client_request_id, context, time.monotonic(), tenant)
        )

    def _unadmitted_span(
        self,
        parent: Context,
        arrival: float,
        tenant: str,
        attributes: dict[str, str | int | tuple[str, ...]],
    ) -> Span:
        """The request span of a submit the engine never took, from its arrival."""
        tenant_attributes = {"slipstream.tenant": tenant} if tenant else {}
        return self._tracer.start_span(
            f"{OPERATION} {self._model}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self._wall_ns(arrival),
            attributes={**_base_attributes(self._model), **attributes, **tenant_attributes},
        )

    def abandon(self, req_id: str) -> None:
        # The span is never ended, so it is never exported; the rejection
        # that follows gets its own span.
        self._timelines.pop(req_id, None)
        self._contexts.pop(req_id, None)

    def rejected(
        self,
        client_request_id: str,
        reason: str,
        status: WireStatus,
        message: str,
        parent: Context,
        tenant: str = "",
        req_id: str = "",
        refusal: Refusal | None = None,
    ) -> str:
        """Records a submit refused before the engine took it (``reason``, e.g.
        ``queue_full``); returns the reason as a metric label. Its log line
        names it as ``request_finished`` lines do: ``request_id`` the server's
        id (``req_id``, else the caller's), ``client_request_id`` the caller's;
        ``refusal`` adds what is known of it (its span then starts at its
        arrival, so the time spent before the refusal shows)."""
        refusal = refusal or Refusal()
        known: dict[str, str | int] = {}
        if req_id:
            known["slipstream.request.id"] = req_id
        if refusal.priority is not None:
            known["slipstream.request.priority"] = refusal.priority
        now = time.monotonic()
        arrival = now if refusal.arrival is None else refusal.arrival
        span = self._unadmitted_span(
            parent,
            arrival,
            tenant,
            {
                **known,
                "slipstream.request.client_id": client_request_id,
                "slipstream.rejection.reason": reason,
                "gen_ai.response.finish_reasons": ("rejected",),
                "rpc.grpc.status_code": status.code,
            },
        )
        span.set_status(Status(StatusCode.ERROR, f"{status.name}: {message}"))
        span.end(end_time=self._wall_ns(now))
        log.info(
            "request_rejected",
            request_id=req_id or client_request_id,
            client_request_id=client_request_id,
            reason=reason,
            detail=message,
            **refusal.log_fields(),
            total_ms=round((now - arrival) * 1e3, 3),
            **({"tenant": tenant} if tenant else {}),
            **_ids(_log_context(span, parent)),
        )
        return reason

    def _request_attributes(
        self, request: RequestSpec, client_request_id: str, arrival: float
    ) -> dict[str, str | int | float | bool]:
        sampling = request.sampling
        attributes: dict[str, str | int | float | bool] = {
            **_base_attributes(self._model),
            "gen_ai.request.max_tokens": request.max_new_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": sampling.top_k,
            "gen_ai.response.id": request.req_id,
            "gen_ai.response.model": self._model,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "slipstream.request.id": request.req_id,
            "slipstream.request.client_id": client_request_id,
            "slipstream.request.priority": request.priority,
        }
        if sampling.seed is not None:
            attributes["gen_ai.request.seed"] = sampling.seed
        if request.tenant:
            attributes["slipstream.tenant"] = request.tenant
        if request.deadline is not None:
            attributes["slipstream.request.deadline_ms"] = (request.deadline - arrival) * 1e3
        if request.expected_output_tokens is not None:
            attributes["slipstream.request.expected_tokens"] = request.expected_output_tokens
        return attributes

    # -- engine thread (EngineObserver) -----------------------------------

    def on_submit(self, request: RequestSpec, state: Request) -> None:
        timeline = self._timelines.get(request.req_id)
        if timeline is not None:
            timeline.state = state

    def on_step(
        self, plan: StepPlan, outputs: list[RequestOutput], started: float, ended: float
    ) -> None:
        timelines = self._timelines
        if not timelines:
            return
        for req_id in plan.preempted_req_ids:
            timeline = timelines.get(req_id)
            if timeline is not None:
                timeline.preempted(plan.step, started, self._bytes_per_block)
        size = len(plan.seqs)
        for seq in plan.seqs:
            timeline = timelines.get(seq.req_id)
            if timeline is not None:
                timeline.scheduled(seq, plan.step, size, started, ended)
        for out in outputs:
            timeline = timelines.get(out.req_id)
            if timeline is not None and out.new_token_ids:
                token = (ended, plan.step, size, timeline.queue_wait_s * 1e3)
                timeline.tokens.extend([token] * len(out.new_token_ids))

    def on_finish(self, event: FinishEvent) -> None:
        timeline = self._timelines.pop(event.req_id, None)
        client_request_id, context, tenant = self._contexts.pop(event.req_id, ("", None, ""))
        self._start_worker()
        self._finished.put(
            _Finished(event, timeline, client_request_id, context, time.monotonic(), tenant)
        )

    # -- the slipstream-trace thread ----------------------------------------

    def _start_worker(self) -> None:
        if self._worker is None:
            with self._worker_lock:
                if self._worker is None:
                    self._worker = threading.Thread(
                        target=self._drain, name="slipstream-trace", daemon=True
                    )
                    self._worker.start()

    def _drain(self) -> None:
        while (item := self._finished.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._record(item)
            except Exception:  # a tracing bug must not stop the next request's trace
                log.exception("request_trace_failed", request_id=item.event.req_id)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every request finished so far is recorded."""
        if self._worker is None:
            return True
        done = threading.Event()
        self._finished.put(done)
        return done.wait(timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Records what is queued, then stops the thread."""
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._finished.put(None)
            worker.join(timeout)

    def _record(self, finished: _Finished) -> None:
        event, context = finished.event, finished.context
        if finished.timeline is not None:
            self._end(finished.timeline, event, finished.at)
        tenant = {"tenant": finished.tenant} if finished.tenant else {}
        if event.reason is FinishReason.REJECTED:
            # Rejected after queueing (shed, deadline infeasible): the same line
            # as a refusal at the door, with how long it waited for it.
            log.info(
                "request_rejected",
                request_id=event.req_id,
                client_request_id=finished.client_request_id,
                reason=rejection_label(event.reject_cause),
                detail=event.message,
                **_limits(event),
                priority=event.priority,
                prompt_tokens=event.num_prompt_tokens,
                queue_wait_ms=round(event.queue_wait_s * 1e3, 3),
                total_ms=round(event.total_s * 1e3, 3),
                **tenant,
                **_ids(context),
            )
            return
        # queue_wait_ms is arrival to first scheduled (as Finished.timings says);
        # preempted_ms the waits after that, which the span's queue.wait_ms adds in.
        # Only an outcome other than OK has a message (why it ended) and perhaps
        # the time limit that ended it.
        log.info(
            "request_finished",
            request_id=event.req_id,
            client_request_id=finished.client_request_id,
            reason=event.reason.name.lower(),
            **({"message": event.message} if event.message else {}),
            **_limits(event),
            priority=event.priority,
            prompt_tokens=event.num_prompt_tokens,
            cached_tokens=event.num_cached_tokens,
            output_tokens=event.num_output_tokens,
            queue_wait_ms=round(event.queue_wait_s * 1e3, 3),
            ttft_ms=None if event.ttft_s is None else round(event.ttft_s * 1e3, 3),
            total_ms=round(event.total_s * 1e3, 3),
            preemptions=event.num_preemptions,
            preempted_ms=round(event.preempted_s * 1e3, 3),
            held_back_steps=event.num_held_back,
            **tenant,
            **_ids(context),
        )

    # -- building the spans (once per request) ----------------------------

    def _end(self, timeline: _Timeline, event: FinishEvent, now: float) -> None:
        span = timeline.span
        parent = trace.set_span_in_context(span)
        if timeline.waiting_since is not None:  # still queued or preempted at the end
            timeline.queue_wait_s += now - timeline.waiting_since
        self._child_spans(timeline, parent, now)
        self._events(timeline)
        status = self.finish_status(event) if self.finish_status is not None else None
        span.set_attributes(
            {
                "gen_ai.response.finish_reasons": (event.reason.name.lower(),),
                "gen_ai.usage.output_tokens": event.num_output_tokens,
                "slipstream.preemptions": event.num_preemptions,
                "slipstream.held_back_steps": event.num_held_back,
                "slipstream.swapped_bytes": timeline.swapped_bytes,
                "slipstream.queue.wait_ms": timeline.queue_wait_s * 1e3,
            }
        )
        if status is not None:
            span.set_attribute("rpc.grpc.status_code", status.code)
        if event.ttft_s is not None:
            span.set_attribute("slipstream.ttft_ms", event.ttft_s * 1e3)
        if event.reason is FinishReason.REJECTED:  # the label; the text is in the status
            span.set_attribute("slipstream.rejection.reason", rejection_label(event.reject_cause))
        if status is not None and status.name != "OK":
            detail = f"{status.name}: {event.message}" if event.message else status.name
            span.set_status(Status(StatusCode.ERROR, detail))
        span.end(end_time=self._wall_ns(now))

    def _child(
        self,
        name: str,
        parent: Context,
        start: float,
        end: float,
        attributes: dict[str, str | int] | None = None,
    ) -> None:
        span = self._tracer.start_span(
            name, context=parent, start_time=self._wall_ns(start), attributes=attributes
        )
        span.end(end_time=self._wall_ns(end))

    def _child_spans(self, timeline: _Timeline, parent: Context, now: float) -> None:
        first = timeline.first_scheduled
        self._child("slipstream.queue", parent, timeline.arrival, now if first is None else first)
        for chunk in timeline.prefills:
            self._child(
                "slipstream.prefill",
                parent,
                chunk.start,
                chunk.end,
                {
                    "slipstream.step": chunk.step,
                    "slipstream.batch.id": chunk.step,
                    "slipstream.batch.size": chunk.size,
                    "slipstream.prefill.start_pos": chunk.start_pos,
                    "slipstream.prefill.num_tokens": chunk.num_tokens,
                    "slipstream.prefill.cached_tokens": chunk.num_cached_tokens,
                },
            )
        for pause in timeline.preemptions:
            self._child(
                "slipstream.preempted",
                parent,
                pause.at,
                now if pause.resumed is None else pause.resumed,
                pause.attributes(),
            )
        if timeline.tokens:
            self._child("slipstream.decode", parent, timeline.tokens[0][0], now)

    def _events(self, timeline: _Timeline) -> None:
        span, wall = timeline.span, self._wall_ns
        if timeline.first_scheduled is not None:
            span.add_event(
                "slipstream.scheduled",
                {"slipstream.queue.wait_ms": (timeline.first_scheduled - timeline.arrival) * 1e3},
                wall(timeline.first_scheduled),
            )
        for pause in timeline.preemptions:
            span.add_event("slipstream.preempt", pause.attributes(), wall(pause.at))
            if pause.resumed is not None and pause.resume_step is not None:
                # The step it rejoined, to join with that step's slipstream.batch.id.
                resume = {
                    "slipstream.preemption.kind": pause.kind,
                    "slipstream.step": pause.resume_step,
                }
                span.add_event("slipstream.resume", resume, wall(pause.resumed))
        add_event = span.add_event
        for index, (at, step, size, wait_ms) in enumerate(timeline.tokens):
            add_event(
                TOKEN_EVENT,
                {
                    "slipstream.token.index": index,
                    "slipstream.batch.id": step,
                    "slipstream.batch.size": size,
                    "slipstream.step": step,
                    "slipstream.queue.wait_ms": wait_ms,
                },
                wall(at),
            )


def _limits(event: FinishEvent) -> dict[str, str | int]:
    """The time limit that ended a request and the retry hint it was given,
    where it has them (as ``Finished.expired_limit`` / ``retry_after_ms``)."""
    limit = event.expired_limit
    return _limit_fields(None if limit is None else limit.name.lower(), event.retry_after_s)


def _limit_fields(expired_limit: str | None, retry_after_s: float | None) -> dict[str, str | int]:
    """A log line's ``expired_limit`` and ``retry_after_ms``, where given."""
    fields: dict[str, str | int] = {}
    if expired_limit is not None:
        fields["expired_limit"] = expired_limit
    if retry_after_s is not None:
        fields["retry_after_ms"] = max(1, math.ceil(retry_after_s * 1000))
    return fields


def _base_attributes(model: str) -> dict[str, str | int | float | bool]:
    return {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": model,
    }


def _log_context(span: Span, parent: Context) -> SpanContext | None:
    """The ids a request's log lines carry: its own span's, or (tracing off)
    the caller's; None when neither exists."""
    for context in (span.get_span_context(), trace.get_current_span(parent).get_span_context()):
        if context.is_valid:
            return context
    return None


def _ids(context: SpanContext | None) -> dict[str, str]:
    if context is None:
        return {}
    return {
        "trace_id": trace.format_trace_id(context.trace_id),
        "span_id": trace.format_span_id(context.span_id),
    }

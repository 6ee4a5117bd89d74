"""The engine: one thread owns the model and the KV pools and runs the step loop

    plan = scheduler.schedule(now)     # pure Python: who runs, who waits
    result = runner.execute(plan)      # swaps, then one forward over a ragged batch
    outputs = scheduler.update(plan, result.sampled, now)
    publish(outputs)                   # callbacks, on this thread

Callers on other threads ``submit`` (validated synchronously, under the lock
that guards the scheduler) and ``abort`` (queued, applied before the next
step, so an abort takes effect within one step).

Planning ahead (``plan_ahead``, the default on a GPU): the host plans and
launches step N+1 while the device runs step N, then takes N's results::

    plan = scheduler.schedule(now, ahead=True)   # N taken as done, its tokens pending
    handle = runner.launch(plan)                 # queued; pending tokens come from N
    result = previous_handle.result()            # waits for N's sampled ids
    outputs = scheduler.update(previous_plan, result.sampled, now)
    publish(outputs)

so the scheduling, the bookkeeping and the publishing of a step overlap the
device's work instead of adding to it. EOS and stop sequences land a step
late (a request's token from the step after its last is dropped).

Structured output (``RequestSpec.constraint``, grammar.py): a request with
a constraint has a matcher; the runner masks its row's logits by it before
sampling, and ``update`` advances it by the sampled token (through the stop
check, which also ends the request once its output is complete). A
constrained row's mask needs its previous token, so nothing is planned
ahead of a step that sampled a constrained row: that step's results are
taken first and the next step is planned after them (for that step, no
overlap). A step with no constrained row runs as it would without any.

Speculative decoding (``SchedulerConfig.num_speculative_tokens``): a
decode may carry draft tokens, verified in its step; the step's results
give each such request its accepted drafts plus one token, and ``update``
takes them one by one as it takes single tokens (EOS, stop sequences and
limits per token). Like a constrained step, a step with drafts lands
before the next is planned.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from transformers import PreTrainedTokenizerBase

from slipstream.scheduler.errors import Draining, InvalidRequest
from slipstream.scheduler.plan import FinishedRequest, RequestOutput, StepPlan
from slipstream.scheduler.request import FinishReason, Request
from slipstream.scheduler.scheduler import Scheduler
from slipstream.service.engine.detokenizer import IncrementalDetokenizer
from slipstream.service.engine.events import (
    EngineStats,
    Event,
    EventCallback,
    FinishEvent,
    HostTimes,
    ModelInfo,
    PoolStats,
    PrefixCacheStats,
    RequestSpec,
    StepOutOfMemory,
    TokenEvent,
    TokenLogprobs,
)
from slipstream.service.engine.grammar import (
    ConstraintBroken,
    ConstraintTooComplex,
    Grammar,
    GrammarCompiler,
    Matcher,
)
from slipstream.service.engine.observer import EngineObserver

if TYPE_CHECKING:
    from slipstream.service.engine.runner import StepResult

log = structlog.get_logger(__name__)


class Runner(Protocol):
    """Executes one plan: swaps and copies, one forward, sampling (runner.py,
    cuda_runner.py). ``execute(plan)`` gives a ``StepResult``: ``sampled``
    maps req_id to its token, ``logprobs`` to its log-probabilities where the
    request asked, ``verified`` to the tokens of a sequence with drafts;
    ``launch(plan).result()`` is the same, split where the host may go on.
    A step with constrained rows also passes their ``matchers`` (by req_id),
    whose masks the runner applies before sampling; a step without, nothing.
    A runner may also define ``on_engine_thread()``, called once on the
    engine's thread before its first step, and ``use_requests(lookup)``,
    given the engine's records of its live requests (``request_tokens``:
    their prompts and outputs, which penalties are over)."""

    def execute(self, plan: StepPlan, matchers: dict[str, Matcher] | None = None) -> Any: ...

    def launch(self, plan: StepPlan, matchers: dict[str, Matcher] | None = None) -> Any: ...


@dataclass(slots=True)
class _Launched:
    """A step launched ahead of its predecessor's results (``plan_ahead``)."""

    plan: StepPlan
    handle: Any  # .result() -> StepResult
    started: float  # when it was planned


@dataclass(slots=True)
class _Live:
    """Engine-side state of one request: how to reach its caller and its text."""

    request: RequestSpec
    state: Request  # the scheduler's record, read (never written) here
    on_event: EventCallback
    detokenizer: IncrementalDetokenizer
    pending_text: list[str] = field(default_factory=list)  # decoded, not yet published
    matcher: Matcher | None = None  # where it has a constraint: its place in it
    # Why its constraint can no longer be followed: it ends ERROR, even where
    # the token that showed it (an EOS, its last allowed) ended it first.
    broken: str | None = None
    num_unsent: int = 0  # output tokens taken but not sent (the step that broke it)


@dataclass(frozen=True, slots=True)
class FinishedResult:
    """A whole request's outcome, for in-process callers (``generate``)."""

    req_id: str
    token_ids: list[int]
    text: str
    finish: FinishEvent
    token_times: list[float] = field(default_factory=list)


class Engine:
    """Runs the step loop over its parts; ``loader.load_engine`` builds them.

    ``step_listeners`` are called on the engine thread with every step that ran
    and its measured seconds; keep them cheap. The list is read every step, so
    its owner may add and remove listeners while the engine runs.
    ``plan_ahead``: plan step N+1 while step N runs (see the module).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        tokenizer: PreTrainedTokenizerBase,
        info: ModelInfo,
        step_listeners: Sequence[Callable[[StepPlan, float], None]] = (),
        plan_ahead: bool = False,
    ) -> None:
        self._scheduler = scheduler
        self.plan_ahead = plan_ahead
        self._pending: _Launched | None = None  # launched, results not yet taken
        self._last_settled = 0.0
        self._runner = runner
        self.tokenizer = tokenizer
        self.info = info
        self._fast_tokenizer = tokenizer.backend_tokenizer
        self._step_listeners = step_listeners
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._aborts: queue.SimpleQueue[tuple[str, FinishReason, str]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        # Constraints: compiled for this model's tokenizer (front doors call it
        # off their event loop); the matchers of the live constrained requests.
        self.grammars = GrammarCompiler(tokenizer, info.eos_token_ids)
        self._matchers: dict[str, Matcher] = {}
        self._draining = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._prepared = threading.Event()  # the engine thread is ready to step
        self._idle = threading.Condition(self._lock)
        self._last_publish_s = 0.0
        self._host = _HostClock()  # written by the engine thread only
        # Telemetry hook; set before start(). None: no call, no cost.
        self.observer: EngineObserver | None = None
        use_requests = getattr(runner, "use_requests", None)
        if use_requests is not None:
            use_requests(self._request_state)

    # -- caller side (any thread) -----------------------------------------

    @property
    def is_started(self) -> bool:
        """``start`` has run and the engine thread can step."""
        return self._prepared.is_set()

    def start(self, timeout: float = 60.0) -> None:
        """Starts the engine thread and returns once it can step (at most
        ``timeout`` seconds): a server that says it is ready then serves its
        first request at once, instead of holding it, as queue time, while
        the thread prepares (the runner's ``on_engine_thread``)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="slipstream-engine", daemon=True
                )
                self._thread.start()
        self._prepared.wait(timeout)

    def submit(self, request: RequestSpec, on_event: EventCallback) -> None:
        """Queues ``request``; raises a domain error (``InvalidRequest``,
        ``QueueFull``, ... and ``InvalidConstraint``) when it is refused. A
        ``constraint`` not yet compiled (``grammars.compile``) is compiled
        here, on the caller's thread."""
        # An id outside the vocabulary would fail the whole step (the embedding's
        # index), so every request in it; the wire checks too, in-process callers may not.
        vocab = self.info.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise InvalidRequest(
                request.req_id,
                f"prompt token ids must be in [0, vocab size {vocab})",
                field="prompt_token_ids",
            )
        if any(not 0 <= t < vocab for t, _ in request.sampling.logit_bias):
            raise InvalidRequest(
                request.req_id,
                f"logit_bias token ids must be in [0, vocab size {vocab})",
                field="logit_bias",
            )
        arrival = request.arrival_time if request.arrival_time is not None else time.monotonic()
        eos = () if request.ignore_eos else tuple(self.info.eos_token_ids)
        sched_request = Request.from_spec(request, eos, arrival)
        detokenizer = IncrementalDetokenizer(
            self._fast_tokenizer,
            request.prompt_token_ids,
            request.stop_sequences,
            request.sampling.min_tokens,
        )
        matcher = None
        constraint = request.constraint
        if constraint is not None:
            if not isinstance(constraint, Grammar):
                constraint = self.grammars.compile(constraint)
            matcher = constraint.start()
        with self._lock:
            if self._draining:
                raise Draining("the server is draining and takes no new requests")
            self._scheduler.add_request(sched_request)
            live = _Live(request, sched_request, on_event, detokenizer, matcher=matcher)
            self._live[request.req_id] = live
            if matcher is not None:
                self._matchers[request.req_id] = matcher
            if self.observer is not None:
                self.observer.on_submit(request, sched_request)
        self._wakeup.set()

    def abort(
        self, req_id: str, reason: FinishReason = FinishReason.CANCELLED, message: str = ""
    ) -> None:
        self._aborts.put((req_id, reason, message))
        self._wakeup.set()

    def pause(self, req_ids: Iterable[str]) -> None:
        """Holds these requests out of the batch (their KV kept) until
        ``resume``: their caller cannot take more output yet. Unknown or
        finished ids are ignored; a deadline still ends a paused request."""
        with self._lock:
            for req_id in req_ids:
                self._scheduler.pause(req_id)

    def resume(self, req_ids: Iterable[str]) -> None:
        with self._lock:
            for req_id in req_ids:
                self._scheduler.resume(req_id)
        self._wakeup.set()

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._scheduler
            return EngineStats(
                waiting=s.num_waiting,
                running=s.num_running,
                swapped=s.num_swapped,
                device_blocks=PoolStats(s.num_used_device_blocks, s.num_free_device_blocks),
                host_blocks=PoolStats(s.num_used_host_blocks, s.num_free_host_blocks),
                by_priority=s.counts_by_priority(),
                step=s.step,
                is_draining=self._draining,
                prefix_cache=PrefixCacheStats(
                    queried_tokens=s.num_prefix_queried_tokens,
                    hit_tokens=s.num_prefix_hit_tokens,
                    waits=s.num_prefix_waits,
                    cached_blocks=s.num_cached_device_blocks,
                ),
                overload_refused=s.num_overload_refused,
                paused=s.num_paused,
                swap_preemptions=s.num_swap_preemptions,
                recompute_preemptions=s.num_recompute_preemptions,
                capacity_refusals=dict(s.num_refused_for_capacity),
                overload_estimate=s.overload_estimate(time.monotonic()),
                step_time_pace=s.step_time_pace,
                device_memory=self._device_memory(),
                host_times=self._host.snapshot(),
                spec_draft_tokens=s.num_draft_tokens,
                spec_accepted_tokens=s.num_accepted_tokens,
            )

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue: what each submit's acknowledgement
        says, without ``stats()``'s whole snapshot (a device memory query on
        a GPU) taken under the lock the engine thread plans under."""
        with self._lock:
            return self._scheduler.num_waiting

    def _device_memory(self) -> PoolStats | None:
        """The runner's device memory where it has one to report (a GPU)."""
        memory = getattr(self._runner, "memory", None)
        return None if memory is None else memory()

    def live_output_counts(self) -> dict[str, int]:
        """Output tokens so far of every live request (for progress checks)."""
        with self._lock:
            return {req_id: live.state.num_output_tokens for req_id, live in self._live.items()}

    def drain(self) -> None:
        with self._lock:
            self._draining = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: not self._live, timeout)

    def shutdown(self) -> None:
        """Ends what is still live SHUTDOWN, then stops the engine thread."""
        with self._lock:
            live_ids = list(self._live)
        for req_id in live_ids:
            self.abort(req_id, FinishReason.SHUTDOWN, "the server shut down before it finished")
        self.wait_idle(timeout=5.0)
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def generate(self, requests: list[RequestSpec]) -> list[FinishedResult]:
        """Runs ``requests`` concurrently and returns their results in order."""
        collectors = {r.req_id: _Collector() for r in requests}
        self.start()
        for r in requests:
            self.submit(r, collectors[r.req_id].on_event)
        return [collectors[r.req_id].wait(r.req_id) for r in requests]

    # -- engine thread -----------------------------------------------------

    def _request_state(self, req_id: str) -> Request | None:
        """The scheduler's record of a live request, for the runner (its
        ``use_requests``): read on this thread, the one that updates it."""
        live = self._live.get(req_id)
        return None if live is None else live.state

    def _loop(self) -> None:
        prepare = getattr(self._runner, "on_engine_thread", None)
        try:
            if prepare is not None:
                prepare()
        finally:
            self._prepared.set()
        while not self._stopping:
            self._apply_aborts()
            with self._lock:
                has_work = self._scheduler.has_unfinished() or self._pending is not None
                s = self._scheduler
                is_all_paused = has_work and s.num_paused >= (
                    s.num_waiting + s.num_running + s.num_swapped
                )
            if not has_work or is_all_paused:
                # Paused work still gets a step now and then: its deadlines expire.
                idle_since = time.monotonic()
                self._wakeup.wait(timeout=0.05 if is_all_paused else 0.5)
                self._wakeup.clear()
                if not is_all_paused:
                    self._observe_idle(time.monotonic() - idle_since)
                    continue
            try:
                if self.plan_ahead:
                    self._step_ahead()
                else:
                    self._step()
            except StepOutOfMemory as exc:  # the server goes on; that step's requests end
                self._out_of_memory(None, exc)
            except Exception:  # a broken step must not take the server down
                log.exception("engine_step_failed")
                self._fail_all("internal error during a model step")

    def _observe_idle(self, idle_s: float) -> None:
        # A model that predicts every request infeasible idles the engine and
        # so gets no steps to correct it: idle time moves the policy's
        # estimates back toward the start-up calibration.
        with self._lock:
            if not self._scheduler.has_unfinished():
                self._scheduler.observe_idle(idle_s)

    def _step(self) -> None:
        """Plan, run, update, publish. The refit sees the whole step —
        planning, forward, update and publishing — because step-to-step time
        is what deadlines are spent in (timing the forward alone overstated
        capacity by about half on `small`); this step's publishing is still to
        come when the scheduler is told, so the last step's stands in for it."""
        host = self._host
        with self._lock:
            started = time.monotonic()
            plan = self._scheduler.schedule(started)
        self._finish_planned(plan)
        planned = time.monotonic()
        host.planning += planned - started
        if not plan.seqs and not plan.swap_in and not plan.swap_out:
            self._observe(plan, [], started)
            time.sleep(0.001)  # nothing runnable this instant (e.g. waiting on blocks)
            return
        matchers = self._step_matchers(plan)
        if matchers is None:
            result = self._runner.execute(plan)
        else:
            result = self._runner.execute(plan, matchers)
        host.launch += time.monotonic() - planned
        self._settle(plan, result, started)

    def _step_ahead(self) -> None:
        """Plan and launch step N+1, then take step N's results (see the module).
        The refit sees a step's time from the later of its planning and the
        previous step's settling: the device's pace once the pipe is full.
        A step that sampled a constrained row lands before the next is
        planned: that one's masks need its tokens. So does a step with
        drafts: how many tokens its sequences get is known only then, and
        the scheduler plans none of them ahead of it."""
        pending, host = self._pending, self._host
        if pending is not None and (
            self._samples_constrained(pending.plan) or _has_drafts(pending.plan)
        ):
            self._pending = None
            self._land(pending, time.monotonic())
            pending = None
        with self._lock:
            started = time.monotonic()
            plan = self._scheduler.schedule(started, ahead=pending is not None)
        self._finish_planned(plan)
        planned = time.monotonic()
        host.planning += planned - started
        self._pending = None
        if not plan.is_empty:
            matchers = self._step_matchers(plan)
            try:
                if matchers is None:
                    handle = self._runner.launch(plan)
                else:
                    handle = self._runner.launch(plan, matchers)
                self._pending = _Launched(plan, handle, started)
            except StepOutOfMemory as exc:
                self._out_of_memory(plan, exc)
        launched = time.monotonic()
        host.launch += launched - planned
        if pending is not None:
            self._land(pending, launched)
        elif self._pending is None:
            self._observe(plan, [], started)
            time.sleep(0.001)  # nothing runnable this instant (e.g. waiting on blocks)

    def _land(self, pending: _Launched, since: float) -> None:
        """Waits for a launched step's results (from ``since``) and settles it."""
        try:
            result = pending.handle.result()
        except StepOutOfMemory as exc:
            self._out_of_memory(pending.plan, exc)
            return
        finally:
            self._host.device_wait += time.monotonic() - since
        self._settle(pending.plan, result, max(pending.started, self._last_settled))

    def _step_matchers(self, plan: StepPlan) -> dict[str, Matcher] | None:
        """The matchers of the plan's constrained sampled rows; None if it has none."""
        if not self._matchers:
            return None
        matchers = self._matchers
        step = {
            s.req_id: matchers[s.req_id] for s in plan.seqs if s.sample and s.req_id in matchers
        }
        return step or None

    def _samples_constrained(self, plan: StepPlan) -> bool:
        matchers = self._matchers
        return bool(matchers) and any(s.sample and s.req_id in matchers for s in plan.seqs)

    def _settle(self, plan: StepPlan, result: StepResult, started: float) -> None:
        """A step's results: the scheduler's update, then observers and callers."""
        with self._lock:
            now = time.monotonic()
            step_s = now - started + self._last_publish_s
            outputs = self._scheduler.update(
                plan, result.sampled, now, step_s, self._is_stopped, result.verified
            )
        self._last_settled = now
        updated = time.monotonic()
        self._host.update += updated - now
        self._observe(plan, outputs, started)
        published = time.monotonic()
        self._publish(plan, outputs, result.logprobs)
        done = time.monotonic()
        self._last_publish_s = done - published
        self._host.publish += done - updated  # the observers' share included
        for listener in tuple(self._step_listeners):
            listener(plan, step_s)

    def _out_of_memory(self, plan: StepPlan | None, exc: StepOutOfMemory) -> None:
        """The server goes on; the step's requests end (``plan``: the step that
        failed, forgotten by the scheduler: no update follows)."""
        log.warning("step_out_of_memory", requests=len(exc.req_ids), detail=str(exc))
        if plan is not None:
            with self._lock:
                self._scheduler.discard(plan)
        for req_id in exc.req_ids:
            self._end(req_id, FinishReason.OUT_OF_MEMORY, str(exc))

    def _finish_planned(self, plan: StepPlan) -> None:
        """Requests the scheduler ended while planning (limits, expiry, refusals)."""
        for finished in plan.finished:
            self._finish(finished.req_id, finished.reason, finished.message, finished)

    def _is_stopped(self, req_id: str, token_id: int) -> bool:
        """Decodes one appended token (kept for publishing) and says whether the
        output now ends in a stop sequence; the scheduler asks, under the lock."""
        live = self._live.get(req_id)
        if live is None:
            return False
        live.pending_text.append(live.detokenizer.add(token_id))
        if live.matcher is not None and self._advance(live, token_id):
            return True  # its output is complete: it stops as at a stop sequence
        return live.detokenizer.stopped

    def _advance(self, live: _Live, token_id: int) -> bool:
        """Advances a constrained request's matcher by its sampled token;
        True once its output is complete. A constraint that cannot be
        followed (a mask past the step limits: the grammar's fault; a token
        outside it: a fault here) ends the request ERROR before the next
        step, that request alone."""
        assert live.matcher is not None
        req_id = live.request.req_id
        try:
            return live.matcher.take(token_id)
        except ConstraintTooComplex as exc:
            log.warning("constraint_too_complex", req_id=req_id, detail=str(exc))
            live.broken = str(exc)
        except ConstraintBroken as exc:
            log.error("constraint_broken", req_id=req_id, token_id=token_id, detail=str(exc))
            live.broken = f"a token outside the constraint: {exc}"
        self.abort(req_id, FinishReason.ERROR, live.broken)
        return False

    def _observe(self, plan: StepPlan, outputs: list[RequestOutput], started: float) -> None:
        # Before _publish, so an observer sees a request's last tokens before its finish.
        if self.observer is not None and (plan.seqs or plan.preempted_req_ids):
            self.observer.on_step(plan, outputs, started, time.monotonic())

    def _publish(
        self,
        plan: StepPlan,
        outputs: list[RequestOutput],
        logprobs: dict[str, TokenLogprobs],
    ) -> None:
        batch_size = len(plan.seqs)
        now = time.monotonic()
        for out in outputs:
            live = self._live.get(out.req_id)
            if live is None:
                continue
            text, live.pending_text = "".join(live.pending_text), []
            # A token its constraint refused (or took past its limits) ends
            # the request ERROR: neither it nor its text is sent as output.
            if out.new_token_ids and live.broken is not None:
                live.num_unsent += len(out.new_token_ids)  # not counted as output either
            elif out.new_token_ids:
                live.on_event(
                    TokenEvent(  # by position, in declaration order: per request per step
                        out.req_id,  # req_id
                        list(out.new_token_ids),  # token_ids
                        text,  # text
                        live.state.num_output_tokens - len(out.new_token_ids),  # index
                        plan.step,  # step
                        plan.step,  # batch_id
                        batch_size,  # batch_size
                        _queue_wait(live.state, now),  # queue_wait_s
                        _token_logprobs(out, logprobs),  # logprobs
                    )
                )
            if out.finish_reason is not None:
                self._finish(out.req_id, out.finish_reason, out.message)

    def _apply_aborts(self) -> None:
        while True:
            try:
                req_id, reason, message = self._aborts.get_nowait()
            except queue.Empty:
                return
            self._end(req_id, reason, message)

    def _fail_all(self, message: str) -> None:
        self._pending = None
        with self._lock:
            self._scheduler.discard(None)
        for req_id in list(self._live):
            self._end(req_id, FinishReason.ERROR, message)
            # A step that failed after update() may leave requests the scheduler
            # already let go of; their callers still get exactly one finish.
            self._finish(req_id, FinishReason.ERROR, message)

    def _end(self, req_id: str, reason: FinishReason, message: str = "") -> None:
        """Ends a request the scheduler still holds: frees its blocks, tells its
        caller. Unknown or already finished ids are ignored."""
        with self._lock:
            out = self._scheduler.abort_request(req_id, reason, message)
        if out is not None:
            self._finish(req_id, reason, message)

    def _finish(
        self,
        req_id: str,
        reason: FinishReason,
        message: str = "",
        detail: FinishedRequest | None = None,
    ) -> None:
        """Tells the caller; ``detail`` is the scheduler's record of a
        request it ended while planning or admitting (limits, causes)."""
        live = self._live.get(req_id)
        if live is None:
            return
        if live.broken is not None and reason in _OUTPUT_ENDS:
            reason, message = FinishReason.ERROR, live.broken
        state = live.state
        now = time.monotonic()
        event = FinishEvent(
            req_id=req_id,
            reason=reason,
            message=message,
            num_prompt_tokens=state.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens - live.num_unsent,
            num_cached_tokens=state.num_cached_tokens,
            queue_wait_s=_queue_wait(state, now),
            ttft_s=None
            if state.first_token_time is None
            else state.first_token_time - state.arrival_time,
            total_s=now - state.arrival_time,
            num_preemptions=state.num_preemptions,
            preempted_s=state.preempted_time(now),
            priority=state.priority,
            num_held_back=state.num_held_back,
            text="" if live.broken is not None else live.detokenizer.flush(),
            expired_limit=None if detail is None else detail.expired_limit,
            reject_cause=None if detail is None else detail.reject_cause,
            retry_after_s=None if detail is None else detail.retry_after_s,
        )
        with self._idle:
            del self._live[req_id]
            self._matchers.pop(req_id, None)
            if not self._live:
                self._idle.notify_all()
        if self.observer is not None:
            self.observer.on_finish(event)
        live.on_event(event)


def _has_drafts(plan: StepPlan) -> bool:
    return any(seq.num_drafts for seq in plan.seqs)


# Ends that would pass a broken constraint's output off as whole.
_OUTPUT_ENDS = frozenset({FinishReason.EOS, FinishReason.STOP_SEQUENCE, FinishReason.MAX_TOKENS})


class _HostClock:
    """``HostTimes`` as the engine thread adds to it."""

    __slots__ = HostTimes.__slots__

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0.0)

    def snapshot(self) -> HostTimes:
        return HostTimes(*(getattr(self, name) for name in self.__slots__))


def _token_logprobs(
    out: RequestOutput, logprobs: dict[str, TokenLogprobs]
) -> list[TokenLogprobs] | None:
    """The log-probabilities of a step's new tokens, for a request that asked
    (a step samples one token a request)."""
    token = logprobs.get(out.req_id)
    return None if token is None or len(out.new_token_ids) != 1 else [token]


def _queue_wait(state: Request, now: float) -> float:
    """Time from arrival to first being scheduled (still growing while queued)."""
    started = state.first_scheduled_time
    return (now if started is None else started) - state.arrival_time


class _Collector:
    """Gathers one request's events for ``Engine.generate``."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.token_times: list[float] = []
        self.finish: FinishEvent | None = None
        self._done = threading.Event()

    def on_event(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.token_ids.extend(event.token_ids)
            self.text.append(event.text)
            self.token_times.append(time.monotonic())
        else:
            self.text.append(event.text)
            self.finish = event
            self._done.set()

    def wait(self, req_id: str) -> FinishedResult:
        self._done.wait()
        assert self.finish is not None
        return FinishedResult(
            req_id, self.token_ids, "".join(self.text), self.finish, self.token_times
        )

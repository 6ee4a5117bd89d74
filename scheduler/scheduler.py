"""The scheduler: decides, every step, which sequences run, which wait, and
which are preempted; pure Python, deterministic given (requests, clock).

One step::

    plan = scheduler.schedule(now)   # expire, abandon -> make room -> running -> swapped -> waiting
    sampled = runner.execute(plan)        # swaps, copies, one ragged forward
    outputs = scheduler.update(plan, sampled, now)

Planning ahead (``schedule(now, ahead=True)``, for a device whose step runs
while the host plans the next): the plan in flight is taken as done before
planning — its computed tokens advanced, each token it samples held as
``PENDING_TOKEN`` — so the new plan follows it; its ``update`` later puts the
real tokens in and applies EOS and stop sequences, one step late. A request
that ends there may already be in the next plan: that plan's token for it is
dropped. A request at its token limit is not planned past it, nor one whose
drafts the plan verifies. At most one plan is ahead of its results.

Speculative decoding (``config.num_speculative_tokens``, speculative.py): a
decode may carry draft tokens, ``token_ids == [last, d1 .. dk]``, counted in
the token budget and the block table like any token. ``update`` takes the
runner's verified tokens for it (``verified``: the drafts the model agreed
with, then its own next token) one by one through the path a single sampled
token takes, so EOS, a stop sequence or a token limit in the middle ends the
request there and drops the rest. ``num_computed_tokens`` ends at the
accepted tokens: the K/V written for rejected drafts is overwritten later,
and only blocks full of accepted tokens are ever hashed and cached.

Every request's ``num_computed_tokens`` catches up with its ``num_tokens``
under the per-step token budget: a decode is one token behind, a prefill many
(chunked across steps when the budget runs out). Blocks are allocated for
exactly the tokens scheduled in a step; the token ids of a ``ScheduledSeq``
are always ``req.token_slice(start_pos, start_pos + n)``.

Invariants kept by every public method:

- each live request is in exactly one of waiting / running / swapped, and
  the one matching its status;
- waiting requests hold no blocks; running requests hold device blocks only,
  covering their computed tokens; swapped requests hold host blocks only;
- with the prefix cache on, a device block may have several holders (a
  shared prefix, see block_manager.py): its reference count is its number
  of holders, and nobody writes it. Admission starts a request's prefill at
  its first uncached token; preemption swaps out only the blocks a request
  holds alone and releases its shared prefix, found again at swap-in;
- a finished request holds no blocks and is forgotten;
- nothing preempted in a step runs in that step, a step that preempts
  swaps nothing in, and a request preempted before is admitted again only
  when all of it fits (room.py; all guard against thrashing). Swap-outs are always
  planned before swap-ins and the runner executes them in that order, so a
  block one frees and the other reuses is read before it is overwritten.

``Scheduler`` is this module's public face and its step (``schedule``,
``update``); its parts live beside it, one idea each::

    scheduler_state.py    SchedulerState: queues, pools, counters; admit, finish
    admission.py          Admission: the door (add_request, shedding, retry hints)
    expiry.py             Expiry: deadlines that passed, hopeless work abandoned
    room.py               RoomMaking: preempting running work to make room
    step_planning.py      StepPlanning: running -> swapped -> waiting into the step
    preemption.py         Preemption: swap out, swap in, drop for recompute
    prefix_sharing.py     PrefixSharing: shared prefixes at admission and swap-in
    scheduler_queries.py  SchedulerQueries: counts and counters
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from .admission import Admission
from .block_manager import commit_computed_blocks
from .cost_model import StepShape
from .expiry import Expiry
from .plan import PENDING_TOKEN, RequestOutput, ScheduledSeq, StepPlan
from .request import FinishReason, Request, RequestStatus
from .scheduler_queries import SchedulerQueries
from .scheduler_state import _StepState
from .step_planning import StepPlanning

# Asked per appended token: did the output just complete a stop sequence?
StopCheck = Callable[[str, int], bool]

_RUNNING = RequestStatus.RUNNING  # per sequence a step: see deadline_estimates.py


class Scheduler(StepPlanning, Admission, Expiry, SchedulerQueries):
    """Request queues, the device and host block pools, and the step plan.

    Never reads a clock: every time comes in as ``now``.
    """

    # == requests in and out ==============================================

    def abort_request(
        self, req_id: str, reason: FinishReason = FinishReason.CANCELLED, message: str = ""
    ) -> RequestOutput | None:
        """Ends a live request now, freeing its device and host blocks; its
        final output, or None if ``req_id`` is unknown or already finished."""
        req = self._requests.get(req_id)
        if req is None:
            return None
        self._finish(req, reason, message)
        return RequestOutput(req_id=req_id, new_token_ids=[], finish_reason=reason, message=message)

    def pause(self, req_id: str) -> None:
        """Holds a live request out of every plan until ``resume``: it keeps
        its blocks and its place, its deadline still runs, and a policy may
        still preempt it for room like any running request that did not run
        this step. Unknown ids are ignored."""
        if req_id in self._requests:
            self._paused.add(req_id)

    def resume(self, req_id: str) -> None:
        self._paused.discard(req_id)

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    # == planning a step ==================================================

    def schedule(self, now: float, ahead: bool = False) -> StepPlan:
        """Plans one step. Requests ended while planning (deadline expiry, abandonment)
        appear only in ``plan.finished``, never in ``update()``'s outputs.

        ``ahead``: the latest plan is still running; it is taken as done (see
        the module's "planning ahead"). Raises ValueError when the plan before
        it still awaits its ``update``."""
        if ahead:
            self._advance_in_flight()
        self.policy.observe_in_flight(1 if ahead else 0)
        self._step += 1
        state = _StepState(step=self._step, token_budget=self.config.max_num_batched_tokens)
        if self._ended:
            state.finished.extend(self._ended)
            self._ended = []
        self._expire_deadlines(state, now)
        if self.config.abandon_hopeless:
            self._abandon_hopeless(state, now)
        self._make_room_for_waiting(state, now)
        self._schedule_running(state, now)
        self._schedule_swapped(state, now)
        self._schedule_waiting(state, now)
        self._in_flight_step = state.step
        self._in_flight = state.scheduled
        plan = state.to_plan()
        self._in_flight_plan = plan
        self.policy.observe_plan(plan, state.is_saturated)
        self.policy.observe_room(not (state.is_saturated or state.is_held_back))
        return plan

    # == results of a step ================================================

    def update(
        self,
        plan: StepPlan,
        sampled: Mapping[str, int],
        now: float,
        step_s: float | None = None,
        is_stopped: StopCheck | None = None,
        verified: Mapping[str, Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Applies the runner's results for ``plan`` (the latest plan): advances
        computed tokens, appends sampled tokens, finishes on EOS, max tokens or
        a stop sequence. One output per request that got a token or finished.
        Sequences whose request ended after planning (abort) are skipped.
        Raises ValueError — before changing anything — for a stale plan or a
        missing sample.

        ``step_s``: the step's measured seconds; the cost model refits from it.
        ``is_stopped(req_id, token_id)`` is asked once per token appended, in
        order (the engine's text-level stop sequences), but of a stop token id
        that ends its request (its text is not output): True ends the request
        with STOP_SEQUENCE unless EOS or a limit ended it first.

        ``verified``: for each sequence with drafts, the tokens its step
        yields in order (1 to ``num_drafts + 1``: the accepted drafts, then
        the model's own token); its ``sampled`` token is their first."""
        ahead = self._ahead
        if ahead is not None and plan.step == ahead[0].step:
            # Taken as done when the next plan was made: what is still live.
            current = [(seq, req) for seq, req in ahead[1] if self._requests.get(req.req_id) is req]
            _check_sampled(current, sampled, verified, self._drafting)
            self._ahead = None
            self._held_for_results.clear()
        elif ahead is not None:
            raise ValueError(f"plan {ahead[0].step} awaits its update before plan {plan.step}")
        elif plan.step != self._in_flight_step:
            raise ValueError(f"plan {plan.step} is not the plan in flight")
        else:
            current = self._current_in_flight(plan)
            _check_sampled(current, sampled, verified, self._drafting)
            self._take_as_done(current)
        drafted = verified if verified is not None else {}
        outputs = [
            self._took_token(seq, req, sampled[seq.req_id], now, is_stopped)
            if not seq.num_drafts
            else self._took_tokens(seq, req, drafted[seq.req_id], now, is_stopped)
            for seq, req in current
            if seq.sample
        ]
        if step_s is not None and self._cost_model is not None:
            if self._drafting:
                self._observe_draft_overhead(plan, step_s)
            self._cost_model.observe_plan(plan, step_s)
        return outputs

    def _observe_draft_overhead(self, plan: StepPlan, step_s: float) -> None:
        """A measured decode-only step against the cost model's prediction,
        for what holding drafts costs beyond their tokens (speculative.py)."""
        assert self._cost_model is not None
        if plan.swap_in or plan.swap_out or not plan.seqs:
            return
        if any(len(seq.token_ids) - seq.num_drafts > 1 for seq in plan.seqs):
            return  # a prefill chunk pays the step's prefill cost itself
        # Priced as _draft_price prices it: the decodes, and each draft at a
        # prefill and a context token; the rest is the once-only cost.
        model = self._cost_model
        shape = StepShape.of(plan)
        num_drafts = shape.num_prefill_tokens
        predicted_s = model.step_seconds(dataclasses.replace(shape, num_prefill_tokens=0))
        if num_drafts:
            c = model.coefficients
            predicted_s += num_drafts * (c.per_prefill_token_s + c.per_context_token_s)
        self._draft_overhead.observe(num_drafts > 0, step_s - predicted_s, predicted_s)

    def discard(self, plan: StepPlan | None) -> None:
        """Forgets ``plan``, whose step failed (None: every plan not yet
        updated): no ``update`` follows. Its requests must be ended by the
        caller (``abort_request``)."""
        if self._ahead is not None and (plan is None or self._ahead[0].step == plan.step):
            self._ahead = None
            self._held_for_results.clear()
        if plan is None or plan.step == self._in_flight_step:
            self._in_flight_step = None
            self._in_flight = {}

    # == planning ahead ===================================================

    def _advance_in_flight(self) -> None:
        """Takes the plan in flight as done (see ``schedule``)."""
        if self._ahead is not None:
            raise ValueError(f"plan {self._ahead[0].step} still awaits its update")
        plan = self._in_flight_plan
        if self._in_flight_step is None or plan is None or plan.step != self._in_flight_step:
            return
        current = self._current_in_flight(plan)
        self._take_as_done(current)
        for seq, req in current:
            if seq.sample and (seq.num_drafts or self._limit_reason(req) is not None):
                # update() ends it, or says how many tokens it got: plan nothing past it
                self._held_for_results.add(req.req_id)
        self._ahead = (plan, current)

    # == one step's results ===============================================

    def _current_in_flight(self, plan: StepPlan) -> list[tuple[ScheduledSeq, Request]]:
        """The plan's sequences whose request is still exactly where it left them."""
        in_flight = self._in_flight
        current = []
        for seq in plan.seqs:
            req = in_flight.get(seq.req_id)
            if req is not None and _is_current(seq, req):
                current.append((seq, req))
        return current

    def _take_as_done(self, current: list[tuple[ScheduledSeq, Request]]) -> None:
        """Computed tokens advanced (full blocks committed), a ``PENDING_TOKEN``
        held per sampled token until ``_took_token`` puts the real one in.
        Drafts are not taken as computed: ``_took_tokens`` advances past
        those the model accepts."""
        self._in_flight_step = None
        self._in_flight = {}
        for seq, req in current:
            req.num_computed_tokens += len(seq.token_ids) - seq.num_drafts
            if self._prefix_cache:
                commit_computed_blocks(self.device_pool, req)
            if seq.sample:
                req.output_token_ids.append(PENDING_TOKEN)

    def _took_token(
        self,
        seq: ScheduledSeq,
        req: Request,
        token_id: int,
        now: float,
        is_stopped: StopCheck | None,
    ) -> RequestOutput:
        """Puts ``seq``'s sampled ``token_id`` in place of its pending token and
        finishes ``req`` if that token ends it."""
        req.output_token_ids[seq.output_index] = token_id
        if req.first_token_time is None:
            req.first_token_time = now
        reason = self._end_reason(req, token_id, seq.output_index, now, is_stopped)
        return RequestOutput(req.req_id, [token_id], reason)

    def _took_tokens(
        self,
        seq: ScheduledSeq,
        req: Request,
        token_ids: Sequence[int],
        now: float,
        is_stopped: StopCheck | None,
    ) -> RequestOutput:
        """``seq``'s verified tokens (it carried drafts): each in turn as
        ``_took_token`` takes one, up to the first that ends ``req``. Each
        token after the first stands where an accepted draft was computed,
        so the K/V of that draft's position are the request's own."""
        self._num_draft_tokens += seq.num_drafts
        self._num_accepted_tokens += len(token_ids) - 1
        if req.drafter is not None:
            req.drafter.observe(seq.num_drafts, len(token_ids) - 1)
        first = self._took_token(seq, req, token_ids[0], now, is_stopped)
        reason = first.finish_reason
        num_taken = 1
        outputs = req.output_token_ids
        while reason is None and num_taken < len(token_ids):
            token_id = token_ids[num_taken]
            req.num_computed_tokens += 1
            outputs.append(token_id)
            num_taken += 1
            reason = self._end_reason(req, token_id, len(outputs) - 1, now, is_stopped)
        if reason is None and self._prefix_cache:
            commit_computed_blocks(self.device_pool, req)
        return RequestOutput(req.req_id, list(token_ids[:num_taken]), reason)

    def _end_reason(
        self,
        req: Request,
        token_id: int,
        output_index: int,
        now: float,
        is_stopped: StopCheck | None,
    ) -> FinishReason | None:
        """Finishes ``req`` if its newest output, ``token_id`` (output number
        ``output_index``), ends it; why."""
        sampling = req.sampling
        may_stop, is_stop_id = True, False
        if sampling.has_token_stops:  # set once; most requests have none
            # Before min_tokens outputs the sampler masks EOS and the stop
            # ids; one that gets past it anyway ends nothing.
            may_stop = output_index >= sampling.min_tokens
            # A stop token id that ends the request is not decoded: its text
            # is left out of the output, as an EOS token's (special, skipped) is.
            is_stop_id = may_stop and token_id in sampling.stop_token_ids
        hit_stop = is_stop_id or (is_stopped is not None and is_stopped(req.req_id, token_id))
        # A stop sequence completed by the last allowed token is still the
        # stop: the output was cut at it, as the caller asked.
        if may_stop and not req.ignore_eos and token_id in req.eos_token_ids:
            reason: FinishReason | None = FinishReason.EOS
        elif hit_stop:
            reason = FinishReason.STOP_SEQUENCE
        else:
            reason = self._limit_reason(req)
        if reason is not None:
            self._finish(req, reason, "")
            self._note_finish(now)
        return reason

    def _limit_reason(self, req: Request) -> FinishReason | None:
        num_outputs = len(req.output_token_ids)  # per sampled token: no properties
        if num_outputs >= req.max_new_tokens:
            return FinishReason.MAX_TOKENS
        if len(req.prompt_token_ids) + num_outputs >= self.config.max_model_len:
            return FinishReason.MAX_TOKENS
        return None


def _check_sampled(
    current: list[tuple[ScheduledSeq, Request]],
    sampled: Mapping[str, int],
    verified: Mapping[str, Sequence[int]] | None,
    drafting: bool,
) -> None:
    """Every sampling sequence has its token, and (only plans of a
    scheduler that drafts hold drafts) every drafting one its verified run."""
    missing = [seq.req_id for seq, _ in current if seq.sample and seq.req_id not in sampled]
    if missing:
        raise ValueError(f"no sampled token for {missing}")
    if not drafting:
        return
    for seq, _ in current:
        if seq.num_drafts and seq.sample:
            _check_verified(seq, sampled[seq.req_id], verified)


def _check_verified(
    seq: ScheduledSeq, first: int, verified: Mapping[str, Sequence[int]] | None
) -> None:
    """A drafting sequence's verified tokens: 1 to ``num_drafts + 1``, the
    first its sampled token, each but the last the draft at its place."""
    tokens = None if verified is None else verified.get(seq.req_id)
    if tokens is None:
        raise ValueError(f"no verified tokens for {seq.req_id!r}, which has drafts")
    drafts = seq.token_ids[len(seq.token_ids) - seq.num_drafts :]
    num = len(tokens)
    agrees = list(tokens[: num - 1]) == drafts[: num - 1]
    if not (1 <= num <= seq.num_drafts + 1 and tokens[0] == first and agrees):
        raise ValueError(f"verified tokens {list(tokens)} do not follow the drafts {drafts}")


def _is_current(seq: ScheduledSeq, req: Request) -> bool:
    """The request is still running and exactly where the plan left it."""
    return req.status is _RUNNING and req.num_computed_tokens == seq.start_pos

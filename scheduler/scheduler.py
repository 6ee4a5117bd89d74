"""The scheduler: decides, every step, which sequences run, which wait, and
which are preempted; pure Python, deterministic given (requests, clock).

One step::

    plan = scheduler.schedule(now)   # expire, abandon -> make room -> running -> swapped -> waiting
    sampled = runner.execute(plan)        # swaps, copies, one ragged forward
    outputs = scheduler.update(plan, sampled, now)

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
- nothing preempted in a step runs in that step, and a step that preempts
  swaps nothing in (both guard against thrashing). Swap-outs are always
  planned before swap-ins and the runner executes them in that order, so a
  block one frees and the other reuses is read before it is overwritten.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .admission import check_request_fits, check_request_shape
from .batch_shaping import BatchShaper
from .block_manager import (
    BlockPool,
    commit_computed_blocks,
    find_cached_prefix,
    num_shared_leading_blocks,
)
from .config import SchedulerConfig
from .cost_model import CostModel
from .errors import DeadlineInfeasible, DuplicateRequest, Overloaded, QueueFull
from .plan import FinishedRequest, RequestOutput, ScheduledSeq, StepPlan
from .policy_base import PreemptionMode, SchedulingPolicy
from .policy_registry import make_policy
from .request import ExpiredLimit, FinishReason, RejectCause, Request, RequestStatus

# Bounds of a retry-after hint, and the weight of the newest gap between
# finishes in the average that sizes it.
_RETRY_AFTER_S = (0.05, 300.0)
# Waiting requests that found no room, past which the walk that makes room for
# waiting work stops (it stops at the first for policies that never preempt).
MAX_WAITING_AHEAD = 4
_FINISH_GAP_EWMA = 0.1


@dataclass(slots=True)
class _StepState:
    """Scratch for one ``schedule()`` call; becomes the frozen ``StepPlan``."""

    step: int
    token_budget: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    preempted_ids: dict[str, None] = field(default_factory=dict)  # ordered set
    scheduled: dict[str, Request] = field(default_factory=dict)
    # A running request had to preempt for blocks: admitting new work now would
    # only take the blocks the running ones need next step.
    is_kv_exhausted: bool = False
    # Waiting work was left out for want of room (sequences, budget or
    # blocks), not held back: the step is as full as the engine makes them.
    is_saturated: bool = False
    # Waiting work was held back by the batch shaper: it waits too.
    is_held_back: bool = False
    # (urgency key, tokens) of waiting work that budget is held back for,
    # ascending: running work less urgent than a key leaves those tokens.
    reservations: list[tuple[tuple[float, ...], int]] = field(default_factory=list)
    # The policy's order of the waiting queue at ``waiting_version``: one
    # ranking serves every walk of an unchanged queue in this step.
    waiting_order: list[Request] = field(default_factory=list)
    waiting_version: int = -1
    # Holds back less urgent tokens when the step would be too slow for
    # urgent work (None: the policy does not shape batches).
    shaper: BatchShaper | None = None

    def to_plan(self) -> StepPlan:
        return StepPlan(
            step=self.step,
            seqs=self.seqs,
            swap_out=self.swap_out,
            swap_in=self.swap_in,
            finished=self.finished,
            preempted_req_ids=list(self.preempted_ids),
        )


# Asked per appended token: did the output just complete a stop sequence?
StopCheck = Callable[[str, int], bool]


class Scheduler:
    """Request queues, the device and host block pools, and the step plan.

    Never reads a clock: every time comes in as ``now``.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        policy: SchedulingPolicy | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        self.config = config
        self.policy = (
            policy if policy is not None else make_policy(config.policy, config, cost_model)
        )
        self._cost_model = cost_model
        self.device_pool = BlockPool(config.num_device_blocks, config.block_size)
        self.host_pool = BlockPool(config.num_host_blocks, config.block_size)
        self._requests: dict[str, Request] = {}  # every live request
        self._waiting: deque[Request] = deque()
        self._waiting_version = 0  # bumped on every change to ``_waiting``
        self._running: dict[str, Request] = {}  # insertion order = admission order
        self._swapped: dict[str, Request] = {}
        # Held out of every plan (their caller cannot take more output): see pause().
        self._paused: set[str] = set()
        self._step = 0
        self._num_arrivals = 0
        self._in_flight_step: int | None = None
        self._in_flight: dict[str, Request] = {}
        self._num_preemptions = {mode: 0 for mode in PreemptionMode}
        self._num_expired = 0
        self._num_abandoned = 0
        self._prefix_cache = config.enable_prefix_cache
        self._num_prefix_queried_tokens = 0  # looked up at admissions
        self._num_prefix_hit_tokens = 0  # of those, found cached
        self._num_lost_swaps = 0  # swapped requests requeued by _requeue_lost_swap
        # (time, arrival_index, req) per deadline / first-token deadline;
        # entries of finished requests are dropped lazily when they surface.
        self._deadlines: list[tuple[float, int, Request]] = []
        # Requests ended outside schedule() (shed by add_request), reported
        # in the next plan's ``finished``.
        self._ended: list[FinishedRequest] = []
        self._num_shed: dict[int, int] = {}
        # Arrivals refused for capacity, by (class, reason): "overloaded", "queue_full".
        self._num_refused: dict[tuple[int, str], int] = {}
        self._num_held_back = 0
        self._last_finish_time: float | None = None
        self._finish_gap_s: float | None = None  # average time between finishes

    # == requests in and out ==============================================

    def add_request(self, req: Request, now: float | None = None) -> None:
        """Queues ``req`` (WAITING). Raises ValueError, DuplicateRequest,
        PromptTooLong, DeadlineInfeasible or QueueFull — and then changes
        nothing. ``now`` defaults to ``req.arrival_time``.

        A full queue sheds the queued request the policy names
        (``shed_victim``: a less urgent class) to make room: it ends
        REJECTED (``RejectCause.SHED``) and is reported in the next plan's
        ``finished``. Without a victim the newcomer gets QueueFull."""
        check_request_shape(req)
        if req.req_id in self._requests:
            raise DuplicateRequest(f"request {req.req_id!r} is already live")
        check_request_fits(req, self.config)
        self._prefix_hits(req)  # cached tokens cost nothing in the estimates below
        at = req.arrival_time if now is None else now
        if self.config.reject_infeasible:
            infeasible = self.policy.check_admission(req, at)
            if infeasible is not None:
                self.policy.forget(req.req_id)
                raise DeadlineInfeasible(infeasible.message, infeasible.limit)
        refusal = self.policy.overload_refusal(req, at)
        if refusal:
            self.policy.forget(req.req_id)
            retry = self.retry_after_seconds(req.priority)
            self._count_refusal(req.priority, "overloaded")
            load = self.policy.overload_estimate()
            raise Overloaded(f"{refusal}; retry after {retry:.3f}s", retry, load or 0.0)
        if len(self._waiting) >= self.config.max_queue_len:
            victim = self.policy.shed_victim(req, self._waiting, at)
            if victim is None:
                self.policy.forget(req.req_id)
                retry = self.retry_after_seconds(req.priority)
                self._count_refusal(req.priority, "queue_full")
                raise QueueFull(
                    f"waiting queue is full ({self.config.max_queue_len} requests); "
                    f"retry after {retry:.3f}s",
                    retry,
                )
            self._shed(victim)
        req.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        self.policy.observe_arrival(req, at)
        self._requests[req.req_id] = req
        self._waiting.append(req)
        self._waiting_version += 1
        for when in (req.deadline, req.first_token_deadline):
            if when is not None:
                heapq.heappush(self._deadlines, (when, req.arrival_index, req))

    def _count_refusal(self, priority: int, reason: str) -> None:
        key = (priority, reason)
        self._num_refused[key] = self._num_refused.get(key, 0) + 1

    def _shed(self, victim: Request) -> None:
        if (
            victim.status is not RequestStatus.WAITING
            or self._requests.get(victim.req_id) is not victim
        ):
            raise ValueError(f"policy chose {victim.req_id!r} to shed, which is not waiting")
        retry = self.retry_after_seconds(victim.priority)
        message = f"shed from a full queue for a more urgent request; retry after {retry:.3f}s"
        self._finish(victim, FinishReason.REJECTED, message)
        self._num_shed[victim.priority] = self._num_shed.get(victim.priority, 0) + 1
        self._ended.append(
            FinishedRequest(
                victim.req_id,
                FinishReason.REJECTED,
                message,
                reject_cause=RejectCause.SHED,
                retry_after_s=retry,
            )
        )

    def retry_after_seconds(self, priority: int) -> float:
        """When a retry of class ``priority`` may find room: the queued work
        of that class or a more urgent one, at the recent rate of finishes."""
        gap = self._finish_gap_s if self._finish_gap_s is not None else 1.0
        ahead = sum(1 for r in self._waiting if r.priority <= priority)
        low, high = _RETRY_AFTER_S
        return min(high, max(low, (ahead + 1) * gap))

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

    def schedule(self, now: float) -> StepPlan:
        """Plans one step. Requests ended while planning (deadline expiry, abandonment)
        appear only in ``plan.finished``, never in ``update()``'s outputs."""
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
        self.policy.observe_plan(plan, state.is_saturated)
        self.policy.observe_room(not (state.is_saturated or state.is_held_back))
        return plan

    def _expire_deadlines(self, state: _StepState, now: float) -> None:
        due: dict[int, Request] = {}
        while self._deadlines and self._deadlines[0][0] <= now:
            _, index, req = heapq.heappop(self._deadlines)
            if self._requests.get(req.req_id) is req:
                due[index] = req
        for _, req in sorted(due.items()):
            expiry = _expiry(req, now)
            if expiry is not None:
                limit, message = expiry
                self._finish(req, FinishReason.DEADLINE_EXCEEDED, message)
                self._num_expired += 1
                state.finished.append(
                    FinishedRequest(
                        req.req_id, FinishReason.DEADLINE_EXCEEDED, message, expired_limit=limit
                    )
                )

    def _abandon_hopeless(self, state: _StepState, now: float) -> None:
        """Ends, in arrival order, live work the policy says can no longer
        make a time limit: its compute would be wasted, its queue slot is
        better given to work that can. Work still queued that never ran is
        rejected (DEADLINE_INFEASIBLE); work that ran expires early
        (DEADLINE_EXCEEDED). Work without a time limit is never asked about."""
        for req, reason in self.policy.abandon_reasons(self._requests.values(), now):
            limit = self.policy.expired_limit(req, now)
            never_ran = req.status is RequestStatus.WAITING and req.first_scheduled_time is None
            finish = FinishReason.REJECTED if never_ran else FinishReason.DEADLINE_EXCEEDED
            self._finish(req, finish, reason)
            self._num_abandoned += 1
            state.finished.append(
                FinishedRequest(
                    req.req_id,
                    finish,
                    reason,
                    expired_limit=limit,
                    reject_cause=RejectCause.DEADLINE_INFEASIBLE if never_ran else None,
                )
            )

    def _make_room_for_waiting(self, state: _StepState, now: float) -> None:
        """Lets the policy push running work out for waiting work before the
        pools are exhausted (blocks, ``max_num_seqs`` or, for policies that
        ``is_urgency_driven``, the token budget). FCFS and priority never do;
        the walk stops at the first waiting request the policy does not make
        room for."""
        policy = self.policy
        budget = self.config.max_num_batched_tokens if policy.is_urgency_driven else 0
        # _rigid_running_tokens(), summed when a budget check first needs it:
        # with the blocks or seqs full (the usual case under load) none does.
        rigid: int | None = None
        reserved_blocks = reserved_tokens = 0
        waiting = self._ordered_waiting(state, now)
        if self._paused:
            waiting = [r for r in waiting if r.req_id not in self._paused]
        num_admitted = num_ahead = 0
        for candidate in waiting:
            hits = self._prefix_hits(candidate)
            cached = len(hits) * self.config.block_size
            chunk = min(candidate.num_tokens - cached, self.config.max_num_batched_tokens)
            need = reserved_blocks + self._blocks_to_admit(
                hits, self.device_pool.blocks_for(cached + chunk)
            )
            min_tokens = min(chunk, self.config.block_size) if budget else 0
            has_room = False
            while True:
                if self._fits(need, num_admitted + 1):
                    if not budget:
                        has_room = True
                        break
                    if rigid is None:
                        rigid = self._rigid_running_tokens()
                    if rigid + reserved_tokens + min_tokens <= budget:
                        has_room = True
                        break
                victim = policy.admission_victim(candidate, self._running_list(), now, num_ahead)
                if victim is None:
                    break
                self._check_is_running(victim)
                if rigid is not None:
                    rigid -= self._rigid_tokens(victim)
                self._preempt(state, victim, now)
            if not has_room or num_ahead:
                # The candidate waits for running work to finish (or, behind
                # such a waiter, has made what room it could: the first waiter
                # is admitted first). More urgent work further back — a class
                # 0 behind an aged request, or behind the waiters of a burst
                # that all count on the same next finish — may not be able to
                # wait: the walk goes on past MAX_WAITING_AHEAD waiters at most.
                num_ahead += 1
                if not policy.is_urgency_driven or num_ahead > MAX_WAITING_AHEAD:
                    return
                continue
            num_admitted += 1
            reserved_blocks = need
            if budget:
                assert rigid is not None  # the loop above only ends in budget once summed
                tokens = min(chunk, budget - rigid - reserved_tokens)
                reserved_tokens += tokens
                state.reservations.append((policy.urgency_key(candidate, now), tokens))

    def _schedule_running(self, state: _StepState, now: float) -> None:
        state.shaper = self.policy.batch_shaper(now)
        for req in self.policy.order_running(self._running_list(), now):
            if state.token_budget == 0:
                return
            if req.status is not RequestStatus.RUNNING or req.req_id in self._paused:
                continue  # preempted as a victim earlier in this loop, or paused
            available = state.token_budget
            if state.reservations:
                available -= self._held(state, req, now)
            num_new = self._shaped(state, req, min(req.num_uncomputed_tokens, available))
            if num_new > 0 and self._grow_or_preempt(state, req, num_new, now):
                self._add_seq(state, req, num_new)

    def _grow_or_preempt(self, state: _StepState, req: Request, num_new: int, now: float) -> bool:
        """Grows ``req``'s block table to cover ``num_new`` more tokens,
        preempting policy-chosen victims (running requests not yet scheduled
        this step, ``req`` included) until the blocks are there. False if
        ``req`` itself was preempted or must wait."""
        pool = self.device_pool
        # Only other requests' blocks are freed below, so the need is fixed.
        need = pool.num_blocks_to_append(req.block_ids, req.num_computed_tokens + num_new)
        if need == 0:
            return True  # the usual decode: room left in the last block
        while not pool.can_allocate(need):
            candidates = [r for r in self._running.values() if r.req_id not in state.scheduled]
            victim = self.policy.choose_victim(candidates, req, now)
            if victim is None:
                return False
            if not any(victim is c for c in candidates):
                raise ValueError(f"policy chose {victim.req_id!r}, not one of the candidates")
            state.is_kv_exhausted = True
            self._preempt(state, victim, now)
            if victim is req:
                return False
        req.block_ids.extend(pool.allocate(need))
        return True

    def _schedule_swapped(self, state: _StepState, now: float) -> None:
        if state.preempted_ids:
            return  # anti-thrash: see the module invariants
        if not self._swapped:
            return
        head = self._most_urgent_waiting_key(now)
        for req in self.policy.order_swapped(self._swapped.values(), now):
            if req.req_id in self._paused:
                continue
            if not self._has_room_for_another(state):
                return
            if head is not None and head < self.policy.urgency_key(req, now):
                return  # the slot and blocks go to more urgent waiting work
            hits = self._released_prefix(req)
            if hits is None:
                self._requeue_lost_swap(req)
                continue
            num_new = self._shaped(
                state,
                req,
                min(req.num_uncomputed_tokens, state.token_budget - self._held(state, req, now)),
            )
            if num_new <= 0:
                return
            target = req.num_computed_tokens + num_new
            num_blocks = len(hits) + len(req.host_block_ids)
            num_blocks = max(num_blocks, self.device_pool.blocks_for(target))
            if not self.device_pool.can_allocate(self._blocks_to_admit(hits, num_blocks)):
                return
            self._swap_in(state, req, hits)
            req.last_resumed_time = now
            req.block_ids.extend(self.device_pool.append(req.block_ids, target))
            self._add_seq(state, req, num_new)

    def _schedule_waiting(self, state: _StepState, now: float) -> None:
        if state.is_kv_exhausted:
            state.is_saturated = bool(self._waiting)
            return
        for req in self._ordered_waiting(state, now):
            if not self._has_room_for_another(state):
                state.is_saturated = True
                return
            if req.req_id in state.preempted_ids or req.req_id in self._paused:
                continue  # pushed out this very step (admitting it back would thrash), or paused
            hits = self._prefix_hits(req)
            cached = len(hits) * self.config.block_size
            num_new = self._shaped(state, req, min(req.num_tokens - cached, state.token_budget))
            if num_new <= 0:
                state.is_held_back = True
                return  # the step is as slow as urgent work can afford
            target = cached + num_new
            if not self.device_pool.can_allocate(
                self._blocks_to_admit(hits, self.device_pool.blocks_for(target))
            ):
                state.is_saturated = True
                return  # the head waits for blocks; nobody overtakes it
            self._take_prefix(req, hits)
            self._admit(req, now)
            req.block_ids.extend(self.device_pool.append(req.block_ids, target))
            self._add_seq(state, req, num_new)

    def _add_seq(self, state: _StepState, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        # Fields by position, in declaration order: keywords make the frozen
        # dataclass's __init__ markedly slower, and this runs per sequence per step.
        state.seqs.append(
            ScheduledSeq(
                req.req_id,  # req_id
                req.token_slice(start, start + num_new),  # token_ids
                start,  # start_pos
                list(req.block_ids),  # block_ids
                start + num_new == req.num_tokens,  # sample
                req.num_output_tokens,  # output_index
                req.sampling,  # sampling
            )
        )
        state.token_budget -= num_new
        state.scheduled[req.req_id] = req
        if state.shaper is not None:
            state.shaper.commit(req, num_new)

    def _shaped(self, state: _StepState, req: Request, num_new: int) -> int:
        """``num_new`` as far as the batch shaper lets ``req`` have it."""
        if state.shaper is None or num_new <= 0:
            return num_new
        allowed = state.shaper.fit(req, num_new)
        if allowed == 0:
            self._num_held_back += 1
        return allowed

    # == the prefix cache =================================================

    def _prefix_hits(self, req: Request) -> list[int]:
        """The cached leading blocks waiting ``req`` would share if admitted
        now (none with the cache off); remembered on ``req`` for estimates."""
        hits = find_cached_prefix(self.device_pool, req) if self._prefix_cache else []
        req.num_prefix_hit_tokens = len(hits) * self.config.block_size
        return hits

    def _blocks_to_admit(self, hits: list[int], num_blocks: int) -> int:
        """Free blocks a table of ``num_blocks`` blocks starting with the
        shared ``hits`` consumes: its new blocks, plus the hits that are
        evictable (counted free until shared)."""
        pool = self.device_pool
        return num_blocks - len(hits) + pool.num_free_taken_by_share(hits)

    def _take_prefix(self, req: Request, hits: list[int]) -> None:
        """Waiting ``req`` starts with the shared ``hits``: its prefill
        starts at the first uncached token."""
        self.device_pool.share(hits)
        req.block_ids = list(hits)
        req.num_committed_blocks = len(hits)
        req.num_computed_tokens = len(hits) * self.config.block_size
        if req.first_scheduled_time is None:
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        if self._prefix_cache:
            self._num_prefix_queried_tokens += req.num_tokens
            self._num_prefix_hit_tokens += req.num_computed_tokens

    def _released_prefix(self, req: Request) -> list[int] | None:
        """The shared prefix swapped ``req`` released, found again in the
        cache; None if part of it was evicted meanwhile."""
        num_released = req.num_released_blocks
        if num_released == 0:
            return []
        hits = self.device_pool.lookup(req.block_hashes[:num_released])
        return hits if len(hits) == num_released else None

    def _requeue_lost_swap(self, req: Request) -> None:
        """Swapped ``req`` cannot resume: its host blocks continue a prefix
        that left the cache. It drops them and waits to be recomputed (most of
        it probably still cached)."""
        self.host_pool.free(req.host_block_ids)
        req.host_block_ids = []
        req.num_released_blocks = 0
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        del self._swapped[req.req_id]
        self._waiting.appendleft(req)
        self._waiting_version += 1
        self._num_lost_swaps += 1

    # == state transitions ================================================

    def _admit(self, req: Request, now: float) -> None:
        _remove_by_identity(self._waiting, req)
        self._waiting_version += 1
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.last_resumed_time = now
        self._running[req.req_id] = req

    def _preempt(self, state: _StepState, victim: Request, now: float) -> None:
        # Only the blocks it holds alone are copied; its shared prefix is released.
        num_blocks = len(victim.block_ids) - num_shared_leading_blocks(self.device_pool, victim)
        can_swap = num_blocks > 0 and self.host_pool.can_allocate(num_blocks)
        mode = self.policy.preemption_mode(victim, can_swap, now)
        if mode is PreemptionMode.SWAP and not can_swap:
            mode = PreemptionMode.RECOMPUTE
        del self._running[victim.req_id]
        if mode is PreemptionMode.SWAP:
            self._swap_out(state, victim)
        else:
            self._drop_for_recompute(victim)
        victim.num_preemptions += 1
        self._num_preemptions[mode] += 1
        state.preempted_ids[victim.req_id] = None

    def _drop_for_recompute(self, req: Request) -> None:
        """Frees the KV; the outputs stay, so the re-prefill covers prompt +
        outputs and samples only at its end."""
        self.device_pool.free(req.block_ids)
        req.block_ids = []
        req.num_committed_blocks = 0
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self._waiting.appendleft(req)
        self._waiting_version += 1

    def _swap_out(self, state: _StepState, req: Request) -> None:
        num_shared = num_shared_leading_blocks(self.device_pool, req)
        owned = req.block_ids[num_shared:]
        host_ids = self.host_pool.allocate(len(owned))
        state.swap_out.extend(zip(owned, host_ids, strict=True))
        self.device_pool.free(req.block_ids)
        req.block_ids = []
        req.num_committed_blocks = 0
        req.num_released_blocks = num_shared
        req.host_block_ids = host_ids
        req.status = RequestStatus.SWAPPED
        self._swapped[req.req_id] = req

    def _swap_in(self, state: _StepState, req: Request, shared: list[int]) -> None:
        self.device_pool.share(shared)  # first: allocate() below must not evict them
        device_ids = self.device_pool.allocate(len(req.host_block_ids))
        state.swap_in.extend(zip(req.host_block_ids, device_ids, strict=True))
        self.host_pool.free(req.host_block_ids)
        req.host_block_ids = []
        req.block_ids = shared + device_ids
        req.num_committed_blocks = len(shared)
        req.num_released_blocks = 0
        req.status = RequestStatus.RUNNING
        del self._swapped[req.req_id]
        self._running[req.req_id] = req

    def _finish(self, req: Request, reason: FinishReason, message: str) -> None:
        if req.status is RequestStatus.WAITING:
            _remove_by_identity(self._waiting, req)
            self._waiting_version += 1
        elif req.status is RequestStatus.RUNNING:
            del self._running[req.req_id]
        elif req.status is RequestStatus.SWAPPED:
            del self._swapped[req.req_id]
        self.device_pool.free(req.block_ids)
        self.host_pool.free(req.host_block_ids)
        req.block_ids = []
        req.host_block_ids = []
        req.num_committed_blocks = req.num_released_blocks = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_message = message
        del self._requests[req.req_id]
        self._paused.discard(req.req_id)
        self.policy.observe_finish(req, reason)
        self.policy.forget(req.req_id)

    # == results of a step ================================================

    def update(
        self,
        plan: StepPlan,
        sampled: Mapping[str, int],
        now: float,
        step_s: float | None = None,
        is_stopped: StopCheck | None = None,
    ) -> list[RequestOutput]:
        """Applies the runner's results for ``plan`` (the latest plan): advances
        computed tokens, appends sampled tokens, finishes on EOS, max tokens or
        a stop sequence. One output per request that got a token or finished.
        Sequences whose request ended after planning (abort) are skipped.
        Raises ValueError — before changing anything — for a stale plan or a
        missing sample.

        ``step_s``: the step's measured seconds; the cost model refits from it.
        ``is_stopped(req_id, token_id)`` is asked once per token appended, in
        order (the engine's text-level stop sequences): True ends the request
        with STOP_SEQUENCE unless EOS or a limit ended it first."""
        if plan.step != self._in_flight_step:
            raise ValueError(f"plan {plan.step} is not the plan in flight")
        in_flight = self._in_flight
        current = []
        for seq in plan.seqs:
            req = in_flight.get(seq.req_id)
            if req is not None and _is_current(seq, req):
                current.append((seq, req))
        missing = [seq.req_id for seq, _ in current if seq.sample and seq.req_id not in sampled]
        if missing:
            raise ValueError(f"no sampled token for {missing}")
        self._in_flight_step = None
        self._in_flight = {}
        outputs = []
        for seq, req in current:
            req.num_computed_tokens += len(seq.token_ids)
            if self._prefix_cache:
                commit_computed_blocks(self.device_pool, req)
            if seq.sample:
                outputs.append(self._append_token(req, sampled[seq.req_id], now, is_stopped))
        if step_s is not None and self._cost_model is not None:
            self._cost_model.observe_plan(plan, step_s)
        return outputs

    def _append_token(
        self, req: Request, token_id: int, now: float, is_stopped: StopCheck | None
    ) -> RequestOutput:
        req.output_token_ids.append(token_id)
        if req.first_token_time is None:
            req.first_token_time = now
        hit_stop = is_stopped is not None and is_stopped(req.req_id, token_id)
        reason = self._stop_reason(req, token_id)
        if reason is None and hit_stop:
            reason = FinishReason.STOP_SEQUENCE
        if reason is not None:
            self._finish(req, reason, "")
            self._note_finish(now)
        return RequestOutput(req.req_id, [token_id], reason)  # by position: see _add_seq

    def _note_finish(self, now: float) -> None:
        """Tracks the average gap between completions (for retry hints)."""
        last, self._last_finish_time = self._last_finish_time, now
        if last is None:
            return
        gap = now - last
        average = self._finish_gap_s
        self._finish_gap_s = (
            gap if average is None else average + _FINISH_GAP_EWMA * (gap - average)
        )

    def _stop_reason(self, req: Request, token_id: int) -> FinishReason | None:
        if not req.ignore_eos and token_id in req.eos_token_ids:
            return FinishReason.EOS
        if req.num_output_tokens >= req.max_new_tokens:
            return FinishReason.MAX_TOKENS
        if req.num_tokens >= self.config.max_model_len:
            return FinishReason.MAX_TOKENS
        return None

    # == queries ==========================================================

    @property
    def step(self) -> int:
        """Number of ``schedule()`` calls so far (= the latest plan's step)."""
        return self._step

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def num_used_device_blocks(self) -> int:
        return self.device_pool.num_used

    @property
    def num_free_device_blocks(self) -> int:
        return self.device_pool.num_free

    @property
    def num_used_host_blocks(self) -> int:
        return self.host_pool.num_used

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free

    @property
    def num_recompute_preemptions(self) -> int:
        return self._num_preemptions[PreemptionMode.RECOMPUTE]

    @property
    def num_swap_preemptions(self) -> int:
        return self._num_preemptions[PreemptionMode.SWAP]

    @property
    def num_expired(self) -> int:
        """Requests finished DEADLINE_EXCEEDED by ``schedule()``."""
        return self._num_expired

    @property
    def num_abandoned(self) -> int:
        """Requests ended early by ``schedule()`` as unable to make a time limit."""
        return self._num_abandoned

    @property
    def num_prefix_queried_tokens(self) -> int:
        """Tokens looked up in the prefix cache, one look-up per admission."""
        return self._num_prefix_queried_tokens

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Of ``num_prefix_queried_tokens``, those found cached (not prefilled)."""
        return self._num_prefix_hit_tokens

    @property
    def num_lost_swaps(self) -> int:
        """Swapped requests sent back to wait because their shared prefix was evicted."""
        return self._num_lost_swaps

    @property
    def num_cached_device_blocks(self) -> int:
        """Device blocks in the prefix cache (held or evictable)."""
        return self.device_pool.num_cached

    @property
    def num_overload_refused(self) -> dict[int, int]:
        """Arrivals turned away as Overloaded, by priority class."""
        return {c: n for (c, reason), n in self._num_refused.items() if reason == "overloaded"}

    @property
    def num_refused_for_capacity(self) -> dict[tuple[int, str], int]:
        """Arrivals turned away at the door for capacity, by (priority
        class, reason): ``overloaded`` (Overloaded) or ``queue_full``
        (QueueFull: the waiting queue at its bound, nothing to shed)."""
        return dict(self._num_refused)

    @property
    def overload_estimate(self) -> float | None:
        """The policy's load estimate (``SchedulingPolicy.overload_estimate``)."""
        return self.policy.overload_estimate()

    @property
    def num_held_back(self) -> int:
        """Times batch shaping held a request's tokens out of a step."""
        return self._num_held_back

    def num_shed_by_priority(self) -> dict[int, int]:
        """Requests shed from a full queue, by priority class (ascending)."""
        return dict(sorted(self._num_shed.items()))

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def observe_idle(self, idle_s: float) -> None:
        """No request was live for ``idle_s`` seconds (the policy's estimates
        relax toward what a lone request costs)."""
        self.policy.observe_idle(idle_s)

    def live_req_ids(self) -> list[str]:
        """Ids of every unfinished request, in arrival order."""
        return list(self._requests)

    def get_request(self, req_id: str) -> Request | None:
        """The live request with this id (None once finished)."""
        return self._requests.get(req_id)

    def counts_by_priority(self) -> dict[int, dict[str, int]]:
        """``{priority: {"waiting": n, "running": n, "swapped": n}}`` over live
        requests, classes in ascending order."""
        counts: dict[int, dict[str, int]] = {}
        queues = (("waiting", self._waiting), ("running", self._running.values()))
        for name, reqs in (*queues, ("swapped", self._swapped.values())):
            for req in reqs:
                row = counts.setdefault(req.priority, {"waiting": 0, "running": 0, "swapped": 0})
                row[name] += 1
        return dict(sorted(counts.items()))

    # == helpers ==========================================================

    def _ordered_waiting(self, state: _StepState, now: float) -> list[Request]:
        """``policy.order_waiting`` of the waiting queue, asked once per step
        while the queue is unchanged (the seam lets an order depend only on
        the queue, its requests and ``now`` within a step). Read-only."""
        if state.waiting_version != self._waiting_version:
            state.waiting_order = self.policy.order_waiting(self._waiting, now)
            state.waiting_version = self._waiting_version
        return state.waiting_order

    def _running_list(self) -> list[Request]:
        return list(self._running.values())

    def _has_room_for_another(self, state: _StepState) -> bool:
        return state.token_budget > 0 and len(self._running) < self.config.max_num_seqs

    def _most_urgent_waiting_key(self, now: float) -> tuple[float, ...] | None:
        if not self.policy.is_urgency_driven or not self._waiting:
            return None
        return min(self.policy.urgency_key(r, now) for r in self._waiting)

    def _held(self, state: _StepState, req: Request, now: float) -> int:
        """Budget held back from ``req`` for more urgent waiting work."""
        if not state.reservations:
            return 0
        key = self.policy.urgency_key(req, now)
        return sum(tokens for k, tokens in state.reservations if k < key)

    def _rigid_running_tokens(self) -> int:
        return sum(self._rigid_tokens(r) for r in self._running.values())

    def _rigid_tokens(self, req: Request) -> int:
        """The share of the budget a running request needs to make progress:
        one token for a decode, one block's worth of a prefill chunk."""
        return min(req.num_uncomputed_tokens, self.config.block_size)

    def _fits(self, num_blocks: int, num_seqs: int) -> bool:
        return (
            self.device_pool.can_allocate(num_blocks)
            and len(self._running) + num_seqs <= self.config.max_num_seqs
        )

    def _check_is_running(self, req: Request) -> None:
        if self._running.get(req.req_id) is not req:
            raise ValueError(f"policy chose {req.req_id!r}, which is not running")


def _is_current(seq: ScheduledSeq, req: Request) -> bool:
    """The request is still running and exactly where the plan left it."""
    return req.status is RequestStatus.RUNNING and req.num_computed_tokens == seq.start_pos


def _expiry(req: Request, now: float) -> tuple[ExpiredLimit, str] | None:
    if req.deadline is not None and req.deadline <= now:
        return ExpiredLimit.DEADLINE, "deadline exceeded"
    if (
        req.first_token_deadline is not None
        and req.first_token_time is None
        and req.first_token_deadline <= now
    ):
        return ExpiredLimit.FIRST_TOKEN, "first-token deadline exceeded"
    return None


def _remove_by_identity(queue: deque[Request], req: Request) -> None:
    for index, queued in enumerate(queue):
        if queued is req:
            del queue[index]
            return
    raise ValueError(f"request {req.req_id!r} is not in the queue")

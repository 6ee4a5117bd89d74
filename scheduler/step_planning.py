"""The passes of one ``schedule()`` that fill the step, after room is made:
running work first, then swapped work resumed, then waiting work admitted,
each in the policy's order, under the token budget, the batch shaper and
the budget held back for more urgent waiting work.
"""

from __future__ import annotations

from collections.abc import Sequence

from .block_manager import BlockHash
from .cost_model import StepShape
from .plan import PENDING_TOKEN, ScheduledSeq
from .request import Request, RequestStatus
from .room import RoomMaking
from .scheduler_state import _StepState
from .speculative import DRAFT_PROBE_STEPS, Drafter, DraftPrice

_RUNNING = RequestStatus.RUNNING  # per running request a step: see deadline_estimates.py
_NO_DRAFTS: tuple[int, ...] = ()


class StepPlanning(RoomMaking):
    """Schedules running, swapped and waiting work into the step."""

    def _schedule_running(self, state: _StepState, now: float) -> None:
        state.shaper = self.policy.batch_shaper(now)
        if self._drafting:
            state.draft_price = self._draft_price()
        reserved = sum(max(0, tokens) for _, tokens in state.reservations)
        for req in self.policy.order_running(self._running_list(), now):
            if state.token_budget == 0:
                return
            if req.status is not _RUNNING or req.req_id in self._paused:
                continue  # preempted as a victim earlier in this loop, or paused
            if req.req_id in self._held_for_results:
                continue  # its step in flight decides what follows: see Scheduler.schedule
            uncomputed = len(req.prompt_token_ids) + len(req.output_token_ids)
            uncomputed -= req.num_computed_tokens
            available = self._available(state, req, now, uncomputed, reserved)
            num_new = self._shaped(state, req, min(uncomputed, available))
            if num_new > 0 and self._grow_or_preempt(state, req, num_new, now):
                drafts: Sequence[int] = _NO_DRAFTS
                if self._drafting:
                    drafts = self._drafts(state, req, num_new, reserved)
                self._add_seq(state, req, num_new, drafts)

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
            req.mark_resumed(now)
            req.block_ids.extend(self.device_pool.append(req.block_ids, target))
            self._add_seq(state, req, num_new)

    def _schedule_waiting(self, state: _StepState, now: float) -> None:
        """Admits waiting work in the policy's order until the budget, the
        sequences or the blocks run out. A request that waits a step for a
        prefix being computed (prefix_sharing.py) keeps its place: those
        behind it may use the budget it leaves, not the blocks and the
        sequence slot it would have taken, so its waiting leaves nobody
        behind it better placed for the next step than its admission would."""
        if state.is_kv_exhausted:
            state.is_saturated = bool(self._waiting)
            return
        computing: set[BlockHash] | None = None  # built when first asked
        held_blocks = held_seqs = 0  # kept for requests waiting on a computing prefix
        for req in self._ordered_waiting(state, now):
            if not self._has_room_for_another(state, held_seqs):
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
            need = self._blocks_to_start(req, hits, num_new)
            if not self.device_pool.can_allocate(need + held_blocks):
                state.is_saturated = True
                return  # the head waits for blocks; nobody overtakes it
            if self._prefix_cache:
                if computing is None:
                    computing = self._computing_blocks(state)
                if self._waits_for_computing(req, hits, num_new, computing):
                    held_blocks += need
                    held_seqs += 1
                    self._num_prefix_waits += 1
                    continue
            target = cached + num_new
            self._take_prefix(req, hits)
            self._admit(req, now)
            req.block_ids.extend(self.device_pool.append(req.block_ids, target))
            self._add_seq(state, req, num_new)
            if computing is not None:
                self._note_computing(computing, req, target)

    def _draft_price(self) -> DraftPrice | None:
        """This step's ``DraftPrice`` (speculative.py): a draft token costs a
        prefill token and a context token; a token is worth the time the
        step takes per token it makes, priced for the running requests'
        decodes alone (a step with a prefill chunk too is longer, so drafts
        cost it less); holding drafts costs the step once what drafting
        steps were measured to take beyond that (``DraftOverhead``). None
        without a cost model: every draft is made.

        The once-only cost is measured, never the model's prefill-step
        coefficient, which a noisy calibration can set at many times a
        step and so rule drafting out for good; and after
        ``DRAFT_PROBE_STEPS`` steps without drafts it is waived, so that a
        step holding drafts is measured again and an estimate one bad step
        set can come back down."""
        model = self._cost_model
        if model is None or not self._running:
            return None
        c = model.coefficients
        num_decodes = len(self._running)
        context = sum(
            len(r.prompt_token_ids) + len(r.output_token_ids) for r in self._running.values()
        )
        step_s = model.step_seconds(StepShape(0, num_decodes, context))
        draft_s = c.per_prefill_token_s + c.per_context_token_s
        once_s = self._draft_overhead.seconds
        self._steps_without_drafts += 1
        if self._steps_without_drafts > DRAFT_PROBE_STEPS:
            once_s = 0.0
        return DraftPrice(step_s / num_decodes, draft_s, once_s)

    def _add_seq(
        self, state: _StepState, req: Request, num_new: int, drafts: Sequence[int] = _NO_DRAFTS
    ) -> None:
        start = req.num_computed_tokens
        num_outputs = len(req.output_token_ids)
        token_ids = req.token_slice(start, start + num_new)
        if drafts:
            token_ids.extend(drafts)
        # Fields by position, in declaration order: this runs per sequence per step.
        state.seqs.append(
            ScheduledSeq(
                req.req_id,  # req_id
                token_ids,  # token_ids
                start,  # start_pos
                list(req.block_ids),  # block_ids
                start + num_new == len(req.prompt_token_ids) + num_outputs,  # sample
                num_outputs,  # output_index
                req.sampling,  # sampling
                len(drafts),  # num_drafts
            )
        )
        state.token_budget -= num_new + len(drafts)
        if drafts:
            self._steps_without_drafts = 0
        if num_new > 1 or drafts:
            state.holds_prefill = True
        state.scheduled[req.req_id] = req
        if state.shaper is not None:
            state.shaper.commit(req, num_new, len(drafts))

    def _drafts(
        self, state: _StepState, req: Request, num_new: int, reserved: int
    ) -> Sequence[int]:
        """Draft tokens for running ``req``'s step (speculative.py): none
        unless it is a decode of a request that may draft, and at most what
        the budget left (less all that is held back for waiting work), the
        batch shaper, its token limits and the free blocks allow. A draft
        never preempts anyone; the blocks it takes (at most one a step) are
        the ones its request grows into next."""
        outputs = req.output_token_ids
        if num_new != 1 or not outputs or outputs[-1] == PENDING_TOKEN:
            return _NO_DRAFTS  # a prefill, or a decode whose last token is still in flight
        if not _may_draft(req):
            return _NO_DRAFTS
        num_tokens = len(req.prompt_token_ids) + len(outputs)
        block_size = self.config.block_size
        max_drafts = min(
            self.config.num_speculative_tokens,
            state.token_budget - num_new - reserved,
            req.max_new_tokens - len(outputs) - 1,  # the step yields up to one more
            self.config.max_model_len - num_tokens - 1,
            (len(req.block_ids) + self.device_pool.num_free) * block_size - num_tokens,
        )
        drafter = req.drafter
        if drafter is None:
            drafter = req.drafter = Drafter()
        max_drafts = drafter.num_worth(max_drafts, state.draft_price, not state.holds_prefill)
        if max_drafts > 0 and state.shaper is not None:
            max_drafts = state.shaper.fit_drafts(req, max_drafts)
        if max_drafts <= 0:
            return _NO_DRAFTS
        drafts = drafter.index.propose(req.token_slice(0, num_tokens), max_drafts)
        if drafts:
            req.block_ids.extend(self.device_pool.append(req.block_ids, num_tokens + len(drafts)))
        return drafts

    def _shaped(self, state: _StepState, req: Request, num_new: int) -> int:
        """``num_new`` as far as the batch shaper lets ``req`` have it."""
        if state.shaper is None or num_new <= 0:
            return num_new
        allowed = state.shaper.fit(req, num_new)
        if allowed == 0:
            self._num_held_back += 1
            req.num_held_back += 1
        return allowed

    def _available(
        self, state: _StepState, req: Request, now: float, needed: int, reserved: int
    ) -> int:
        """The budget a running request may use: what is left, less what is
        held back for more urgent waiting work (``_held``). That share is
        looked up only when all of ``reserved`` would leave less than
        ``needed``: below that, ``min(needed, available)`` is the same either
        way, and nobody asks which reservation outranks whom."""
        available = state.token_budget
        if state.reservations and available - reserved < needed:
            available -= self._held(state, req, now)
        return available

    def _held(self, state: _StepState, req: Request, now: float) -> int:
        """Budget held back from ``req`` for more urgent waiting work."""
        if not state.reservations:
            return 0
        key = self.policy.urgency_key(req, now)
        return sum(tokens for k, tokens in state.reservations if k < key)

    def _has_room_for_another(self, state: _StepState, num_held: int = 0) -> bool:
        """Budget left, and a sequence slot besides ``num_held`` kept ones."""
        return state.token_budget > 0 and len(self._running) + num_held < self.config.max_num_seqs

    def _most_urgent_waiting_key(self, now: float) -> tuple[float, ...] | None:
        if not self.policy.is_urgency_driven or not self._waiting:
            return None
        return min(self.policy.urgency_key(r, now) for r in self._waiting)


def _may_draft(req: Request) -> bool:
    """Whether ``req``'s decodes may carry drafts: its next token depends on
    nothing a draft would change. Log-probabilities are reported one token
    a step; penalties count every token before the next; a constraint's
    mask follows each token (``is_draftable``); ``min_tokens`` bans EOS
    until that many outputs are out. Sampling rows draft too: a
    row's draw accepts a draft as often as the model would pick it
    (kernels/sampling_speculative.py)."""
    sampling = req.sampling
    if not req.is_draftable or sampling.logprobs is not None:
        return False
    if not sampling.has_logit_adjustments:
        return True
    # min_tokens alone adjusts a row's logits only until that many outputs
    # are out (its ban on EOS and stop ids); penalties and a bias never stop.
    return not sampling.has_penalties_or_bias and len(req.output_token_ids) >= sampling.min_tokens

"""Room-making: finding device blocks, sequence slots and token budget for
work that needs them, by preempting running work the policy gives up —
before the step, for waiting work the policy makes room for
(``_make_room_for_waiting``), and during it, for a running request whose
block table must grow (``_grow_or_preempt``).
"""

from __future__ import annotations

from .preemption import Preemption
from .prefix_sharing import PrefixSharing
from .request import Request
from .scheduler_state import _StepState

# Waiting requests that found no room, past which the walk that makes room for
# waiting work stops (it stops at the first for policies that never preempt).
MAX_WAITING_AHEAD = 4


class RoomMaking(Preemption, PrefixSharing):
    """Preempts running work for waiting work and for growing block tables."""

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
            min_tokens = min(chunk, self.config.block_size) if budget else 0
            has_room = False
            while True:
                # Asked again after each victim: a preempted candidate's need
                # counts the running requests (see _blocks_to_start).
                need = reserved_blocks + self._blocks_to_start(candidate, hits, chunk)
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

    def _grow_or_preempt(self, state: _StepState, req: Request, num_new: int, now: float) -> bool:
        """Grows ``req``'s block table to cover ``num_new`` more tokens,
        preempting policy-chosen victims (running requests not yet scheduled
        this step, ``req`` included) until the blocks are there. False if
        ``req`` itself was preempted or must wait."""
        target = req.num_computed_tokens + num_new
        if target <= len(req.block_ids) * self.config.block_size:
            return True  # the usual decode: room left in the last block
        pool = self.device_pool
        # Only other requests' blocks are freed below, so the need is fixed.
        need = pool.num_blocks_to_append(req.block_ids, target)
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

    def _blocks_to_start(self, req: Request, hits: list[int], chunk: int) -> int:
        """Free blocks waiting ``req`` needs to be admitted with a first
        chunk of ``chunk`` tokens after its shared ``hits``.

        A request preempted before (dropped for recompute, or a lost swap)
        needs room for its whole recompute, prompt and outputs so far, plus
        one block per running request. It was pushed out because the running
        work needed its blocks: taken back on its first chunk alone, it would
        be pushed out again by the next block that work grows into, its
        prefill lost each time (the recompute thrash). So it waits until work
        finishes; on a drained pool it always fits (``add_request`` refuses a
        request larger than the pool). A request never preempted needs its
        first chunk only, so admission under no pressure is unchanged."""
        if req.num_preemptions == 0:
            tokens = len(hits) * self.config.block_size + chunk
            return self._blocks_to_admit(hits, self.device_pool.blocks_for(tokens))
        need = self._blocks_to_admit(hits, self.device_pool.blocks_for(req.num_tokens))
        return need + len(self._running)

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

    def _rigid_running_tokens(self) -> int:
        """``_rigid_tokens`` summed over the running work, inlined: it is
        summed once a step whenever waiting work looks for room."""
        block = self.config.block_size
        total = 0
        for r in self._running.values():
            uncomputed = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            total += uncomputed if uncomputed < block else block
        return total

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

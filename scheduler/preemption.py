"""Preemption: a running request gives its device blocks up, by swap (its
own blocks copied to the host pool, its shared prefix released) or by
recompute (blocks freed, the request back at the head of the waiting
queue); and a swapped request comes back. The policy chooses victims and
the mode; this is the mechanics.
"""

from __future__ import annotations

from .block_manager import num_shared_leading_blocks
from .policy_base import PreemptionMode
from .request import Request, RequestStatus
from .scheduler_state import SchedulerState, _StepState


class Preemption(SchedulerState):
    """Moves requests between running, swapped and waiting for room."""

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
        victim.preempted_since = now
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

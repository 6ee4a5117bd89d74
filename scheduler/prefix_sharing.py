"""The scheduler's side of the prefix cache: admission starts a request's
prefill at its first uncached token, and a swapped request finds the shared
prefix it released again at swap-in (or, when part of it was evicted, waits
to be recomputed). The cache itself is ``block_manager.py``'s.

A prefix still being computed is shared too. Requests that arrive together
with one long prompt (an ``n > 1`` completion's choices, a burst with one
system prompt) find nothing cached: the first one admitted computes the
prefix, and the rest would compute it again beside it. So a waiting request
whose next uncached blocks this very step completes, in another request's
chunk, sits the step out and is admitted on the next with those blocks as
cache hits (``_waits_for_computing``)::

    step 1    A: prefill blocks 0..11  ─────────▶ committed at update
              B, C, D: wait (their next blocks are A's 0..11)
    step 2    B, C, D: hits 0..11, prefill their last block only

Only blocks a sequence of the current step completes count, so nobody waits
on a request that is waiting, paused, swapped, preempted or finished, no two
requests wait on each other, and a wait lasts one step: if the blocks are
not committed by then (the computing request was aborted or its step
failed), the waiter finds them uncached and nobody computing them, and
computes them itself. It may wait again on the next step's chunk, but each
wait leaves fewer of its blocks uncached, so the waits end. A request waits
only when waiting costs its prefill no progress (``_waits_for_computing``
says when), whichever class or deadline the computing request has.
"""

from __future__ import annotations

from .block_manager import BlockHash, find_cached_prefix
from .policy_base import has_time_limit
from .request import Request, RequestStatus
from .scheduler_state import SchedulerState, _StepState


class PrefixSharing(SchedulerState):
    """Finds, takes and gives back shared prefix blocks."""

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
        starts at the first uncached token. Only its first admission counts
        in ``num_cached_tokens`` and the hit counters, so the hit rate is the
        requests' cached prompt tokens over their prompt tokens."""
        self.device_pool.share(hits)
        req.block_ids = list(hits)
        req.num_committed_blocks = len(hits)
        req.num_computed_tokens = len(hits) * self.config.block_size
        if req.first_scheduled_time is not None:
            return  # a re-admission after a recompute: its own blocks are no reuse
        req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        if self._prefix_cache:
            self._num_prefix_queried_tokens += req.num_prompt_tokens
            self._num_prefix_hit_tokens += req.num_cached_tokens

    def _computing_blocks(self, state: _StepState) -> set[BlockHash]:
        """Hashes of the full blocks the step's sequences so far complete
        and have not committed: cached once the step's results come.
        One-token sequences are passed over (this is asked every step that
        admits, beside hundreds of them): a decode completes no block with
        a hash yet, and a prefill cut to one token is rare enough."""
        computing: set[BlockHash] = set()
        scheduled = state.scheduled
        for seq in state.seqs:
            num_new = len(seq.token_ids) - seq.num_drafts  # a draft completes no block
            if num_new > 1:
                self._note_computing(computing, scheduled[seq.req_id], seq.start_pos + num_new)
        return computing

    def _note_computing(self, computing: set[BlockHash], req: Request, end: int) -> None:
        """Adds the blocks ``req`` completes this step, computing up to token
        ``end``: those past its committed ones, full by ``end``, whose hashes
        it has (a request's prompt blocks are hashed when it is admitted)."""
        num_full = min(end // self.config.block_size, len(req.block_hashes))
        for index in range(req.num_committed_blocks, num_full):
            computing.add(req.block_hashes[index])

    def _waits_for_computing(
        self, req: Request, hits: list[int], num_new: int, computing: set[BlockHash]
    ) -> bool:
        """Whether waiting ``req``, which would be admitted with the cached
        ``hits`` and a first chunk of ``num_new`` tokens, waits a step
        instead: when the step's other sequences complete (``computing``)
        its next uncached block and every other shareable block its chunk
        would complete. Waiting then costs its prefill no progress — on the
        next step it starts with those blocks cached, where its own chunk
        would have ended (to within a block) — and saves the step a chunk.
        What it may cost is a step of first-token latency, where the chunk
        would have ended the prefill; a request with a time limit
        (deadline, first-token deadline) does not pay that: it never waits
        when it could sample this step."""
        block = self.config.block_size
        first = len(hits)
        max_blocks = (req.num_tokens - 1) // block  # the last token's block is never shared
        if first >= max_blocks or req.block_hashes[first] not in computing:
            return False
        end = first * block + num_new
        if end >= req.num_tokens and has_time_limit(req):
            return False
        num_own = min(end // block, max_blocks)  # shareable blocks its chunk would complete
        index = first + 1
        while index < num_own and req.block_hashes[index] in computing:
            index += 1
        return index >= num_own

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

"""The scheduler's side of the prefix cache: admission starts a request's
prefill at its first uncached token, and a swapped request finds the shared
prefix it released again at swap-in (or, when part of it was evicted, waits
to be recomputed). The cache itself is ``block_manager.py``'s.
"""

from __future__ import annotations

from .block_manager import find_cached_prefix
from .request import Request, RequestStatus
from .scheduler_state import SchedulerState


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

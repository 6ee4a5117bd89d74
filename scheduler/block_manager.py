"""KV block accounting: a pool of fixed-size blocks with reference counts.

One ``BlockPool`` instance serves the device KV cache, a second one the host
(swap) pool. A request owns an ordered *block table*; token at position ``p``
lives in slot ``p % block_size`` of block ``table[p // block_size]``::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
    table       [  7    ,   2     ,   5    ]      block_size = 4, 10 tokens
                                       ^ two free slots left before a new block

Blocks are plain ints ``0 .. num_blocks - 1``. Methods come in query/commit
pairs (``can_allocate``/``allocate``, ``can_append``/``append``); a commit
whose query answered False is a caller bug and raises ``BlockAccountingError``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence


class BlockAccountingError(RuntimeError):
    """An internal invariant of the pool was violated (double free, overdraft)."""


class BlockPool:
    """Free list plus reference counts.

    Invariants, at all times:
    - a block is free (ref count 0, in the free list exactly once) or used
      (ref count >= 1, not in the free list);
    - ``num_free + num_used == num_blocks``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._num_used = 0

    # -- queries ---------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_used

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self._block_size)

    def num_blocks_to_append(self, block_ids: Sequence[int], num_tokens: int) -> int:
        """Blocks a table must gain to cover ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def can_append(self, block_ids: Sequence[int], num_tokens: int) -> bool:
        return self.can_allocate(self.num_blocks_to_append(block_ids, num_tokens))

    # -- commits ---------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes ``num_blocks`` free blocks, each with ref count 1."""
        if num_blocks < 0 or not self.can_allocate(num_blocks):
            raise BlockAccountingError(f"cannot allocate {num_blocks}, {self.num_free} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        self._num_used += num_blocks
        return block_ids

    def append(self, block_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Returns the new blocks a table needs to cover ``num_tokens`` tokens
        (possibly none); the caller extends its table with them."""
        return self.allocate(self.num_blocks_to_append(block_ids, num_tokens))

    def share(self, block_ids: Iterable[int]) -> None:
        """Adds a holder to used blocks (prefix sharing, forks)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] < 1:
                raise BlockAccountingError(f"cannot share free block {block_id}")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one holder of each block; a block whose count reaches 0 is free."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count < 1:
                raise BlockAccountingError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)
                self._num_used -= 1

    def check(self) -> None:
        """Recounts everything; raises ``BlockAccountingError`` on any mismatch."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise BlockAccountingError("a block is in the free list twice")
        zero = {i for i, count in enumerate(self._ref_counts) if count == 0}
        if zero != free_set:
            raise BlockAccountingError("free list and ref counts disagree")
        if self.num_free + self._num_used != self.num_blocks:
            raise BlockAccountingError("free + used != total")

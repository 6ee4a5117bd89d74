"""KV block accounting: a pool of fixed-size blocks with reference counts,
and the prefix cache that lets requests share full blocks of equal prefixes.

One ``BlockPool`` instance serves the device KV cache, a second one the host
(swap) pool. A request owns an ordered *block table*; token at position ``p``
lives in slot ``p % block_size`` of block ``table[p // block_size]``::

    positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
    table       [  7    ,   2     ,   5    ]      block_size = 4, 10 tokens
                                       ^ two free slots left before a new block

Blocks are plain ints ``0 .. num_blocks - 1``. Methods come in query/commit
pairs (``can_allocate``/``allocate``, ``can_append``/``append``); a commit
whose query answered False is a caller bug and raises ``BlockAccountingError``.

Prefix cache. A *full* block whose K/V are computed may be registered
(``cache``) under its *block hash*, chained over the block's token ids and
its whole prefix::

    h0 = H(ROOT, tokens[0:4])   h1 = H(h0, tokens[4:8])   h2 = H(h1, tokens[8:12])

so equal hashes mean equal prefixes, and a new request finds every leading
block it can reuse with one dictionary lookup per block (``lookup``). Cached
blocks are shared by reference count (``share``) and never written while
shared: a full block's K/V never change. A cached block whose last holder
lets go is not freed but becomes *evictable*: it keeps its K/V and its hash
until ``allocate`` runs out of never-cached free blocks and takes the least
recently released evictable one. Each block is in exactly one state::

    free       ref 0, no hash        in the free list
    evictable  ref 0, hash           in the LRU list (still findable)
    used       ref >= 1, hash or not

``num_free`` counts free *and* evictable blocks: both can be handed out.
``H`` is SHA-256, so two different prefixes never share K/V in practice,
even when one tenant crafts prompts against another's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from .request import Request

BlockHash = bytes

_ROOT_HASH: BlockHash = b"slipstream-prefix-cache-v1"


class BlockAccountingError(RuntimeError):
    """An internal invariant of the pool was violated (double free, overdraft)."""


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block: its tokens and (through
    ``parent``, the previous block's hash, or None for the first block) its
    whole prefix."""
    digest = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_blocks: int
) -> None:
    """Appends to ``hashes`` (the chain of the first ``len(hashes)`` blocks of
    ``token_ids``) until it covers ``num_blocks`` full blocks."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens do not fill {num_blocks} blocks")
    for index in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[index * block_size : (index + 1) * block_size]))


class BlockPool:
    """Free list, reference counts and the prefix cache.

    Invariants, at all times:
    - a block is free (ref count 0, no hash, in the free list exactly once),
      evictable (ref count 0, a hash, in the LRU list exactly once) or used
      (ref count >= 1, in neither list);
    - ``num_free + num_used == num_blocks`` (``num_free`` includes evictable);
    - the cache maps each hash to one block and back.
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
        self._cached: dict[BlockHash, int] = {}  # hash -> block
        self._hash_of: dict[int, BlockHash] = {}  # block -> hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recent first
        self._num_evictions = 0

    # -- queries ---------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: never-cached plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_evictable(self) -> int:
        """Cached blocks no one holds (counted in ``num_free``)."""
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, used or evictable."""
        return len(self._cached)

    @property
    def num_evictions(self) -> int:
        """Cached blocks taken back by ``allocate`` so far."""
        return self._num_evictions

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self._block_size)

    def num_blocks_to_append(self, block_ids: Sequence[int], num_tokens: int) -> int:
        """Blocks a table must gain to cover ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def can_append(self, block_ids: Sequence[int], num_tokens: int) -> bool:
        return self.can_allocate(self.num_blocks_to_append(block_ids, num_tokens))

    def lookup(self, block_hashes: Iterable[BlockHash]) -> list[int]:
        """The cached blocks of the longest leading run of ``block_hashes``
        (a request's chain): what a new request can share. Read-only."""
        hits = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_free_taken_by_share(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` are evictable: sharing them takes them
        out of ``num_free``, so admission must count them with new blocks."""
        return sum(1 for block_id in block_ids if self._ref_counts[block_id] == 0)

    # -- commits ---------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes ``num_blocks`` blocks, each with ref count 1: never-cached
        free blocks first, then the least recently released evictable ones
        (which leave the cache)."""
        if num_blocks < 0 or not self.can_allocate(num_blocks):
            raise BlockAccountingError(f"cannot allocate {num_blocks}, {self.num_free} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(block_id)]
                self._num_evictions += 1
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        self._num_used += num_blocks
        return block_ids

    def append(self, block_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Returns the new blocks a table needs to cover ``num_tokens`` tokens
        (possibly none); the caller extends its table with them."""
        return self.allocate(self.num_blocks_to_append(block_ids, num_tokens))

    def share(self, block_ids: Iterable[int]) -> None:
        """Adds a holder to used or evictable blocks (prefix hits, forks); an
        evictable block becomes used again, with its K/V intact."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                if block_id not in self._evictable:
                    raise BlockAccountingError(f"cannot share free block {block_id}")
                del self._evictable[block_id]
                self._num_used += 1
            self._ref_counts[block_id] = count + 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one holder of each block; a block whose count reaches 0 is
        free, or evictable if it is cached. Of one call's newly evictable
        blocks the last listed is evicted first: a table's tail is the part
        least likely to be shared again."""
        released = []
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count < 1:
                raise BlockAccountingError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._num_used -= 1
                if block_id in self._hash_of:
                    released.append(block_id)
                else:
                    self._free.append(block_id)
        for block_id in reversed(released):
            self._evictable[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Registers a used, full, computed block under ``block_hash``. False
        (and nothing changes) when the hash already names a block — two
        requests computed the same prefix side by side; the later copy just
        stays private — or the block is already registered."""
        if self._ref_counts[block_id] < 1:
            raise BlockAccountingError(f"cannot cache unused block {block_id}")
        if block_hash in self._cached or block_id in self._hash_of:
            return False
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def check(self) -> None:
        """Recounts everything; raises ``BlockAccountingError`` on any mismatch."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise BlockAccountingError("a block is in the free list twice")
        evictable = set(self._evictable)
        if free_set & evictable:
            raise BlockAccountingError("a block is both free and evictable")
        zero = {i for i, count in enumerate(self._ref_counts) if count == 0}
        if zero != free_set | evictable:
            raise BlockAccountingError("free and evictable lists and ref counts disagree")
        if free_set & self._hash_of.keys() or not evictable <= self._hash_of.keys():
            raise BlockAccountingError("a free block is cached or an evictable one is not")
        if {b: h for h, b in self._cached.items()} != self._hash_of:
            raise BlockAccountingError("the cache's two maps disagree")
        if self.num_free + self._num_used != self.num_blocks:
            raise BlockAccountingError("free + used != total")
        if sum(1 for count in self._ref_counts if count > 0) != self._num_used:
            raise BlockAccountingError("used count and ref counts disagree")


# -- a request's view of the prefix cache ---------------------------------


def find_cached_prefix(pool: BlockPool, req: Request) -> list[int]:
    """The cached blocks ``req`` can share: its longest cached leading run of
    full blocks, stopping before the block of its last known token — that
    token is always computed, so there are logits to sample and no shared
    block is ever written. Read-only for the pool."""
    max_blocks = (req.num_tokens - 1) // pool.block_size
    _ensure_hashes(req, pool.block_size, max_blocks)
    return pool.lookup(req.block_hashes[:max_blocks])


def commit_computed_blocks(pool: BlockPool, req: Request) -> None:
    """Registers ``req``'s full blocks whose K/V are now computed, so later
    requests can share them."""
    num_full = req.num_computed_tokens // pool.block_size
    if num_full <= req.num_committed_blocks:
        return
    _ensure_hashes(req, pool.block_size, num_full)
    for index in range(req.num_committed_blocks, num_full):
        pool.cache(req.block_ids[index], req.block_hashes[index])
    req.num_committed_blocks = num_full


def num_shared_leading_blocks(pool: BlockPool, req: Request) -> int:
    """Leading blocks of ``req``'s table someone else holds too. Sharing is
    always of a leading run (a prefix), so these are exactly the blocks a
    preempted ``req`` releases instead of swapping out."""
    count = 0
    for block_id in req.block_ids:
        if pool.ref_count(block_id) < 2:
            break
        count += 1
    return count


def _ensure_hashes(req: Request, block_size: int, num_blocks: int) -> None:
    if len(req.block_hashes) < num_blocks:
        tokens = req.token_slice(0, num_blocks * block_size)
        extend_block_hashes(req.block_hashes, tokens, block_size, num_blocks)

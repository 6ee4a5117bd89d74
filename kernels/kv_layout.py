"""Physical layout of a KV cache tensor.

Every kernel sees one *logical* shape, ``[num_blocks, block_size,
num_kv_heads, head_dim]``. The engine stores it *head-major*::

    storage [num_kv_heads, num_blocks, block_size, head_dim]   (contiguous)
    cache = storage.permute(1, 2, 0, 3)                         (the logical view)

so gathering a batch's blocks along dim 1 of the storage yields
``[num_kv_heads, num_seqs, context, head_dim]`` in one copy — the layout a
batched matmul over (kv head, sequence) reads directly. A plain contiguous
logical tensor (token-major) is accepted everywhere too; kernels ask this
module which one they hold.
"""

from __future__ import annotations

import math
import mmap

import torch


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    commit: bool = False,
) -> torch.Tensor:
    """A zero-filled head-major cache, returned as its logical view. Zeros, not
    garbage: padded attention reads unused slots under a mask, and a masked
    NaN would still poison the softmax.

    On the CPU the storage is an anonymous memory map: the kernel hands out
    zero pages on first touch, so a pool of gigabytes costs nothing at
    start-up (``torch.zeros`` writes every byte first: seconds per GB on a
    busy machine) and its memory is committed as blocks are first written.
    ``commit`` faults every page in now instead (``commit_pages``), so the
    process's memory is what it will be once every block has been used."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device).permute(1, 2, 0, 3)
    itemsize = torch.empty((), dtype=dtype).element_size()
    num_bytes = math.prod(shape) * itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype).permute(1, 2, 0, 3)
    # Page-aligned and zero by the kernel's guarantee for anonymous mappings;
    # the tensor keeps the map alive.
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    storage = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
    if commit:
        commit_pages(buffer, storage)
    return storage.permute(1, 2, 0, 3)


MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python's mmap module


def commit_pages(buffer: mmap.mmap, storage: torch.Tensor) -> None:
    """Backs every page of an anonymous map with memory now: one
    ``madvise(MADV_POPULATE_WRITE)`` (the kernel faults the pages in, zeroed,
    without a pass in user space); on an older kernel, writing zeros does it."""
    try:
        buffer.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        storage.view(torch.uint8).zero_()


def head_major(cache: torch.Tensor) -> torch.Tensor | None:
    """The contiguous ``[kv_heads, blocks, block_size, head_dim]`` storage of a
    head-major cache, or None if ``cache`` is laid out otherwise."""
    storage = cache.permute(2, 0, 1, 3)
    return storage if storage.is_contiguous() else None


def block_view(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous tensor over the same memory and the dim that indexes blocks."""
    storage = head_major(cache)
    if storage is not None:
        return storage, 1
    if not cache.is_contiguous():
        raise ValueError("a KV cache must be contiguous or head-major")
    return cache, 0


def slot_view(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous view indexed by slot (``block * block_size + offset``) and
    that dim: ``[kv_heads, slots, head_dim]`` or ``[slots, kv_heads, head_dim]``."""
    storage, dim = block_view(cache)
    if dim == 1:
        return storage.view(storage.shape[0], -1, storage.shape[3]), 1
    return storage.view(-1, storage.shape[2], storage.shape[3]), 0

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

An int8 cache (``--kv-cache-dtype int8``) keeps each row's scale in the row:
``head_dim`` int8 values, then the row's float32 scale as 4 bytes, so its
last dim is ``head_dim + 4`` and a row is ``value = int8 * scale``, one
scale per (token, kv head), symmetric (``scale = max |x| / 127``). Blocks of
such a cache copy, swap and share like any other: nothing outside the
writer and the readers knows the rows are quantized.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

INT8_SCALE_BYTES = 4  # the float32 scale after an int8 row's values


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row: ``head_dim``, and the scale's 4 bytes for int8."""
    if dtype == torch.int8:
        if head_dim % INT8_SCALE_BYTES:
            raise ValueError(f"an int8 KV cache needs head_dim % 4 == 0, got {head_dim}")
        return head_dim + INT8_SCALE_BYTES
    return head_dim


def stores(cache_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a cache of ``cache_dtype`` takes (and gives back) values of
    ``dtype``: its own dtype, or any into int8 rows."""
    return cache_dtype in (dtype, torch.int8)


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head_dim a cache holds (its last dim, less an int8 row's scale)."""
    width = cache.shape[-1]
    return width - INT8_SCALE_BYTES if cache.dtype == torch.int8 else width


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim]`` floats as int8 rows ``[..., head_dim + 4]``: values
    ``x * ((1 / amax) * 127)`` rounded half to even, then the float32 ``scale =
    amax / 127``, with ``amax = max |x|`` (at least 1e-30). The native writer
    (``cpu_attention.write_kv``) does the same float32 operations: both
    store the same bytes."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    scaled = (x32 * (torch.reciprocal(amax) * 127.0)).clamp_(-127.0, 127.0)
    values = torch.round(scaled).to(torch.int8)
    return torch.cat([values, (amax / 127.0).view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Int8 rows ``[..., head_dim + 4]`` as ``[..., head_dim]`` of ``dtype``."""
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def fill_normal_(cache: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Standard normal keys or values in every row of ``cache`` (benchmarks'
    stand-in for a filled cache); an int8 cache gets them as quantized rows."""
    if cache.dtype != torch.int8:
        cache.normal_(generator=generator)
        return
    shape = (*cache.shape[:-1], cache_head_dim(cache))
    cache.copy_(quantize_rows(torch.randn(shape, generator=generator, device=cache.device)))


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
    process's memory is what it will be once every block has been used.
    An int8 cache's rows are ``row_width`` wide (values and scale)."""
    shape = (num_kv_heads, num_blocks, block_size, row_width(head_dim, dtype))
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device).permute(1, 2, 0, 3)
    itemsize = torch.empty((), dtype=dtype).element_size()
    num_bytes = math.prod(shape) * itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype).permute(1, 2, 0, 3)
    # Page-aligned and zero by the kernel's guarantee for anonymous mappings;
    # the tensor keeps the map alive.
    buffer = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(buffer)
    storage = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
    if commit:
        commit_pages(buffer, storage)
    return storage.permute(1, 2, 0, 3)


MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python's mmap module


def advise_huge_pages(buffer: mmap.mmap) -> None:
    """Asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``, where THP
    is ``madvise``-only, as it often is): attention's K/V reads cross a 4 KiB
    page with nearly every tile (each block of each head is its own slab), and
    2 MiB pages take those TLB misses away — decode attention 0.91x (fp32) and
    0.94x (bf16) the time at 256 x 301 tokens on an AMD EPYC Zen 3. A lazy
    pool's memory is then committed 2 MiB at a time as blocks are first
    written. Where the kernel or platform has no THP, nothing changes."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    with contextlib.suppress(OSError, ValueError):
        buffer.madvise(advice)


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

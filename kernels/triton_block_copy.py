"""Triton block copy between two KV pools on one device (copy-on-write for prefix
sharing, compaction); swaps between devices go through torch's copy engine.

    pool = [(k_cache, v_cache) per layer], each [num_blocks, block_size, kv_heads, head_dim]
    pairs [(src, dst), ...]:  dst_pool[layer][kv][dst] = src_pool[layer][kv][src]

One launch per layer, grid ``(num_pairs, kv_heads)``: each program moves one
KV head's ``[block_size, head_dim]`` tile of one block, K and V, addressed
through the caches' strides. Source and destination may be laid out
differently (token-major or head-major, see ``kv_layout``); either way every
row is ``head_dim`` contiguous elements, so loads and stores are coalesced.

Device <-> host swaps are not a kernel's job: a kernel cannot address pageable
host memory, and a DMA copy from pinned memory already runs at PCIe speed, so
``triton_copy_blocks`` hands them to ``block_copy.copy_blocks``.

Read-before-write: when source and destination are the same pool and a block
is both a source and a destination, sources are first copied to a scratch pool,
so the result equals ``block_copy.reference_copy_blocks`` (re-exported here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.backend import check_launchable
from slipstream.kernels.block_copy import copy_blocks, reference_copy_blocks

__all__ = ["reference_copy_blocks", "triton_copy_blocks"]

KVPool = list[tuple[torch.Tensor, torch.Tensor]]


@triton.jit
def _block_copy_kernel(
    src_k_ptr,
    src_v_ptr,
    dst_k_ptr,
    dst_v_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    src_stride_b,
    src_stride_s,
    src_stride_h,
    dst_stride_b,
    dst_stride_s,
    dst_stride_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SIZE_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    pair = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SIZE_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (s[:, None] < BLOCK_SIZE) & (d[None, :] < HEAD_DIM)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    src = src_block * src_stride_b + head * src_stride_h + s[:, None] * src_stride_s + d[None, :]
    dst = dst_block * dst_stride_b + head * dst_stride_h + s[:, None] * dst_stride_s + d[None, :]
    tl.store(dst_k_ptr + dst, tl.load(src_k_ptr + src, mask=mask), mask=mask)
    tl.store(dst_v_ptr + dst, tl.load(src_v_ptr + src, mask=mask), mask=mask)


def triton_copy_blocks(
    src_caches: KVPool, dst_caches: KVPool, pairs: list[tuple[int, int]]
) -> None:
    """Same contract as ``block_copy.copy_blocks`` (destinations distinct, sources
    read before any destination is written)."""
    if not pairs:
        return
    if src_caches[0][0].device != dst_caches[0][0].device:
        copy_blocks(src_caches, dst_caches, pairs)
        return
    _check(src_caches, dst_caches, pairs)
    device = src_caches[0][0].device
    sources = [s for s, _ in pairs]
    destinations = [d for _, d in pairs]
    if _aliases(src_caches, dst_caches) and set(sources) & set(destinations):
        scratch = _scratch_pool(src_caches, len(pairs))
        staged = list(range(len(pairs)))
        _launch(src_caches, scratch, sources, staged, device)
        _launch(scratch, dst_caches, staged, destinations, device)
        return
    _launch(src_caches, dst_caches, sources, destinations, device)


def _launch(
    src_caches: KVPool,
    dst_caches: KVPool,
    sources: list[int],
    destinations: list[int],
    device: torch.device,
) -> None:
    src_ids = torch.tensor(sources, dtype=torch.int64, device=device)
    dst_ids = torch.tensor(destinations, dtype=torch.int64, device=device)
    _, block_size, num_kv_heads, head_dim = src_caches[0][0].shape
    for (src_k, src_v), (dst_k, dst_v) in zip(src_caches, dst_caches, strict=True):
        _block_copy_kernel[(len(sources), num_kv_heads)](
            src_k, src_v, dst_k, dst_v, src_ids, dst_ids,
            src_k.stride(0), src_k.stride(1), src_k.stride(2),
            dst_k.stride(0), dst_k.stride(1), dst_k.stride(2),
            BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim,
            SIZE_PAD=triton.next_power_of_2(block_size),
            DIM_PAD=triton.next_power_of_2(head_dim),
        )  # fmt: skip


def _aliases(src_caches: KVPool, dst_caches: KVPool) -> bool:
    return any(
        s.data_ptr() == d.data_ptr()
        for src_layer, dst_layer in zip(src_caches, dst_caches, strict=True)
        for s, d in zip(src_layer, dst_layer, strict=True)
    )


def _scratch_pool(like: KVPool, num_blocks: int) -> KVPool:
    """Token-major scratch blocks (any layout works: the kernel follows strides)."""
    k = like[0][0]
    shape = (num_blocks, *k.shape[1:])
    return [
        (torch.empty(shape, dtype=k.dtype, device=k.device),
         torch.empty(shape, dtype=k.dtype, device=k.device))
        for _ in like
    ]  # fmt: skip


def _check(src_caches: KVPool, dst_caches: KVPool, pairs: list[tuple[int, int]]) -> None:
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"{len(src_caches)} source layers vs {len(dst_caches)} destination")
    src_shape, dst_shape = src_caches[0][0].shape, dst_caches[0][0].shape
    dtype = src_caches[0][0].dtype
    for layer in (*src_caches, *dst_caches):
        for cache in layer:
            check_launchable(_block_copy_kernel, cache, src_caches[0][0])
            if cache.shape[1:] != src_shape[1:] or cache.dtype != dtype:
                raise ValueError(f"block shapes differ: {tuple(src_shape)} vs {tuple(cache.shape)}")
            if cache.stride() != layer[0].stride() or cache.stride(3) != 1:
                raise ValueError("a layer's K and V need equal strides, unit along head_dim")
    destinations = [d for _, d in pairs]
    if len(set(destinations)) != len(destinations):
        raise ValueError("destination blocks must be distinct")
    for s, d in pairs:
        if not (0 <= s < src_shape[0] and 0 <= d < dst_shape[0]):
            raise ValueError(f"block pair {(s, d)} out of range")

"""Triton KV write: scatter the step's new K/V rows into their paged cache slots.

    k [T, kv_heads, head_dim] (any row/head stride, unit dim stride)
      row t ──slot_mapping[t] = block * block_size + offset──▶ k_cache[block, offset]

The cache is addressed through its strides, so both layouts of
``kv_layout`` work: token-major (a slot's heads are one contiguous run) and
head-major (each head's ``head_dim`` row sits in that head's own plane).
One program per token copies that token's K and V for all KV heads. A
negative slot marks a padding token (e.g. a CUDA-graph batch padded to a
captured size) and is skipped. Reference: ``kv_write.reference_write_kv``
(re-exported here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention import AttentionMetadata
from slipstream.kernels.backend import check_launchable
from slipstream.kernels.kv_write import reference_write_kv

__all__ = ["reference_write_kv", "triton_write_kv", "write_kv_slots"]


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    # A padding token writes no heads (a scalar mask term would do, but the interpreter
    # rejects broadcasting a scalar boolean into a mask).
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    cache_row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst = cache_row + heads[:, None].to(tl.int64) * stride_ch + dims[None, :]
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def triton_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Same contract as ``kv_write.write_kv``: ``k``, ``v`` ``[T, kv_heads, head_dim]``
    go to ``meta.slot_mapping`` (distinct slots)."""
    write_kv_slots(k_cache, v_cache, k, v, meta.slot_mapping)


def write_kv_slots(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes row t of k/v to ``slot_mapping[t]``; rows whose slot is negative are skipped.
    Non-negative slots must be distinct and below ``num_blocks * block_size``."""
    _check(k_cache, v_cache, k, v, slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def _check(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_launchable(_kv_write_kernel, k_cache, v_cache, k, v, slot_mapping)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v caches must be one 4-d shape, got {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k/v caches need equal strides and a unit stride along head_dim")
    expected = (slot_mapping.shape[0], k_cache.shape[2], k_cache.shape[3])
    if tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise ValueError(f"k, v must be {expected}, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v need a unit stride along head_dim")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"k/v dtype {k.dtype}/{v.dtype} does not match the cache's {k_cache.dtype}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be a 1-d int32/int64 tensor")

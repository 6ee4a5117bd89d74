"""Writes this step's new keys and values into the paged KV cache.

Slot s = block_id * block_size + offset, so the cache viewed as
``[num_blocks * block_size, num_kv_heads, head_dim]`` is indexed by slot.
"""

from __future__ import annotations

import torch

from slipstream.kernels.attention import AttentionMetadata
from slipstream.kernels.kv_layout import cache_head_dim, quantize_rows, slot_view, stores


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """``k``, ``v`` ``[T, num_kv_heads, head_dim]`` go to ``meta.slot_mapping`` (distinct
    slots); into an int8 cache as quantized rows (``kv_layout.quantize_rows``)."""
    _check(k_cache, v_cache, k, v, meta)
    for cache, new in ((k_cache, k), (v_cache, v)):
        if cache.dtype == torch.int8:
            new = quantize_rows(new)
        slots, dim = slot_view(cache)
        slots.index_copy_(dim, meta.slot_mapping, new.transpose(0, 1) if dim == 1 else new)


def reference_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Token by token, through block id and offset."""
    if k_cache.dtype == torch.int8:
        k, v = quantize_rows(k), quantize_rows(v)
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        block, offset = divmod(slot, meta.block_size)
        k_cache[block, offset] = k[t]
        v_cache[block, offset] = v[t]


def _check(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    if k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have one shape")
    expected = (meta.num_tokens, k_cache.shape[2], cache_head_dim(k_cache))
    if tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise ValueError(f"k, v must be {expected}, got {tuple(k.shape)}, {tuple(v.shape)}")
    if not (stores(k_cache.dtype, k.dtype) and stores(v_cache.dtype, v.dtype)):
        raise ValueError(f"k/v dtype {k.dtype} does not match the cache's {k_cache.dtype}")

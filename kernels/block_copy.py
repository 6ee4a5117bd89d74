"""Copies whole KV blocks between pools: swap out (device -> host), swap in
(host -> device) and copy-on-write (device -> device).

A pool is a list of per-layer ``(k_cache, v_cache)``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; both pools have the same
number of layers and per-block shape (their block counts may differ).
"""

from __future__ import annotations

import torch

from slipstream.kernels.kv_layout import block_view

KVPool = list[tuple[torch.Tensor, torch.Tensor]]


def copy_blocks(src_caches: KVPool, dst_caches: KVPool, pairs: list[tuple[int, int]]) -> None:
    """``dst[d] = src[s]`` for every ``(s, d)`` in ``pairs``, every layer, K and V.

    All sources are read before any destination is written, so with
    ``src_caches is dst_caches`` a block may be both a source and a destination.
    Destinations must be distinct.
    """
    if not pairs:
        return
    _check(src_caches, dst_caches, pairs)
    src_device, dst_device = src_caches[0][0].device, dst_caches[0][0].device
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_device)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_device)
    for src_layer, dst_layer in zip(src_caches, dst_caches, strict=True):
        for src, dst in zip(src_layer, dst_layer, strict=True):
            (src_store, src_dim), (dst_store, dst_dim) = block_view(src), block_view(dst)
            blocks = src_store.index_select(src_dim, src_ids).to(dst_device, non_blocking=False)
            if src_dim != dst_dim:
                raise ValueError("source and destination pools have different layouts")
            dst_store.index_copy_(dst_dim, dst_ids, blocks)


def reference_copy_blocks(
    src_caches: KVPool, dst_caches: KVPool, pairs: list[tuple[int, int]]
) -> None:
    """Block by block, layer by layer (snapshot first: same read-before-write semantics)."""
    snapshot = [[src[s].clone() for s, _ in pairs] for layer in src_caches for src in layer]
    dst_tensors = [dst for layer in dst_caches for dst in layer]
    for blocks, dst in zip(snapshot, dst_tensors, strict=True):
        for block, (_, d) in zip(blocks, pairs, strict=True):
            dst[d].copy_(block)


def _check(src_caches: KVPool, dst_caches: KVPool, pairs: list[tuple[int, int]]) -> None:
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"{len(src_caches)} source layers vs {len(dst_caches)} destination")
    src_shape, dst_shape = src_caches[0][0].shape, dst_caches[0][0].shape
    if src_shape[1:] != dst_shape[1:] or src_caches[0][0].dtype != dst_caches[0][0].dtype:
        raise ValueError(f"block shapes differ: {tuple(src_shape)} vs {tuple(dst_shape)}")
    destinations = [d for _, d in pairs]
    if len(set(destinations)) != len(destinations):
        raise ValueError("destination blocks must be distinct")
    for s, d in pairs:
        if not (0 <= s < src_shape[0] and 0 <= d < dst_shape[0]):
            raise ValueError(f"block pair {(s, d)} out of range")

"""Triton paged attention for prefill chunks: several query tokens per sequence,
causal within the chunk, attending to the sequence's earlier cached blocks.

A chunk of ``q_len`` tokens of a sequence of length ``seq_len`` (after this
step) has a cached prefix of ``prefix = seq_len - q_len`` tokens; query row r
sits at position ``prefix + r`` and sees keys ``0 .. prefix + r``::

    keys   0 ......... prefix-1 | prefix ........ seq_len-1
    row 0  ####################   #
    row 1  ####################   ##
    row r  ####################   ###...#   (r + 1 of this step's keys)

``write_kv`` has already put this step's keys in the cache, so all keys are
read the same way, through the block table.

Grid ``(cdiv(max_q_len, BLOCK_M), num_heads, num_chunks)``: a program takes
``BLOCK_M`` query rows of one head and walks key tiles of ``TILE`` tokens up to
its last row's position, with an online softmax in fp32. Programs past a
chunk's end exit without work.

Reference: ``attention.reference_paged_attention`` (re-exported here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention import reference_paged_attention
from slipstream.kernels.backend import check_launchable
from slipstream.kernels.triton_paged_decode import (
    attention_dot,
    check_attention_inputs,
    needs_upcast,
)

__all__ = ["causal_tile", "paged_prefill", "reference_paged_attention"]

_BLOCK_M = 32
_LOG2E = 1.4426950408889634


@triton.jit
def causal_tile(
    q,
    m_i,
    l_i,
    acc,
    query_pos,
    tile,
    seq_len,
    k_cache_ptr,
    v_cache_ptr,
    table,
    head_offset,
    d,
    dim_ok,
    qk_scale,
    stride_cb,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One key tile of a causal online softmax: rows at ``query_pos`` see the
    tile's keys up to their own position, read through the block ``table``.
    Returns the running max, sum and fp32 accumulator after the tile."""
    pos = tile * TILE + tl.arange(0, TILE)
    key_ok = pos < seq_len
    block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    kv_rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_offset
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    scores = attention_dot(q, tl.trans(k), UPCAST) * qk_scale  # log2 domain
    visible = key_ok[None, :] & (pos[None, :] <= query_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    # Tile 0 holds key 0, visible to every row: m_new is finite from the start.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + attention_dot(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    seq_ids_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.load(seq_ids_ptr + tl.program_id(2))
    q_start = tl.load(query_start_ptr + b)
    q_len = (tl.load(query_start_ptr + b + 1) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    kv_head = head // GROUP

    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < q_len
    d = tl.arange(0, DIM_PAD)
    dim_ok = d < HEAD_DIM
    q_rows = (q_start + r).to(tl.int64)
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask)
    query_pos = prefix + r

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_ch
    # Keys up to the last valid row's position; none when the block is past the chunk.
    last_key = tl.minimum(prefix + (m_block + 1) * BLOCK_M, seq_len)
    num_tiles = tl.where(m_block * BLOCK_M < q_len, tl.cdiv(last_key, TILE), 0)
    for tile in range(0, num_tiles):
        m_i, l_i, acc = causal_tile(
            q, m_i, l_i, acc, query_pos, tile, seq_len, k_cache_ptr, v_cache_ptr, table,
            head_offset, d, dim_ok, qk_scale, stride_cb, stride_cs, BLOCK_SIZE, TILE, UPCAST,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    check: bool = True,
) -> None:
    """For each sequence b in ``seq_ids``, rows ``query_start_loc[b] ..
    query_start_loc[b + 1]`` of ``out`` get causal attention over keys
    ``0 .. seq_lens[b]`` (the last ``q_len`` of which are this chunk's).

    ``max_query_len`` bounds the chunk lengths (read on the host: no device
    sync). ``check`` as for ``paged_decode``."""
    if check:
        _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids, out)
    num_chunks = seq_ids.shape[0]
    if num_chunks == 0 or max_query_len == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    grid = (triton.cdiv(max_query_len, _BLOCK_M), q.shape[1], num_chunks)
    _prefill_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=q.shape[1] // num_kv_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=_BLOCK_M,
        TILE=max(64, block_size),
        UPCAST=needs_upcast(q, _prefill_kernel),
    )  # fmt: skip


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor,
    out: torch.Tensor,
) -> None:
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, out)
    check_launchable(_prefill_kernel, q, query_start_loc, seq_ids)
    if query_start_loc.shape != (seq_lens.shape[0] + 1,):
        raise ValueError("query_start_loc must have one more entry than seq_lens")
    if seq_ids.dim() != 1 or seq_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("seq_ids must be a 1-d int32/int64 tensor")

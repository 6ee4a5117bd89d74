"""Triton paged attention for decodes: one query token per sequence, read through
its block table, with split-K for long contexts.

Grid ``(num_decodes, num_kv_heads, num_splits)``. One program owns one KV head
of one sequence and all ``group = num_heads / num_kv_heads`` query heads that
share it, so every K/V byte is loaded once per step (GQA costs no extra
traffic). It walks its share of the context in tiles of ``TILE`` tokens::

    positions  0 ........ 63 | 64 ....... 127 | ...      tile = max(64, block_size)
    block id   table[b, pos // block_size]    (a tile spans whole blocks)
    K rows     k_cache[block, pos % block_size, kv_head, :]   (head_dim contiguous)

The cache is addressed through its strides: token-major and head-major
(``kv_layout``) caches both work; head-major makes each (block, kv head) one
contiguous ``block_size * head_dim`` run.

keeping an online softmax (running max, running sum, fp32 accumulator). With
``num_splits > 1`` each split covers a contiguous range of tiles and writes a
partial output plus its log-sum-exp; ``_merge_kernel`` combines the splits.

The query tile is padded to 16 rows (``tl.dot``'s minimum M on tensor cores);
rows past the group are zero and never stored.

Reference: ``attention.reference_paged_attention`` (re-exported here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention import reference_paged_attention
from slipstream.kernels.backend import check_launchable

__all__ = [
    "attention_dot",
    "check_attention_inputs",
    "choose_num_splits",
    "needs_upcast",
    "paged_decode",
    "reference_paged_attention",
]

# Programs wanted in flight: ~4 per SM on a 132-SM GPU. Fewer (seq x kv_head)
# pairs than this leave SMs idle on long contexts, so the context is split.
_TARGET_PROGRAMS = 512
# A split shorter than this makes the merge (one more pass over S partials) dominate.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 16
_MIN_DOT_ROWS = 16
_LOG2E = 1.4426950408889634


@triton.jit
def attention_dot(a, b, UPCAST: tl.constexpr):
    """fp32 products (IEEE) when UPCAST, else the inputs' own tensor-core dot with
    fp32 accumulation. UPCAST serves fp32 caches (no silent TF32) and the
    interpreter, whose ``tl.dot`` multiplies bfloat16 bit patterns as integers
    (triton-lang/triton#11584)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


# tiles_per_split varies with the context: not specialized on (== 1, % 16),
# so a new context length never compiles a variant in the middle of serving.
@triton.jit(do_not_specialize=["tiles_per_split"])
def _decode_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    seq_ids_ptr,
    token_ids_ptr,
    qk_scale,
    tiles_per_split,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(seq_ids_ptr + row)
    token = tl.load(token_ids_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    dim_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & dim_ok[None, :]
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_ch
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(seq_len, TILE))
    for tile in range(first, last):
        pos = tile * TILE + tl.arange(0, TILE)
        key_ok = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_offset
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = attention_dot(q, tl.trans(k), UPCAST) * qk_scale  # log2 domain
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + attention_dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    # An empty split (context shorter than its range) has l_i == 0: weight 0 in the merge.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # partials [num_decodes, num_heads, NUM_SPLITS, DIM_PAD] fp32, lse [.., NUM_SPLITS]
        part_row = (row.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * DIM_PAD + d[None, :], out, mask=q_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=g < GROUP)


@triton.jit
def _merge_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    token_ids_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(token_ids_ptr + row).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    base = (row.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
    # Split 0 always holds keys (seq_len >= 1), so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(
        part_out_ptr + (base + s)[:, None] * DIM_PAD + d[None, :],
        mask=(s[:, None] < NUM_SPLITS) & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0)
    dst = out_ptr + token * stride_ot + head * stride_oh + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Power-of-two split count: 1 when (seq x kv_head) programs already fill the
    GPU or contexts are short, else enough splits to fill it, each split at least
    ``_MIN_SPLIT_TOKENS`` long."""
    programs = num_seqs * num_kv_heads
    by_length = max_seq_len // _MIN_SPLIT_TOKENS
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, max(programs, 1))
    limit = min(by_length, by_occupancy, _MAX_SPLITS)
    if limit < 2:
        return 1
    return 1 << (limit.bit_length() - 1)


def possible_num_splits(max_seq_len: int) -> list[int]:
    """Every split count ``choose_num_splits`` may pick for contexts up to
    ``max_seq_len``, ascending: each is a compiled variant of the kernel."""
    limit = min(max_seq_len // _MIN_SPLIT_TOKENS, _MAX_SPLITS)
    counts = [1]
    while counts[-1] * 2 <= limit:
        counts.append(counts[-1] * 2)
    return counts


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_ids: torch.Tensor,
    token_ids: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
    check: bool = True,
) -> None:
    """For each i, ``out[token_ids[i]] = attention(q[token_ids[i]], keys and values
    0 .. seq_lens[b] of sequence b = seq_ids[i])``, all heads.

    ``max_seq_len`` bounds ``seq_lens[seq_ids]`` (it sizes the split, read on the
    host so no device sync is needed); ``num_splits`` None picks one. ``check``
    False skips validating the inputs (~20 us of host time): for the layers
    after the first of a step, whose inputs differ only in their buffers."""
    if check:
        _check(q, k_cache, v_cache, block_tables, seq_lens, seq_ids, token_ids, out)
    num_decodes = seq_ids.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_decodes, num_kv_heads, max_seq_len)
    if num_decodes == 0 or max_seq_len == 0:
        return
    tile = max(64, block_size)
    tiles_per_split = triton.cdiv(triton.cdiv(max_seq_len, tile), num_splits)
    dim_pad = triton.next_power_of_2(head_dim)
    parts, lse = _partials(num_decodes, q.shape[1], num_splits, dim_pad, q.device)
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        out, parts, lse, q, k_cache, v_cache, block_tables, seq_lens, seq_ids, token_ids,
        scale * _LOG2E, tiles_per_split,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group,
        GROUP_PAD=max(_MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        TILE=tile,
        NUM_SPLITS=num_splits,
        UPCAST=needs_upcast(q, _decode_kernel),
    )  # fmt: skip
    if num_splits > 1:
        _merge_kernel[(num_decodes, q.shape[1])](
            out, parts, lse, token_ids, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip


def _partials(
    num_decodes: int, num_heads: int, num_splits: int, dim_pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    if num_splits == 1:  # unused by the kernel; any pointer will do
        empty = torch.empty(1, dtype=torch.float32, device=device)
        return empty, empty
    shape = (num_decodes, num_heads, num_splits)
    return (
        torch.empty((*shape, dim_pad), dtype=torch.float32, device=device),
        torch.empty(shape, dtype=torch.float32, device=device),
    )


def needs_upcast(q: torch.Tensor, kernel: object) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return q.dtype == torch.float32 or isinstance(kernel, InterpretedFunction)


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_ids: torch.Tensor,
    token_ids: torch.Tensor,
    out: torch.Tensor,
) -> None:
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, out)
    check_launchable(_decode_kernel, q, seq_ids, token_ids)
    if seq_ids.shape != token_ids.shape or seq_ids.dim() != 1:
        raise ValueError("seq_ids and token_ids must be 1-d and of one length")
    for name, ids in (("seq_ids", seq_ids), ("token_ids", token_ids)):
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {ids.dtype}")


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Shapes, dtypes, strides and device shared by the decode and prefill kernels."""
    check_launchable(_decode_kernel, q, k_cache, v_cache, block_tables, seq_lens, out)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k/v cache {tuple(k_cache.shape)}")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError("num_heads must be a multiple of num_kv_heads, head dims equal")
    if out.shape != q.shape or not (q.dtype == out.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("out must match q's shape; q, out and the caches one dtype")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k/v caches need equal strides and a unit stride along head_dim")
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q and out need a unit stride along head_dim")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be 2-d with contiguous rows")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError("seq_lens must have one entry per block-table row")
    if seq_lens.dtype != torch.int32 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError("seq_lens must be int32, block_tables int32 or int64")

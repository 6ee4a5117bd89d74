"""Triton paged attention for a whole ragged step in one launch: decode rows
and prefill chunks alike, with a grid fixed by the step's padded size, so a
CUDA graph can hold it.

The decode and prefill kernels size their grids from the step (how many
rows decode, the longest chunk), which only the host knows: a step holding
a prefill cannot be one graph with them. Here every sequence, whatever its
query length, is cut into query blocks of ``BLOCK_Q`` tokens, and program
``p`` finds its block by a binary search over the staged query starts::

    first block of sequence b   start(b) = query_start_loc[b] // BLOCK_Q + b
    program p                   b = the last sequence with start(b) <= p
                                block p - start(b) of b's query tokens

``start`` grows by at least the blocks each sequence needs, so ``T //
BLOCK_Q + num_seqs`` programs cover a step of T tokens; the rest find a
block past their sequence's end and exit. The sequence count is read from
the device (``num_seqs``, one staged word), so the launch depends only on
the bound: a graph captured at T tokens and R rows serves every step of up
to T tokens and R sequences.

A program owns one KV head and ``BLOCK_M = BLOCK_Q * GROUP`` rows (padded
to a power of two, at least 16 for ``tl.dot``): the GROUP query heads of
each of its BLOCK_Q tokens, so every K/V tile it reads serves them all.
Row m is token ``m // GROUP`` of the block, head ``kv_head * GROUP + m %
GROUP``. It walks key tiles up to its last token's position with an online
softmax in fp32, causal within the chunk (a decode row is a chunk of one).

There is no split of long contexts (the decode kernel's split-K): a decode
row with a long context is walked by one program per KV head. The runner
uses this kernel for steps whose decode contexts are short enough for that
(``layer_graphs.py``); decode-only steps keep the decode kernel.

Reference: ``attention.reference_paged_attention`` (re-exported here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention import reference_paged_attention
from slipstream.kernels.backend import check_launchable
from slipstream.kernels.triton_paged_decode import check_attention_inputs, needs_upcast
from slipstream.kernels.triton_paged_prefill import causal_tile

__all__ = ["block_rows", "paged_varlen", "reference_paged_attention", "varlen_programs"]

_MIN_DOT_ROWS = 16
_LOG2E = 1.4426950408889634


def block_rows(group: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_Q)`` for ``group`` query heads a KV head: 16 rows
    (``tl.dot``'s minimum) or the group's next power of two, and the tokens
    whose heads fill them."""
    rows = max(_MIN_DOT_ROWS, triton.next_power_of_2(group))
    return rows, rows // group


def varlen_programs(num_tokens: int, max_seqs: int, group: int) -> int:
    """Programs a KV head that cover any step of up to ``num_tokens`` tokens
    in up to ``max_seqs`` sequences."""
    return num_tokens // block_rows(group)[1] + max_seqs


@triton.jit
def _find_seq(query_start_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence b < num_seqs whose first query block is <= pid."""
    lo = num_seqs * 0  # a tensor, as the loop makes it
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _varlen_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    num_seqs_ptr,
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
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_seqs = tl.load(num_seqs_ptr).to(tl.int32)
    b = _find_seq(query_start_ptr, pid, num_seqs, BLOCK_Q)
    if b < 0:  # no sequences
        return
    q_start = tl.load(query_start_ptr + b)
    q_len = (tl.load(query_start_ptr + b + 1) - q_start).to(tl.int32)
    q_block = pid - (q_start.to(tl.int32) // BLOCK_Q + b)
    if q_block * BLOCK_Q >= q_len:  # past the sequence's tokens
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    t = q_block * BLOCK_Q + m // GROUP  # token within the chunk
    heads = kv_head * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (t < q_len)
    d = tl.arange(0, DIM_PAD)
    dim_ok = d < HEAD_DIM
    q_rows = (q_start + t).to(tl.int64)
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    query_pos = prefix + t

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_ch
    # Keys up to the block's last token's position.
    last_key = tl.minimum(prefix + (q_block + 1) * BLOCK_Q, seq_len)
    # Tile 0 holds key 0, visible to every row (query_pos >= 0): the max is finite.
    for tile in range(0, tl.cdiv(last_key, TILE)):
        m_i, l_i, acc = causal_tile(
            q, m_i, l_i, acc, query_pos, tile, seq_len, k_cache_ptr, v_cache_ptr, table,
            head_offset, d, dim_ok, qk_scale, stride_cb, stride_cs, BLOCK_SIZE, TILE, UPCAST,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_seqs: torch.Tensor,
    num_programs: int,
    scale: float,
    out: torch.Tensor,
    check: bool = True,
) -> None:
    """For each sequence b < ``num_seqs[0]`` (a one-element device tensor), rows
    ``query_start_loc[b] .. query_start_loc[b + 1]`` of ``out`` get causal
    attention over keys ``0 .. seq_lens[b]`` (the last of which are this step's).
    Rows of q no sequence owns are left as they were.

    ``num_programs`` per KV head must cover the step: ``varlen_programs`` of
    its token count and sequence count, or any bound above them (a graph's).
    ``check`` False skips validating the inputs (a step's later layers)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    if check:
        _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, out)
    if num_programs == 0:
        return
    rows, tokens = block_rows(group)
    _varlen_kernel[(num_programs, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=rows,
        BLOCK_Q=tokens,
        TILE=max(64, block_size),
        UPCAST=needs_upcast(q, _varlen_kernel),
    )  # fmt: skip


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_seqs: torch.Tensor,
    out: torch.Tensor,
) -> None:
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, out)
    check_launchable(_varlen_kernel, q, query_start_loc, num_seqs)
    if query_start_loc.shape != (seq_lens.shape[0] + 1,):
        raise ValueError("query_start_loc must have one more entry than seq_lens")
    if num_seqs.numel() != 1 or num_seqs.dtype not in (torch.int32, torch.int64):
        raise ValueError("num_seqs must be a one-element int32/int64 tensor")

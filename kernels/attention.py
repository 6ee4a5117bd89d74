"""Paged attention over a ragged batch: step metadata, the CPU fast path, a reference.

KV cache of one layer (the runner allocates one pair per layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

    block_tables[b] = [7, 2, 9]         sequence b, seq_len 37, block_size 16
    positions        0..15 16..31 32..36
    blocks           7     2      9 (slots 9*16+0 .. 9*16+4 used)

Everything that is the same for every layer of a step (slot mapping, which
sequences decode, gather indices, masks) is built once by
``build_attention_metadata``; ``paged_attention`` per layer only gathers the
blocks it needs and calls SDPA.

The torch path gathers whole blocks (``index_select`` into a reused
workspace) and runs ``F.scaled_dot_product_attention``:

- decodes (query length 1) of similar length share one padded, masked call,
  with q viewed as ``[n, kv_heads, group, head_dim]`` so GQA needs no copy;
- each prefill chunk gets its own call, causal when it starts at position 0,
  else with a mask offset by the cached prefix.

The fields above ``num_tokens`` are backend-neutral (other backends, picked
in ``backend.py``, read only those); the rest serve the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slipstream.kernels.kv_layout import cache_head_dim, dequantize_rows, head_major, stores
from slipstream.kernels.workspace import Workspace, default_workspace

# Splitting a decode group costs one more gather + two matmuls + a softmax per
# layer; in the head-major matmul path padding is cheap. Cut a group only when
# the padding saved exceeds this many (sequence x block) units. Measured per
# layer call (bf16, 2 threads, contexts 150-700): batch 64 took 14.3 ms in 12
# groups (threshold 24), 11.2 ms in 5 (96), 11.8 ms in 1; batch 128 took
# 25.8 / 22.5 / 23.9 ms.
_SPLIT_COST_BLOCKS = 96


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Single-token queries attended in one padded SDPA call.

    Rows of q: ``token_index`` if set, else ``token_start .. token_start + num_seqs``.
    ``block_ids`` is ``num_seqs * num_blocks`` long (row-major, padded with valid
    block ids); keys ``0 .. context_len`` of each row are read, ``mask``
    (``[num_seqs, 1, 1, context_len]``, True = attend) hides the padding; it is
    None when every sequence has exactly ``context_len`` tokens.
    """

    token_index: torch.Tensor | None
    token_start: int
    num_seqs: int
    num_blocks: int
    context_len: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None
    # For the head-major matmul path, which reads whole blocks (a slice to
    # context_len would make every matmul copy its operands): an additive
    # float32 bias [1, num_seqs, 1, num_blocks * block_size], 0 = attend,
    # -inf = padding; None when no position is padding.
    bias: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A multi-token query of one sequence: rows ``token_start .. + num_tokens``.

    Keys are positions ``0 .. context_len`` gathered from ``block_ids``; ``mask``
    (``[num_tokens, context_len]``) is the causal mask offset by the cached
    prefix, None when there is no prefix (plain causal).
    """

    token_start: int
    num_tokens: int
    context_len: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's ragged batch: B sequences, T = sum(query_lens) tokens packed in order.

    Invariants: ``1 <= query_lens[b] <= seq_lens[b]``; token i of sequence b sits
    at position ``seq_lens[b] - query_lens[b] + i``; ``block_tables`` rows are
    padded with 0 and never read past ``seq_lens[b]``.
    """

    query_lens: list[int]
    seq_lens: list[int]
    seq_lens_t: torch.Tensor  # int64 [B], seq_lens as a tensor (built once per step)
    query_start_loc: torch.Tensor  # int64 [B + 1]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int64 [B, max_num_blocks]
    block_size: int
    num_tokens: int
    decode_groups: list[DecodeGroup]
    prefill_chunks: list[PrefillChunk]
    # True when one decode group covers all T rows in order: its output is the result.
    is_single_decode_group: bool
    workspace: Workspace


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    workspace: Workspace | None = None,
    *,
    for_torch_path: bool = True,
) -> AttentionMetadata:
    """Builds everything the layers of one step share. ``dtype`` is the model's.
    ``for_torch_path=False`` skips what only the torch path reads (decode
    groups, prefill chunks, their masks): the fused kernels read the
    backend-neutral fields alone, and the host time per step shrinks."""
    del dtype  # masks are boolean; gather buffers take the cache's dtype lazily
    _check_batch(query_lens, seq_lens, block_tables, block_size)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    table = _padded_table(block_tables, device)
    decode_rows = [b for b, query_len in enumerate(query_lens) if query_len == 1]
    prefill_rows = [b for b, query_len in enumerate(query_lens) if query_len > 1]
    if not for_torch_path:
        decode_rows, prefill_rows = [], []
    groups = _decode_groups(decode_rows, starts, seq_lens, table, block_size, device)
    single = len(groups) == 1 and groups[0].num_seqs == starts[-1] and groups[0].token_index is None
    return AttentionMetadata(
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        seq_lens_t=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
        slot_mapping=_slot_mapping(query_lens, seq_lens, block_tables, block_size, device),
        block_tables=table,
        block_size=block_size,
        num_tokens=starts[-1],
        decode_groups=groups,
        prefill_chunks=[
            _prefill_chunk(b, starts, query_lens, seq_lens, table, block_size, device)
            for b in prefill_rows
        ],
        is_single_decode_group=single,
        workspace=workspace if workspace is not None else default_workspace(device),
    )


def _check_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    for query_len, seq_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 1 <= query_len <= seq_len:
            raise ValueError(f"need 1 <= query_len <= seq_len, got {query_len}, {seq_len}")
        if len(blocks) * block_size < seq_len:
            raise ValueError(f"{len(blocks)} blocks cannot hold {seq_len} tokens")


def _padded_table(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(blocks) for blocks in block_tables), default=0)
    rows = [blocks + [0] * (width - len(blocks)) for blocks in block_tables]
    if not rows:
        return torch.zeros((0, 0), dtype=torch.int64, device=device)
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _slot_mapping(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> torch.Tensor:
    slots: list[int] = []
    for query_len, seq_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        for pos in range(seq_len - query_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    return torch.tensor(slots, dtype=torch.int64, device=device)


def _decode_groups(
    rows: list[int],
    starts: list[int],
    seq_lens: list[int],
    table: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> list[DecodeGroup]:
    """Splits decodes into groups of similar length (longest first) to bound padding."""
    if not rows:
        return []
    num_blocks = {b: -(-seq_lens[b] // block_size) for b in rows}
    by_length = sorted(rows, key=lambda b: num_blocks[b], reverse=True)
    groups: list[list[int]] = [[by_length[0]]]
    for i, b in enumerate(by_length[1:], start=1):
        saved = (num_blocks[groups[-1][0]] - num_blocks[b]) * (len(by_length) - i)
        if saved > _SPLIT_COST_BLOCKS:
            groups.append([b])
        else:
            groups[-1].append(b)
    if len(groups) == 1:
        groups = [rows]  # keep packed order: rows may then be a plain slice of q
    return [_decode_group(g, starts, seq_lens, table, block_size, device) for g in groups]


def _decode_group(
    rows: list[int],
    starts: list[int],
    seq_lens: list[int],
    table: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> DecodeGroup:
    tokens = [starts[b] for b in rows]
    is_slice = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
    lens = [seq_lens[b] for b in rows]
    context_len = max(lens)
    num_blocks = -(-context_len // block_size)
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    mask = None
    if min(lens) != context_len:
        positions = torch.arange(context_len, device=device)
        mask = (positions[None, :] < lens_t[:, None]).view(len(rows), 1, 1, context_len)
    bias = _padding_bias(lens_t, num_blocks * block_size)
    return DecodeGroup(
        token_index=None if is_slice else torch.tensor(tokens, dtype=torch.int64, device=device),
        token_start=tokens[0],
        num_seqs=len(rows),
        num_blocks=num_blocks,
        context_len=context_len,
        block_ids=table.index_select(0, row_index)[:, :num_blocks].reshape(-1),
        mask=mask,
        bias=bias,
    )


def _padding_bias(lens: torch.Tensor, padded_len: int) -> torch.Tensor | None:
    """``[1, n, 1, padded_len]`` float32: 0 where a key exists, -inf past each length."""
    if int(lens.min()) == padded_len:
        return None
    positions = torch.arange(padded_len, device=lens.device)
    bias = torch.zeros((lens.shape[0], padded_len), dtype=torch.float32, device=lens.device)
    bias.masked_fill_(positions[None, :] >= lens[:, None], float("-inf"))
    return bias.view(1, lens.shape[0], 1, padded_len)


def _prefill_chunk(
    b: int,
    starts: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    table: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> PrefillChunk:
    query_len, context_len = query_lens[b], seq_lens[b]
    num_blocks = -(-context_len // block_size)
    mask = None
    if context_len != query_len:
        prefix = context_len - query_len
        keys = torch.arange(context_len, device=device)
        queries = torch.arange(query_len, device=device)
        mask = keys[None, :] <= queries[:, None] + prefix
    return PrefillChunk(
        token_start=starts[b],
        num_tokens=query_len,
        context_len=context_len,
        block_ids=table[b, :num_blocks].clone(),
        mask=mask,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``q [T, num_heads, head_dim] -> [T, num_heads, head_dim]``, causal within each
    sequence over its cached and new tokens (``write_kv`` must already have run)."""
    _check_shapes(q, k_cache, v_cache, meta)
    if meta.is_single_decode_group:
        return _attend_decode(q, k_cache, v_cache, meta.decode_groups[0], scale, meta.workspace)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for group in meta.decode_groups:
        result = _attend_decode(q, k_cache, v_cache, group, scale, meta.workspace)
        if group.token_index is None:
            out[group.token_start : group.token_start + group.num_seqs] = result
        else:
            out.index_copy_(0, group.token_index, result)
    for chunk in meta.prefill_chunks:
        end = chunk.token_start + chunk.num_tokens
        out[chunk.token_start : end] = _attend_prefill(
            q[chunk.token_start : end], k_cache, v_cache, chunk, scale, meta.workspace
        )
    return out


def _check_shapes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k/v cache {tuple(k_cache.shape)}")
    if q.shape[0] != meta.num_tokens or k_cache.shape[1] != meta.block_size:
        raise ValueError("q rows / cache block size do not match the metadata")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != cache_head_dim(k_cache):
        raise ValueError("num_heads must be a multiple of num_kv_heads, head dims equal")
    if not stores(k_cache.dtype, q.dtype):
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")


def _gather_head_major(
    storage: torch.Tensor,
    block_ids: torch.Tensor,
    role: str,
    workspace: Workspace,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Blocks of a head-major cache into the workspace, viewed
    ``[kv, len(block_ids) * block_size, d]``: one copy, matmul-ready (int8
    rows are then dequantized to ``dtype``, q's)."""
    num_kv_heads, _, block_size, width = storage.shape
    shape = (num_kv_heads, block_ids.shape[0], block_size, width)
    buffer = workspace.view(role, shape, storage.dtype)
    torch.index_select(storage, 1, block_ids, out=buffer)
    if storage.dtype == torch.int8:
        buffer = dequantize_rows(buffer, dtype)
    return buffer.view(num_kv_heads, -1, buffer.shape[-1])


def _gather(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    role: str,
    workspace: Workspace,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``cache[block_ids]`` into the workspace, viewed ``[len(block_ids) * block_size, kv, d]``."""
    _, block_size, num_kv_heads, width = cache.shape
    shape = (block_ids.shape[0], block_size, num_kv_heads, width)
    buffer = workspace.view(role, shape, cache.dtype)
    torch.index_select(cache, 0, block_ids, out=buffer)
    if cache.dtype == torch.int8:
        buffer = dequantize_rows(buffer, dtype)
    return buffer.view(-1, num_kv_heads, buffer.shape[-1])


def _attend_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    workspace: Workspace,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    n = group.num_seqs
    if group.token_index is not None:
        rows = q.index_select(0, group.token_index)
    else:
        rows = q[group.token_start : group.token_start + n]
    # [n, kv, group, d]: the heads sharing a kv head become that head's queries.
    rows = rows.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k_storage, v_storage = head_major(k_cache), head_major(v_cache)
    if k_storage is not None and v_storage is not None:
        return _attend_decode_head_major(rows, k_storage, v_storage, group, scale, workspace)
    padded = group.num_blocks * k_cache.shape[1]
    k = _gather(k_cache, group.block_ids, "k", workspace, q.dtype)
    v = _gather(v_cache, group.block_ids, "v", workspace, q.dtype)
    k, v = (t.view(n, padded, num_kv_heads, head_dim) for t in (k, v))
    k = k[:, : group.context_len].transpose(1, 2)
    v = v[:, : group.context_len].transpose(1, 2)
    out = F.scaled_dot_product_attention(rows, k, v, attn_mask=group.mask, scale=scale)
    return out.view(n, num_heads, head_dim)


def _attend_decode_head_major(
    rows: torch.Tensor,
    k_storage: torch.Tensor,
    v_storage: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    workspace: Workspace,
) -> torch.Tensor:
    """Two batched matmuls over (kv head, sequence) with a float32 softmax
    between them. On the CPU this beats SDPA's flash kernel for single-token
    queries several times over (it tiles for long queries); scores are
    rounded to the cache dtype before the softmax, as transformers' eager
    attention does."""
    n, num_kv_heads, group_size, head_dim = rows.shape
    k = _gather_head_major(k_storage, group.block_ids, "k", workspace, rows.dtype)
    v = _gather_head_major(v_storage, group.block_ids, "v", workspace, rows.dtype)
    k = k.view(num_kv_heads, n, -1, head_dim)
    v = v.view(num_kv_heads, n, -1, head_dim)
    queries = rows.permute(1, 0, 2, 3) * scale  # [kv, n, group, d]; scaled here, the small side
    scores = torch.matmul(queries, k.transpose(-1, -2))
    if group.bias is not None:
        scores.add_(group.bias.to(scores.dtype))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
    out = torch.matmul(probs, v)  # [kv, n, group, d]
    return out.permute(1, 0, 2, 3).reshape(n, num_kv_heads * group_size, head_dim)


def _attend_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    workspace: Workspace,
) -> torch.Tensor:
    k_storage, v_storage = head_major(k_cache), head_major(v_cache)
    if k_storage is not None and v_storage is not None:
        # [kv, context, d] straight from the gather
        k = _gather_head_major(k_storage, chunk.block_ids, "k", workspace, q.dtype)
        v = _gather_head_major(v_storage, chunk.block_ids, "v", workspace, q.dtype)
        k, v = k[:, : chunk.context_len], v[:, : chunk.context_len]
    else:
        k = _gather(k_cache, chunk.block_ids, "k", workspace, q.dtype)
        v = _gather(v_cache, chunk.block_ids, "v", workspace, q.dtype)
        k, v = (t[: chunk.context_len].transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Per-sequence, per-head softmax(QK^T)V in float32 from the block tables alone."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if k_cache.dtype == torch.int8:  # rows with their scales: to float32 first
        k_cache, v_cache = (dequantize_rows(c, torch.float32) for c in (k_cache, v_cache))
    k_flat = k_cache.reshape(-1, *k_cache.shape[2:]).float()
    v_flat = v_cache.reshape(-1, *v_cache.shape[2:]).float()
    for b, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens, strict=True)):
        positions = torch.arange(seq_len)
        blocks = meta.block_tables[b, positions // meta.block_size]
        slots = blocks * meta.block_size + positions % meta.block_size
        start = int(meta.query_start_loc[b])
        keys = k_flat[slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        values = v_flat[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        for i in range(query_len):
            visible = seq_len - query_len + i + 1
            query = q[start + i].float().unsqueeze(1)  # [H, 1, D]
            scores = (query @ keys[:, :visible].transpose(1, 2)) * scale
            out[start + i] = (torch.softmax(scores, dim=-1) @ values[:, :visible]).squeeze(1)
    return out.to(q.dtype)

"""Random ragged batches laid out in a paged KV cache, with their dense twins."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from slipstream.kernels.kv_layout import dequantize_rows, quantize_rows


@dataclass(frozen=True, slots=True)
class PagedBatch:
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, head_dim]
    values: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    spare_blocks: int = 5,
    head_major: bool = False,
) -> PagedBatch:
    """Scatters each sequence's KV over shuffled blocks; every other slot holds
    random (finite) garbage, so reading past a sequence shows up in the output."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(order[used : used + count])
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    keys, values = [], []
    for seq_len, table in zip(seq_lens, tables, strict=True):
        k = torch.randn((seq_len, num_kv_heads, head_dim), generator=generator).to(dtype)
        v = torch.randn((seq_len, num_kv_heads, head_dim), generator=generator).to(dtype)
        positions = torch.arange(seq_len)
        blocks = torch.tensor(table)[positions // block_size]
        k_cache[blocks, positions % block_size] = k
        v_cache[blocks, positions % block_size] = v
        keys.append(k)
        values.append(v)
    if head_major:
        k_cache, v_cache = to_head_major(k_cache), to_head_major(v_cache)
    return PagedBatch(query_lens, seq_lens, tables, block_size, keys, values, k_cache, v_cache)


def to_head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same logical cache stored head-major, as the engine allocates it."""
    return cache.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def dense_attention(q: torch.Tensor, batch: PagedBatch, scale: float) -> torch.Tensor:
    """softmax(QK^T)V per unpaged sequence, float64, causal with the cached prefix."""
    outputs, start = [], 0
    for query_len, seq_len, k, v in zip(
        batch.query_lens, batch.seq_lens, batch.keys, batch.values, strict=True
    ):
        group = q.shape[1] // k.shape[1]
        qs = q[start : start + query_len].double().transpose(0, 1)  # [H, q, D]
        ks = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        vs = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale
        positions = torch.arange(seq_len - query_len, seq_len)
        hidden = torch.arange(seq_len)[None, :] > positions[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        outputs.append((torch.softmax(scores, dim=-1) @ vs).transpose(0, 1))
        start += query_len
    return torch.cat(outputs)


def quantized(batch: PagedBatch) -> PagedBatch:
    """``batch`` with int8 caches (rows and scales, head-major) and, as its
    dense twin, the values those rows stand for."""

    def rows(cache: torch.Tensor) -> torch.Tensor:
        return to_head_major(quantize_rows(cache))

    def twin(seqs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [dequantize_rows(quantize_rows(x), torch.float64) for x in seqs]

    return replace(
        batch,
        keys=twin(batch.keys),
        values=twin(batch.values),
        k_cache=rows(batch.k_cache),
        v_cache=rows(batch.v_cache),
    )

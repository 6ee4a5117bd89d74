"""Seeded ragged batches for the Triton attention tests, and per-dtype tolerances."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from paged_fixtures import PagedBatch, make_paged_batch

from slipstream.kernels.attention import AttentionMetadata, build_attention_metadata

CPU = torch.device("cpu")

# Against the fp32 reference and the float64 dense attention. bf16 outputs are
# rounded to 8 significant bits (one ulp is 2**-6 at magnitudes 2..4, where these
# outputs can sit), and the kernel rounds softmax weights to bf16 before P @ V
# as a tensor-core kernel does; fp32 differs from the reference only by
# summation order.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}


@dataclass(frozen=True, slots=True)
class Case:
    """One attention problem: a paged batch, its metadata and queries."""

    batch: PagedBatch
    meta: AttentionMetadata
    q: torch.Tensor
    scale: float


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    head_major: bool = False,
) -> Case:
    """``head_major`` stores the cache as the engine allocates it (``kv_layout``)."""
    generator = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(
        query_lens, seq_lens, block_size, num_kv_heads, head_dim, dtype, generator,
        head_major=head_major,
    )  # fmt: skip
    meta = build_attention_metadata(
        query_lens, seq_lens, batch.block_tables, block_size, CPU, dtype
    )
    shape = (sum(query_lens), num_kv_heads * group, head_dim)
    q = torch.randn(shape, generator=generator).to(dtype)
    return Case(batch, meta, q, head_dim**-0.5)


def ragged_contexts(rng: random.Random, batch: int, block_size: int, max_len: int) -> list[int]:
    """Random lengths in 1..max_len, led by the edges: 1 token, exactly one
    block, one block plus one token, the maximum."""
    edges = [1, block_size, block_size + 1, max_len]
    return (edges + [rng.randint(1, max_len) for _ in range(batch)])[:batch]

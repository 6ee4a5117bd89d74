"""Micro-benchmark of one paged-attention layer call on the CPU.

    python -m slipstream.kernels.bench_attention [--threads 2] [--reps 50]

Shape of the target model: 8 query heads, 4 KV heads, head_dim 64, block 16.
Decode batches of 1..256 sequences with ragged contexts around 300 tokens, and
a mixed step (a 512-token prefill chunk over a cached prefix plus decodes).
Prints median and minimum ms per layer call (write_kv excluded) for:

- ``fast``: ``paged_attention`` as shipped (decodes grouped by length);
- ``one-group``: every decode in one padded call (no length grouping);
- ``per-seq``: one SDPA call per sequence over its own gathered context.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from slipstream.kernels import attention
from slipstream.kernels.attention import AttentionMetadata, build_attention_metadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16
CPU = torch.device("cpu")


def _batch(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, rng: random.Random):
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    blocks = list(range(sum(needed) + 64))
    rng.shuffle(blocks)
    tables, used = [], 0
    for count in needed:
        tables.append(blocks[used : used + count])
        used += count
    shape = (len(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM).to(dtype)
    return q, k_cache, v_cache, tables


@contextmanager
def _no_length_grouping() -> Iterator[None]:
    saved = attention._SPLIT_COST_BLOCKS
    attention._SPLIT_COST_BLOCKS = 1 << 62
    try:
        yield
    finally:
        attention._SPLIT_COST_BLOCKS = saved


def _per_sequence(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for b, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens, strict=True)):
        start = int(meta.query_start_loc[b])
        blocks = meta.block_tables[b, : -(-seq_len // meta.block_size)]
        k = k_cache.index_select(0, blocks).view(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len]
        v = v_cache.index_select(0, blocks).view(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len]
        prefix = seq_len - query_len
        mask = None
        if prefix and query_len > 1:
            mask = torch.arange(seq_len)[None, :] <= torch.arange(query_len)[:, None] + prefix
        out[start : start + query_len] = F.scaled_dot_product_attention(
            q[start : start + query_len].transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=query_len > 1 and not prefix,
            enable_gqa=True,
        )[0].transpose(0, 1)
    return out


def _time(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), min(samples)


def _scenarios(rng: random.Random) -> list[tuple[str, list[int], list[int]]]:
    scenarios = []
    for batch in (1, 8, 64, 256):
        lens = [300] if batch == 1 else [rng.randint(200, 400) for _ in range(batch)]
        scenarios.append((f"decode b={batch} ctx~300", [1] * batch, lens))
    spread = [int(16 * (50 ** rng.random())) for _ in range(64)]  # 16..800, log-uniform
    scenarios.append(("decode b=64 ctx 16..800", [1] * 64, spread))
    decodes = [rng.randint(200, 400) for _ in range(32)]
    scenarios.append(("prefill 512 (+300 cached) + 32 dec", [512] + [1] * 32, [812, *decodes]))
    scenarios.append(("prefill 512 from 0", [512], [512]))
    return scenarios


def _measure(
    query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, reps: int, rng: random.Random
) -> dict[str, tuple[float, float]]:
    q, k_cache, v_cache, tables = _batch(query_lens, seq_lens, dtype, rng)
    scale = HEAD_DIM**-0.5

    def build() -> AttentionMetadata:
        return build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU, dtype)

    meta = build()
    with _no_length_grouping():
        padded_meta = build()
    return {
        "meta-build": _time(build, reps),
        "fast": _time(lambda: attention.paged_attention(q, k_cache, v_cache, meta, scale), reps),
        "one-group": _time(
            lambda: attention.paged_attention(q, k_cache, v_cache, padded_meta, scale), reps
        ),
        "per-seq": _time(lambda: _per_sequence(q, k_cache, v_cache, meta, scale), reps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads} reps={args.reps}; ms per layer call: median / min")
    for dtype in (torch.bfloat16, torch.float32):
        rng = random.Random(0)
        for name, query_lens, seq_lens in _scenarios(rng):
            reps = max(5, args.reps // 5) if max(query_lens) > 1 else args.reps
            results = _measure(query_lens, seq_lens, dtype, reps, rng)
            cells = "  ".join(f"{k} {med:7.3f}/{low:7.3f}" for k, (med, low) in results.items())
            print(f"{str(dtype)[6:]:9s} {name:36s} {cells}")


if __name__ == "__main__":
    main()

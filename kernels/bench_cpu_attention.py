"""Micro-benchmark: the fused CPU kernel against the torch path, one layer call.

    python -m slipstream.kernels.bench_cpu_attention [--threads 2] [--reps 30] [--home DIR]
        [--max-isa avx512|avx2|portable] [--bf16-prefill dot|tiles|dot-tiles|brgemm]
        [--kind decode|prefill]

8 query heads, 4 KV heads, head_dim 64, block_size 32, float32 and bfloat16
(each with its own K/V, then with int8 K/V rows, ``kv_layout``):
decode batches of 1, 8, 64 and 256 sequences with contexts drawn from
250..350 tokens, one decode at 2000 tokens (where the kernel splits the keys
over threads), and a 512-token prefill chunk over a 512-token cached prefix.
Prints the median ms per call of each path, the K/V bandwidth of the fused
kernel (the bytes of K and V the step must read, each cached token once, over
its median time) and its arithmetic rate (q . k and p . v over the keys each
query token sees, 4 head_dim flops a key and head: what bounds a prefill).
``--max-isa`` caps the kernel's variant (as a forced ``cpu_features.detect()``
answer would), to compare variants on one CPU; ``--bf16-prefill`` how the
AVX512-BF16 variant runs bf16 prefill chunks (``cpu_attention.set_bf16_prefill``).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slipstream.kernels import cpu_attention
from slipstream.kernels.attention import build_attention_metadata, paged_attention
from slipstream.kernels.kv_layout import allocate_kv_cache, fill_normal_
from slipstream.kernels.workspace import Workspace

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 32
CPU = torch.device("cpu")
# (q, K/V) dtypes
PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.int8),
    (torch.bfloat16, torch.int8),
]
# (label, query_lens, seq_lens) built from a seeded generator
CASES = [
    ("decode", 1, 300),
    ("decode", 8, 300),
    ("decode", 64, 300),
    ("decode", 256, 300),
    ("decode", 1, 2000),
    ("prefill", 512, 1024),
]


def _lens(kind: str, size: int, context: int, rng: random.Random) -> tuple[list[int], list[int]]:
    if kind == "prefill":  # one chunk of `size` tokens ending at position `context`
        return [size], [context]
    spread = 0 if context > 1000 else 50
    return [1] * size, [rng.randint(context - spread, context + spread) for _ in range(size)]


def _step(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype,  # type: ignore[no-untyped-def]
          kv_dtype: torch.dtype, rng: random.Random):  # fmt: skip
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    blocks = list(range(sum(needed) + 16))
    rng.shuffle(blocks)
    tables, used = [], 0
    for count in needed:
        tables.append(blocks[used : used + count])
        used += count
    k_cache = allocate_kv_cache(len(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, kv_dtype)
    v_cache = allocate_kv_cache(len(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, kv_dtype)
    fill_normal_(k_cache)
    fill_normal_(v_cache)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM).to(dtype)
    meta = build_attention_metadata(
        query_lens, seq_lens, tables, BLOCK_SIZE, CPU, dtype, workspace=Workspace(CPU)
    )
    kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * k_cache.shape[-1] * k_cache.element_size()
    keys_seen = sum(
        seq - n + i + 1 for n, seq in zip(query_lens, seq_lens, strict=True) for i in range(n)
    )
    flops = 4 * HEAD_DIM * NUM_HEADS * keys_seen
    return q, k_cache, v_cache, meta, kv_bytes, flops


def _median_ms(attend: Callable[..., torch.Tensor], inputs: tuple[object, ...], reps: int) -> float:
    for _ in range(3):
        attend(*inputs)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        attend(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _cpu_name() -> str:
    flags: set[str] = set()
    name = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return f"{name} [{' '.join(f for f in wanted if f in flags)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--home", type=Path, default=None, help="extension cache root")
    parser.add_argument("--max-isa", choices=("avx512", "avx2", "portable"), default=None,
                        help="cap the kernel's variant (default: the CPU's)")  # fmt: skip
    parser.add_argument("--bf16-prefill", choices=("dot", "tiles", "dot-tiles", "brgemm"),
                        default=None,
                        help="AVX512-BF16: bf16 prefill on dot rows, fp32/dot/brgemm tiles "
                             "(default: the CPU's, cpu_attention.bf16_prefill_for)")  # fmt: skip
    parser.add_argument("--kind", choices=("decode", "prefill"), default=None,
                        help="only the decode or the prefill cases")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.is_available(args.home):
        raise SystemExit(f"fused kernel unavailable: {cpu_attention.failure()}")
    isa = torch.ops.slipstream.paged_attention_cpu_isa()
    if args.max_isa is not None:
        isa = torch.ops.slipstream.paged_attention_set_max_isa(args.max_isa)
    if args.bf16_prefill is None:
        bf16_prefill = cpu_attention.set_cpu_bf16_prefill()
    else:
        try:
            bf16_prefill = cpu_attention.set_bf16_prefill(args.bf16_prefill)
        except RuntimeError as error:  # brgemm where oneDNN's bf16 brgemm does not run
            raise SystemExit(str(error).splitlines()[0]) from None
    print(f"CPU: {_cpu_name()}; threads {args.threads}; kernel variant {isa}; "
          f"bf16 prefill {bf16_prefill}")  # fmt: skip
    print(f"heads {NUM_HEADS}/{NUM_KV_HEADS}, head_dim {HEAD_DIM}, block {BLOCK_SIZE}; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'dtype':>8} {'kv':>8} {'step':>8} {'size':>5} {'ctx':>5} {'torch ms':>9} "
          f"{'fused ms':>9} {'speedup':>7} {'fused GB/s':>10} {'GFLOP/s':>8}")  # fmt: skip
    rng = random.Random(0)
    for dtype, kv_dtype in PAIRS:
        for kind, size, context in CASES:
            if args.kind is not None and kind != args.kind:
                continue
            query_lens, seq_lens = _lens(kind, size, context, rng)
            step = _step(query_lens, seq_lens, dtype, kv_dtype, rng)
            q, k_cache, v_cache, meta, kv_bytes, flops = step
            inputs = (q, k_cache, v_cache, meta, HEAD_DIM**-0.5)
            with torch.inference_mode():
                torch_ms = _median_ms(paged_attention, inputs, args.reps)
                fused_ms = _median_ms(cpu_attention.paged_attention, inputs, args.reps)
            name, kv_name = (str(t).removeprefix("torch.") for t in (dtype, kv_dtype))
            print(f"{name:>8} {kv_name:>8} {kind:>8} {size:>5} {context:>5} {torch_ms:>9.3f} "
                  f"{fused_ms:>9.3f} {torch_ms / fused_ms:>6.1f}x "
                  f"{kv_bytes / fused_ms / 1e6:>10.1f} {flops / fused_ms / 1e6:>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

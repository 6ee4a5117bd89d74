"""Triton KV write (under the interpreter) against ``reference_write_kv``."""

from __future__ import annotations

import random

import pytest
import torch
from paged_fixtures import to_head_major
from triton_modules import interpreted

from slipstream.kernels.attention import build_attention_metadata

pytestmark = pytest.mark.triton

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kv_write():
    return interpreted("triton_kv_write")


def _step(
    seed: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    head_major: bool,
):  # fmt: skip
    """A ragged step (decodes and chunks) over shuffled blocks, with random caches."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    batch = rng.randint(1, 16)
    query_lens = [rng.choice([1, 1, rng.randint(2, 40)]) for _ in range(batch)]
    seq_lens = [n + rng.randint(0, 300) for n in query_lens]
    needed = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(needed) + 3, generator=generator).tolist()
    tables = [order[sum(needed[:b]) : sum(needed[: b + 1])] for b in range(batch)]
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, CPU, dtype)
    shape = (len(order), block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]
    if head_major:
        caches = [to_head_major(cache) for cache in caches]
    # k and v as views of one fused projection row, as the model produces them.
    fused = torch.randn((meta.num_tokens, 3, num_kv_heads, head_dim), generator=generator)
    fused = fused.to(dtype)
    return meta, caches, fused[:, 1], fused[:, 2]


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim", "dtype", "head_major"),
    [(16, 2, 64, torch.float32, False), (32, 4, 128, torch.bfloat16, True),
     (16, 1, 32, torch.bfloat16, False), (32, 3, 80, torch.float32, True)],
)  # fmt: skip
def test_write_matches_reference(kv_write, block_size, num_kv_heads, head_dim, dtype, head_major):
    meta, (k_cache, v_cache), k, v = _step(block_size + head_dim, block_size, num_kv_heads,
                                           head_dim, dtype, head_major)  # fmt: skip
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kv_write.reference_write_kv(expected_k, expected_v, k, v, meta)
    kv_write.triton_write_kv(k_cache, v_cache, k, v, meta)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_padding_slots_are_skipped(kv_write):
    k_cache, v_cache = (to_head_major(torch.zeros(4, 16, 2, 64)) for _ in range(2))
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    kv_write.write_kv_slots(k_cache, v_cache, k, v, torch.tensor([17, -1, 63]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[3, 15], v[2])
    assert int((k_cache != 0).any(dim=3).any(dim=2).sum()) == 2  # only two slots written


def test_rejects_bad_inputs(kv_write):
    meta = build_attention_metadata([2], [2], [[1]], 16, CPU, torch.float32)
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    with pytest.raises(ValueError, match="must be"):
        kv_write.triton_write_kv(k_cache, v_cache, torch.zeros(3, 2, 64), torch.zeros(3, 2, 64),
                                 meta)  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        bf16 = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
        kv_write.triton_write_kv(k_cache, v_cache, bf16, bf16, meta)
    with pytest.raises(ValueError, match="unit stride"):
        strided = torch.zeros(2, 2, 128)[..., ::2]
        kv_write.triton_write_kv(k_cache, v_cache, strided, strided, meta)

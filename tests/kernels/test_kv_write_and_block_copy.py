"""write_kv and copy_blocks against their block-by-block references."""

from __future__ import annotations

import pytest
import torch
from paged_fixtures import to_head_major

from slipstream.kernels.attention import build_attention_metadata
from slipstream.kernels.block_copy import copy_blocks, reference_copy_blocks
from slipstream.kernels.kv_write import reference_write_kv, write_kv

CPU = torch.device("cpu")


def _pool(num_layers: int, num_blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, 8)
    return [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(num_layers)
    ]


@pytest.mark.parametrize("head_major", [False, True], ids=["token_major", "head_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype: torch.dtype, head_major: bool) -> None:
    query_lens, seq_lens, tables = [3, 1, 6], [3, 10, 9], [[5], [0, 2, 7], [1, 6, 3]]
    meta = build_attention_metadata(query_lens, seq_lens, tables, 4, CPU, dtype)
    k_cache = torch.randn(8, 4, 2, 8).to(dtype)
    v_cache = torch.randn(8, 4, 2, 8).to(dtype)
    if head_major:
        k_cache, v_cache = to_head_major(k_cache), to_head_major(v_cache)
    k, v = torch.randn(10, 2, 8).to(dtype), torch.randn(10, 2, 8).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference_write_kv(expected_k, expected_v, k, v, meta)
    write_kv(k_cache, v_cache, k, v, meta)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    # seq 1's single new token is position 9: block 7, offset 1.
    assert torch.equal(k_cache[7, 1], k[3])


def test_write_kv_accepts_strided_inputs() -> None:
    meta = build_attention_metadata([2], [2], [[1]], 4, CPU, torch.float32)
    k_cache, v_cache = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    kv = torch.randn(2, 2, 16)  # k and v as views of one fused projection
    k, v = kv[..., :8], kv[..., 8:]
    write_kv(k_cache, v_cache, k, v, meta)
    assert torch.equal(k_cache[1, :2], k) and torch.equal(v_cache[1, :2], v)


def test_write_kv_rejects_wrong_shapes() -> None:
    meta = build_attention_metadata([2], [2], [[1]], 4, CPU, torch.float32)
    with pytest.raises(ValueError, match="must be"):
        write_kv(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8), torch.zeros(3, 2, 8),
                 torch.zeros(3, 2, 8), meta)  # fmt: skip


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "pairs"),
    [
        (6, 10, [(0, 9), (5, 0), (2, 3)]),  # swap out to a bigger host pool
        (10, 6, [(9, 1)]),  # swap in
    ],
)
@pytest.mark.parametrize("head_major", [False, True], ids=["token_major", "head_major"])
def test_copy_blocks_between_pools(
    src_blocks: int, dst_blocks: int, pairs: list[tuple[int, int]], head_major: bool
) -> None:
    src, dst = _pool(3, src_blocks, 0), _pool(3, dst_blocks, 1)
    if head_major:
        src = [(to_head_major(k), to_head_major(v)) for k, v in src]
        dst = [(to_head_major(k), to_head_major(v)) for k, v in dst]
    expected = [(k.clone(), v.clone()) for k, v in dst]
    reference_copy_blocks(src, expected, pairs)
    copy_blocks(src, dst, pairs)
    for (k, v), (ek, ev) in zip(dst, expected, strict=True):
        assert torch.equal(k, ek) and torch.equal(v, ev)
    assert torch.equal(dst[2][1][pairs[0][1]], src[2][1][pairs[0][0]])


def test_copy_blocks_within_one_pool_reads_before_writing() -> None:
    pool = _pool(2, 5, 2)
    before = [(k.clone(), v.clone()) for k, v in pool]
    copy_blocks(pool, pool, [(0, 1), (1, 2)])  # block 1 is both source and destination
    for (k, v), (k0, v0) in zip(pool, before, strict=True):
        assert torch.equal(k[1], k0[0]) and torch.equal(k[2], k0[1])
        assert torch.equal(v[2], v0[1]) and torch.equal(k[3], k0[3])


def test_copy_blocks_rejects_duplicate_destinations() -> None:
    pool = _pool(1, 4, 3)
    with pytest.raises(ValueError, match="distinct"):
        copy_blocks(pool, pool, [(0, 2), (1, 2)])
    with pytest.raises(ValueError, match="out of range"):
        copy_blocks(pool, pool, [(0, 4)])

"""paged_attention (fast path and reference) against dense attention over the
unpaged sequences."""

from __future__ import annotations

import pytest
import torch
from paged_fixtures import PagedBatch, dense_attention, make_paged_batch

from slipstream.kernels.attention import (
    build_attention_metadata,
    paged_attention,
    reference_paged_attention,
)
from slipstream.kernels.kv_write import write_kv
from slipstream.kernels.workspace import Workspace

HEAD_DIM = 32
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}

# (query_lens, seq_lens): prefill from 0, prefill chunks over a cached prefix,
# decodes of ragged (non-multiple) lengths, interleaved in one packed batch.
MIXED = ([1, 7, 1, 1, 20, 1, 33], [1, 7, 45, 17, 52, 100, 33])
DECODES = ([1] * 9, [1, 2, 15, 16, 17, 31, 64, 70, 199])
SPREAD_DECODES = ([1] * 12, [3, 400, 5, 390, 8, 200, 210, 16, 33, 350, 1, 90])
PREFILLS = ([5, 64, 3], [5, 100, 40])


def _run(
    lens: tuple[list[int], list[int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    seed: int = 0,
    head_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = lens
    batch = make_paged_batch(
        query_lens, seq_lens, block_size, num_kv_heads, HEAD_DIM, dtype, generator,
        head_major=head_major,
    )  # fmt: skip
    q = torch.randn((sum(query_lens), num_heads, HEAD_DIM), generator=generator).to(dtype)
    meta = _meta(batch, dtype)
    scale = HEAD_DIM**-0.5
    fast = paged_attention(q, batch.k_cache, batch.v_cache, meta, scale)
    reference = reference_paged_attention(q, batch.k_cache, batch.v_cache, meta, scale)
    return fast, reference, dense_attention(q, batch, scale)


def _meta(batch: PagedBatch, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    return build_attention_metadata(
        batch.query_lens,
        batch.seq_lens,
        batch.block_tables,
        batch.block_size,
        torch.device("cpu"),
        dtype,
        workspace=Workspace(torch.device("cpu")),
    )


@pytest.mark.parametrize("head_major", [False, True], ids=["token_major", "head_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("lens", [MIXED, DECODES, SPREAD_DECODES, PREFILLS])
def test_matches_dense_attention(
    lens: tuple[list[int], list[int]],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    head_major: bool,
) -> None:
    fast, reference, dense = _run(
        lens, block_size, num_heads, num_kv_heads, dtype, head_major=head_major
    )
    assert fast.shape == dense.shape and fast.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fast.double(), dense, atol=tol, rtol=tol)
    torch.testing.assert_close(reference.double(), dense, atol=tol, rtol=tol)


def test_single_decode() -> None:
    fast, _, dense = _run(([1], [37]), 16, 8, 4, torch.float32)
    torch.testing.assert_close(fast.double(), dense, atol=1e-5, rtol=1e-5)


def test_decodes_of_spread_lengths_use_several_groups() -> None:
    generator = torch.Generator().manual_seed(1)
    query_lens, seq_lens = SPREAD_DECODES
    batch = make_paged_batch(query_lens, seq_lens, 16, 2, HEAD_DIM, torch.float32, generator)
    meta = _meta(batch, torch.float32)
    assert len(meta.decode_groups) > 1
    assert sorted(g.num_seqs for g in meta.decode_groups) != [len(seq_lens)]


def test_after_write_kv_of_new_tokens() -> None:
    """The runner's order: write this step's K/V, then attend to cache + new tokens."""
    generator = torch.Generator().manual_seed(2)
    query_lens, seq_lens = MIXED
    batch = make_paged_batch(query_lens, seq_lens, 16, 2, HEAD_DIM, torch.float32, generator)
    new_k = torch.cat([k[-n:] for k, n in zip(batch.keys, query_lens, strict=True)])
    new_v = torch.cat([v[-n:] for v, n in zip(batch.values, query_lens, strict=True)])
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    meta = _meta(batch, torch.float32)
    slots = meta.slot_mapping
    k_cache.view(-1, 2, HEAD_DIM)[slots] = torch.randn(len(slots), 2, HEAD_DIM)  # stale
    write_kv(k_cache, v_cache, new_k, new_v, meta)
    q = torch.randn((sum(query_lens), 4, HEAD_DIM), generator=generator)
    out = paged_attention(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out.double(), dense_attention(q, batch, 0.2), atol=1e-5, rtol=1e-5)


def test_metadata_slot_mapping_and_tables() -> None:
    meta = build_attention_metadata(
        [2, 1], [5, 6], [[3, 1], [0, 4]], 4, torch.device("cpu"), torch.float32
    )
    # seq 0 positions 3, 4 -> block 3 offset 3, block 1 offset 0; seq 1 position 5 -> block 4
    # offset 1.
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.slot_mapping.tolist() == [3 * 4 + 3, 1 * 4 + 0, 4 * 4 + 1]
    assert meta.block_tables.tolist() == [[3, 1], [0, 4]]
    assert [c.num_tokens for c in meta.prefill_chunks] == [2]
    assert [g.num_seqs for g in meta.decode_groups] == [1]


def test_metadata_rejects_bad_batches() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="blocks cannot hold"):
        build_attention_metadata([1], [9], [[0, 1]], 4, cpu, torch.float32)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        build_attention_metadata([3], [2], [[0]], 4, cpu, torch.float32)

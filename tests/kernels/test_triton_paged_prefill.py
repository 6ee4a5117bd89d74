"""Triton paged prefill-chunk attention (under the interpreter): causal within
the chunk, over the sequence's earlier cached blocks, against the torch
reference and a dense softmax(QK^T)V; and mixed steps (chunks + decodes)
through the Triton backend's ``paged_attention``."""

from __future__ import annotations

import random

import pytest
import torch
from paged_fixtures import dense_attention
from triton_cases import TOLERANCES, make_case
from triton_modules import interpreted

from slipstream.kernels.attention import reference_paged_attention

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def prefill():
    return interpreted("triton_paged_prefill")


@pytest.fixture(scope="module")
def backend():
    interpreted("triton_paged_decode")
    interpreted("triton_paged_prefill")
    from slipstream.kernels import backend

    return backend


def _run_prefill(prefill, case):
    meta = case.meta
    out = torch.full_like(case.q, float("nan"))
    chunks = [b for b, n in enumerate(meta.query_lens) if n > 1]
    prefill.paged_prefill(
        case.q, case.batch.k_cache, case.batch.v_cache, meta.block_tables,
        torch.tensor(meta.seq_lens, dtype=torch.int32), meta.query_start_loc,
        torch.tensor(chunks, dtype=torch.int32), max(meta.query_lens), case.scale, out,
    )  # fmt: skip
    return out


def _check(out, case, dtype):
    batch = case.batch
    reference = reference_paged_attention(
        case.q, batch.k_cache, batch.v_cache, case.meta, case.scale
    )
    torch.testing.assert_close(out, reference, **TOLERANCES[dtype])
    torch.testing.assert_close(out.double(), dense_attention(case.q, case.batch, case.scale),
                               **TOLERANCES[dtype])  # fmt: skip


# (query_lens, cached prefix lengths, block_size, num_kv_heads, group, head_dim, dtype):
# first chunks (no prefix), chunks over a prefix that ends mid-block and on a
# block boundary, chunks longer than the 32-row query tile, and a 600-token prefix.
PREFILL_MATRIX = [
    ([5, 40], [0, 0], 16, 2, 1, 64, torch.float32, False),
    ([33, 2, 17], [100, 16, 0], 32, 2, 2, 128, torch.float32, True),
    ([64, 9], [600, 31], 16, 1, 4, 64, torch.bfloat16, False),
    ([12, 3, 70], [32, 300, 5], 32, 2, 4, 128, torch.bfloat16, True),
    ([20], [45], 16, 4, 2, 64, torch.bfloat16, True),
]


@pytest.mark.parametrize(
    ("query_lens", "prefixes", "block_size", "num_kv_heads", "group", "head_dim", "dtype",
     "head_major"),
    PREFILL_MATRIX,
)  # fmt: skip
def test_prefill_matches_reference_and_dense(
    prefill, query_lens, prefixes, block_size, num_kv_heads, group, head_dim, dtype, head_major
):
    seq_lens = [n + p for n, p in zip(query_lens, prefixes, strict=True)]
    seed = 2000 + len(seq_lens) * 7 + sum(seq_lens)
    case = make_case(
        query_lens, seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed, head_major
    )
    _check(_run_prefill(prefill, case), case, dtype)


def test_prefill_leaves_decode_rows_alone(prefill):
    case = make_case([1, 6, 1], [30, 6, 8], 16, 2, 2, 64, torch.float32, seed=5)
    out = _run_prefill(prefill, case)
    assert out[[0, 7]].isnan().all() and not out[1:7].isnan().any()


# Mixed steps as the engine builds them: decodes and chunks interleaved.
MIXED_MATRIX = [
    (16, 16, 2, 2, 64, torch.float32, True),
    (12, 32, 2, 4, 128, torch.bfloat16, False),
    (7, 16, 4, 2, 64, torch.bfloat16, True),
    (4, 32, 2, 1, 128, torch.float32, False),
]


def _mixed_batch(rng: random.Random, batch: int) -> tuple[list[int], list[int]]:
    query_lens, seq_lens = [], []
    for _ in range(batch):
        is_chunk = rng.random() < 0.3
        query_len = rng.randint(2, 48) if is_chunk else 1
        prefix = rng.choice([0, rng.randint(1, 650)]) if is_chunk else rng.randint(0, 699)
        query_lens.append(query_len)
        seq_lens.append(min(prefix + query_len, 700))
    query_lens[0], seq_lens[0] = 1, 1  # a one-token context
    if batch > 1:
        query_lens[-1], seq_lens[-1] = 40, 40  # a first chunk: plain causal
    return query_lens, seq_lens


@pytest.mark.parametrize(
    ("batch", "block_size", "num_kv_heads", "group", "head_dim", "dtype", "head_major"),
    MIXED_MATRIX,
)
def test_mixed_step_through_backend(
    backend, batch, block_size, num_kv_heads, group, head_dim, dtype, head_major
):
    shape = (batch, block_size, num_kv_heads, group, head_dim, dtype, head_major)
    seed = 3000 + MIXED_MATRIX.index(shape)
    query_lens, seq_lens = _mixed_batch(random.Random(seed), batch)
    case = make_case(
        query_lens, seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed, head_major
    )
    attend = backend.paged_attention_for("triton")
    out = attend(case.q, case.batch.k_cache, case.batch.v_cache, case.meta, case.scale)
    _check(out, case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_mixed_sweep(backend, seed):
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    query_lens, seq_lens = _mixed_batch(rng, rng.randint(1, 16))
    case = make_case(
        query_lens, seq_lens, rng.choice([16, 32]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4]),
        rng.choice([64, 128]), dtype, seed, rng.random() < 0.5,
    )  # fmt: skip
    attend = backend.paged_attention_for("triton")
    out = attend(case.q, case.batch.k_cache, case.batch.v_cache, case.meta, case.scale)
    _check(out, case, dtype)

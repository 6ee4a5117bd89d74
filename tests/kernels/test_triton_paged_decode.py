"""Triton paged decode attention (under the interpreter) against the torch
reference and a dense softmax(QK^T)V over each unpaged sequence."""

from __future__ import annotations

import random

import pytest
import torch
from paged_fixtures import dense_attention
from triton_cases import TOLERANCES, make_case, ragged_contexts
from triton_modules import interpreted

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def decode():
    return interpreted("triton_paged_decode")


# (batch, block_size, num_kv_heads, group, head_dim, dtype, head_major): every
# block size, GQA ratio, head dim, dtype and cache layout appears; the last row
# is the `small` model's shape as the engine stores it.
DECODE_MATRIX = [
    (16, 16, 2, 1, 64, torch.float32, False),
    (5, 32, 2, 2, 128, torch.float32, True),
    (9, 16, 1, 4, 128, torch.bfloat16, False),
    (3, 32, 2, 4, 64, torch.float32, True),
    (1, 32, 2, 1, 128, torch.bfloat16, False),
    (12, 16, 4, 2, 64, torch.bfloat16, True),
]


def _decode_case(
    batch, block_size, num_kv_heads, group, head_dim, dtype, head_major, seed, max_len=700
):
    rng = random.Random(seed)
    seq_lens = ragged_contexts(rng, batch, block_size, max_len)
    rng.shuffle(seq_lens)
    return make_case(
        [1] * batch, seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed, head_major
    )


def _run(decode, case, num_splits=None):
    meta = case.meta
    out = torch.full_like(case.q, float("nan"))
    batch = len(meta.seq_lens)
    ids = torch.arange(batch, dtype=torch.int32)
    seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    decode.paged_decode(
        case.q, case.batch.k_cache, case.batch.v_cache, meta.block_tables, seq_lens,
        ids, ids, max(meta.seq_lens), case.scale, out, num_splits=num_splits,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("batch", "block_size", "num_kv_heads", "group", "head_dim", "dtype", "head_major"),
    DECODE_MATRIX,
)
def test_decode_matches_reference_and_dense(
    decode, batch, block_size, num_kv_heads, group, head_dim, dtype, head_major
):
    shape = (batch, block_size, num_kv_heads, group, head_dim, dtype, head_major)
    case = _decode_case(*shape, seed=1000 + DECODE_MATRIX.index(shape))
    out = _run(decode, case)
    reference = decode.reference_paged_attention(
        case.q, case.batch.k_cache, case.batch.v_cache, case.meta, case.scale
    )
    torch.testing.assert_close(out, reference, **TOLERANCES[dtype])
    dense = dense_attention(case.q, case.batch, case.scale)
    torch.testing.assert_close(out.double(), dense, **TOLERANCES[dtype])


@pytest.mark.parametrize("num_splits", [1, 2, 4, 16])
def test_split_k_gives_the_same_attention(decode, num_splits):
    """16 splits of a 700-token context leave some splits empty for short rows."""
    case = make_case([1] * 4, [700, 1, 300, 33], 16, 2, 2, 64, torch.float32, 7, head_major=True)
    out = _run(decode, case, num_splits=num_splits)
    dense = dense_attention(case.q, case.batch, case.scale)
    torch.testing.assert_close(out.double(), dense, **TOLERANCES[torch.float32])


def test_decode_writes_only_its_rows(decode):
    """Rows of q that are not listed (e.g. prefill rows of a mixed step) stay untouched."""
    case = make_case([1, 1, 1], [40, 5, 90], 16, 2, 2, 64, torch.float32, seed=3)
    out = torch.full_like(case.q, float("nan"))
    seq_lens = torch.tensor(case.meta.seq_lens, dtype=torch.int32)
    rows = torch.tensor([0, 2], dtype=torch.int32)
    decode.paged_decode(
        case.q, case.batch.k_cache, case.batch.v_cache, case.meta.block_tables, seq_lens,
        rows, rows, 90, case.scale, out, num_splits=2,
    )  # fmt: skip
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    dense = dense_attention(case.q, case.batch, case.scale)
    torch.testing.assert_close(out[[0, 2]].double(), dense[[0, 2]], **TOLERANCES[torch.float32])


def test_choose_num_splits(decode):
    choose = decode.choose_num_splits
    assert choose(1, 4, 100) == 1  # short context: nothing to split
    assert choose(1, 4, 4096) == 16  # one long sequence: as many splits as allowed
    assert choose(8, 4, 1024) == 4  # limited by the minimum split length
    assert choose(256, 4, 4096) == 1  # the batch alone fills the GPU


def test_possible_num_splits_hold_every_choice(decode):
    """The GPU runner compiles these variants at start-up: any split count a
    step can pick must be among them, or that step pays a compile."""
    rng = random.Random(0)
    for max_len in (1, 255, 256, 512, 1000, 4096, 8192, 32768):
        possible = decode.possible_num_splits(max_len)
        assert possible == sorted(set(possible)) and possible[0] == 1
        for _ in range(200):
            num_seqs, kv_heads = rng.randint(1, 300), rng.choice([1, 2, 3, 4, 8])
            assert decode.choose_num_splits(num_seqs, kv_heads, rng.randint(1, max_len)) in possible
    assert decode.possible_num_splits(4096) == [1, 2, 4, 8, 16]


def test_decode_rejects_mismatched_inputs(decode):
    case = make_case([1], [10], 16, 2, 2, 64, torch.float32, seed=0)
    ids = torch.zeros(1, dtype=torch.int32)
    seq_lens = torch.tensor([10], dtype=torch.int32)
    cache = case.batch.k_cache
    with pytest.raises(ValueError, match="dtype"):
        decode.paged_decode(
            case.q.to(torch.bfloat16), cache, case.batch.v_cache, case.meta.block_tables,
            seq_lens, ids, ids, 10, case.scale, torch.empty_like(case.q, dtype=torch.bfloat16),
        )  # fmt: skip
    with pytest.raises(ValueError, match="int32"):
        decode.paged_decode(
            case.q, cache, case.batch.v_cache, case.meta.block_tables, seq_lens.long(),
            ids, ids, 10, case.scale, torch.empty_like(case.q),
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_decode_sweep(decode, seed):
    rng = random.Random(seed)
    shape = (
        rng.randint(1, 16), rng.choice([16, 32]), rng.choice([1, 2, 4]),
        rng.choice([1, 2, 4]), rng.choice([64, 128]), rng.choice([torch.float32, torch.bfloat16]),
        rng.random() < 0.5,
    )  # fmt: skip
    case = _decode_case(*shape, seed=seed, max_len=rng.choice([64, 700, 2048]))
    out = _run(decode, case)
    dense = dense_attention(case.q, case.batch, case.scale)
    torch.testing.assert_close(out.double(), dense, **TOLERANCES[shape[5]])

"""Triton paged attention for a whole ragged step in one launch (under the
interpreter): decode rows and prefill chunks together against the torch
reference and a dense softmax(QK^T)V, with more programs than the step
needs (a graph's bound) and rows no sequence owns left untouched."""

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
def varlen():
    return interpreted("triton_paged_varlen")


def _run(varlen, case, extra_programs=0, padding=0):
    """The step's rows followed by ``padding`` rows no sequence owns."""
    meta = case.meta
    q = torch.cat([case.q, torch.randn(padding, *case.q.shape[1:]).to(case.q.dtype)])
    out = torch.full_like(q, float("nan"))
    group = q.shape[1] // case.batch.k_cache.shape[2]
    programs = varlen.varlen_programs(sum(meta.query_lens), len(meta.query_lens), group)
    varlen.paged_varlen(
        q, case.batch.k_cache, case.batch.v_cache, meta.block_tables,
        torch.tensor(meta.seq_lens, dtype=torch.int32), meta.query_start_loc,
        torch.tensor([len(meta.query_lens)]), programs + extra_programs, case.scale, out,
    )  # fmt: skip
    assert out[q.shape[0] - padding :].isnan().all()
    return out[: q.shape[0] - padding]


def _check(out, case, dtype):
    reference = reference_paged_attention(
        case.q, case.batch.k_cache, case.batch.v_cache, case.meta, case.scale
    )
    torch.testing.assert_close(out, reference, **TOLERANCES[dtype])
    torch.testing.assert_close(out.double(), dense_attention(case.q, case.batch, case.scale),
                               **TOLERANCES[dtype])  # fmt: skip


# (query_lens, cached prefix lengths, block_size, num_kv_heads, group, head_dim, dtype,
# head_major): decodes beside chunks; a group of 3 (blocks of 5 tokens, 15 of 16 rows),
# of 1 (16 tokens) and of 8; chunks ending on and off a query block; a one-token context.
VARLEN_MATRIX = [
    ([1, 1, 7, 1], [30, 0, 0, 64], 16, 3, 3, 64, torch.float32, True),
    ([5, 1, 16, 33], [0, 90, 16, 100], 16, 2, 1, 64, torch.float32, False),
    ([1, 40, 1], [700, 0, 17], 32, 1, 8, 128, torch.bfloat16, True),
    ([12, 1, 3, 1, 70], [32, 299, 300, 5, 0], 16, 3, 3, 64, torch.bfloat16, True),
    ([1], [0], 16, 2, 2, 64, torch.float32, False),
]


@pytest.mark.parametrize(
    ("query_lens", "prefixes", "block_size", "num_kv_heads", "group", "head_dim", "dtype",
     "head_major"),
    VARLEN_MATRIX,
)  # fmt: skip
def test_varlen_matches_reference_and_dense(
    varlen, query_lens, prefixes, block_size, num_kv_heads, group, head_dim, dtype, head_major
):
    seq_lens = [n + p for n, p in zip(query_lens, prefixes, strict=True)]
    seed = 4000 + len(seq_lens) * 7 + sum(seq_lens)
    case = make_case(
        query_lens, seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed, head_major
    )
    _check(_run(varlen, case), case, dtype)


def test_a_graphs_bound_and_unowned_rows(varlen):
    """More programs than the step needs (a graph captured for a larger step)
    exit without writing; rows after the last sequence's stay untouched."""
    case = make_case([1, 9, 1], [20, 30, 1], 16, 2, 3, 64, torch.float32, seed=11)
    _check(_run(varlen, case, extra_programs=37, padding=6), case, torch.float32)


def test_no_sequences_writes_nothing(varlen):
    q = torch.randn(4, 2, 64)
    cache = torch.randn(2, 16, 1, 64)
    out = torch.full_like(q, float("nan"))
    varlen.paged_varlen(
        q, cache, cache.clone(), torch.zeros(1, 1, dtype=torch.int64),
        torch.ones(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64),
        torch.tensor([0]), 5, 1.0, out,
    )  # fmt: skip
    assert out.isnan().all()


def test_programs_cover_any_step_of_the_bound(varlen):
    """Every query block of every sequence has a program for any split of T
    tokens into at most R sequences: the first block of sequence b is
    start(b) = query_start[b] // BLOCK_Q + b, and the last lies below
    ``varlen_programs(T, R, group)``."""
    rng = random.Random(0)
    for group in (1, 2, 3, 4, 8, 16, 32):
        _, block_q = varlen.block_rows(group)
        for _ in range(200):
            seqs = rng.randint(1, 12)
            lens = [rng.randint(1, 40) for _ in range(seqs)]
            starts = [0]
            for n in lens:
                starts.append(starts[-1] + n)
            programs = varlen.varlen_programs(starts[-1], seqs, group)
            for b, n in enumerate(lens):
                first = starts[b] // block_q + b
                last = first + -(-n // block_q) - 1
                assert last < programs
                if b + 1 < seqs:
                    assert last < starts[b + 1] // block_q + b + 1


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_varlen_sweep(varlen, seed):
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    batch = rng.randint(1, 12)
    query_lens = [rng.choice([1, 1, rng.randint(2, 40)]) for _ in range(batch)]
    seq_lens = [n + rng.choice([0, rng.randint(1, 400)]) for n in query_lens]
    case = make_case(
        query_lens, seq_lens, rng.choice([16, 32]), rng.choice([1, 2, 3]),
        rng.choice([1, 2, 3, 4]), rng.choice([64, 128]), dtype, seed, rng.random() < 0.5,
    )  # fmt: skip
    _check(_run(varlen, case, extra_programs=rng.randint(0, 20)), case, dtype)

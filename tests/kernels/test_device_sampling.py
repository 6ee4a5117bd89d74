"""The tensor sampler picks what ``sampling.sample`` picks, row for row, on the CPU."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.device_sampling import plan_sampling, sample_tensors, sampling_batch
from slipstream.kernels.sampling import sample

VOCAB = 257


def _both(rows: list[tuple[float, int, float, int | None]], seed: int = 0) -> tuple[list, list]:
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    temps = [r[0] for r in rows]
    ks = [r[1] for r in rows]
    ps = [r[2] for r in rows]
    seeds = [r[3] for r in rows]
    indices = [i * 3 for i in range(len(rows))]
    expected = sample(logits, temps, ks, ps, seeds, indices, torch.Generator().manual_seed(7))
    plan = plan_sampling(temps, ks, ps, seeds, indices, VOCAB)
    batch = sampling_batch(plan, torch.device("cpu"))
    got = sample_tensors(logits, batch, torch.Generator().manual_seed(7))
    return expected, got.tolist()


CASES = {
    "all_greedy": [(0.0, 0, 1.0, None), (0.7, 1, 1.0, 5), (0.0, 40, 0.5, None)],
    "seeded": [(0.8, 0, 1.0, 11), (1.3, 0, 1.0, 12), (0.5, 0, 1.0, 13)],
    "unseeded": [(0.8, 0, 1.0, None), (1.0, 0, 1.0, None)],
    "mixed": [
        (0.0, 0, 1.0, None),
        (0.9, 20, 1.0, 3),
        (1.1, 0, 0.8, None),
        (0.7, 5, 0.9, 4),
        (1.0, 1, 1.0, None),
        (1.5, 0, 1.0, None),
        (0.6, 300, 0.95, 9),
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tensor_sampler_equals_cpu_sampler(name):
    for seed in range(5):
        expected, got = _both(CASES[name], seed)
        assert got == expected


def test_seeded_row_does_not_depend_on_its_batch():
    alone = _both([(0.9, 10, 0.9, 42)])[1][0]
    logits_seed = 0
    crowd = _both([(0.9, 10, 0.9, 42), (1.0, 0, 1.0, None)], logits_seed)[1][0]
    # row 0's logits are the same in both draws (same generator, row-major)
    assert alone == crowd


def test_plan_normalises_top_k_and_skips_greedy_rows():
    plan = plan_sampling(
        [0.0, 1.0, 1.0], [0, 300, 7], [1.0, 1.0, 0.5], [None, 1, None], [0, 4, 0], 257
    )
    assert plan.rows == [1, 2]
    assert plan.top_ks == [0, 7] and plan.max_top_k == 7
    assert plan.seeded == [0] and plan.unseeded == [1]
    assert plan.seeds == [1] and plan.output_indices == [4]
    assert plan.any_top_p


def test_wrong_row_count_is_refused():
    plan = plan_sampling([1.0], [0], [1.0], [None], [0], VOCAB)
    batch = sampling_batch(plan, torch.device("cpu"))
    with pytest.raises(ValueError, match="logits must be"):
        sample_tensors(torch.zeros(2, VOCAB), batch)


@pytest.mark.parametrize("vocab", [VOCAB, 49_152], ids=["unchunked", "smollm2-vocabulary"])
def test_every_row_sampling_picks_as_among_greedy_rows(vocab):
    """Every row sampling (the logits divided whole, no gather, no argmax)
    and the same seeded rows among greedy ones (gathered): the same tokens,
    and the logits left as they were."""
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2)) * 3
    temps, ks, ps = (
        [0.8, 1.2, 0.6, 1.0, 0.9, 1.5],
        [0, 40, 0, 7, 0, 300],
        [1.0, 1.0, 0.9, 0.5, 1.0, 0.95],
    )
    seeds, indices = [11, 12, 13, 14, 15, 16], [0, 1, 2, 3, 4, 5]
    before = logits.clone()
    alone = sample(logits, temps, ks, ps, seeds, indices)
    assert torch.equal(logits, before)
    greedy = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 3
    mixed = torch.cat([greedy[:1], logits[:3], greedy[1:], logits[3:]])
    tokens = sample(
        mixed,
        [0.0, *temps[:3], 0.0, 0.7, *temps[3:]],
        [0, *ks[:3], 0, 1, *ks[3:]],
        [1.0, *ps[:3], 1.0, 1.0, *ps[3:]],
        [None, *seeds[:3], None, 5, *seeds[3:]],
        [0, *indices[:3], 0, 0, *indices[3:]],
    )
    assert tokens[1:4] + tokens[6:] == alone
    assert [tokens[0], *tokens[4:6]] == greedy.argmax(-1).tolist()

"""vLLM's min-p in the sampler, on a small vocabulary with fixed generators:
the filter against a probability-space reference, its place among the
others (after temperature, before top-k and top-p), greedy rows and rows
without it untouched; and min_tokens' mask (``logit_adjustments``' ban)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from slipstream.kernels.device_sampling import plan_sampling, sample_tensors, sampling_batch
from slipstream.kernels.logit_adjustments import (
    AdjustedRow,
    adjust_logits_,
    adjustment_tensors,
    plan_adjustments,
)
from slipstream.kernels.sampling import sample
from slipstream.kernels.sampling_filters import filter_min_p_, min_p_weights
from slipstream.kernels.sampling_primitives import exp_weights_

# Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = [math.log(p) for p in PROBS]
ROWS = 512


def reference_kept(logits: list[float], min_p: float) -> list[bool]:
    """vLLM's MinPLogitsProcessor: a token is kept where its softmax
    probability is at least min_p times the row's largest."""
    probs = torch.tensor(logits).softmax(dim=-1)
    return (probs >= min_p * probs.max()).tolist()


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.2, 0.5, 0.9, 1.0])
def test_the_filter_keeps_what_vllms_probability_test_keeps(min_p: float) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 3
    logits[5, :2] = logits[5].max() + 1  # a tie at the top: both kept at min_p 1
    kept = filter_min_p_(logits.clone(), torch.full((6,), min_p)).isfinite()
    for row in range(6):
        assert kept[row].tolist() == reference_kept(logits[row].tolist(), min_p), row


def test_the_cpus_min_p_weights_are_the_filtered_rows_bit_for_bit() -> None:
    """Min-p alone on the CPU skips the -inf fill (torch's exp leaves its
    fast path for -inf): the weights must still be exactly the filter's."""
    logits = torch.randn(16, 4096, generator=torch.Generator().manual_seed(4)) * 4
    min_ps = torch.tensor([(0.0, 0.01, 0.1, 0.5)[i % 4] for i in range(16)])
    want = exp_weights_(filter_min_p_(logits.clone(), min_ps))
    got = min_p_weights(logits.clone(), min_ps)
    assert got is not None and torch.equal(got, want)
    logits[3, 5] = math.inf
    assert min_p_weights(logits.clone(), min_ps) is None  # the filter's path takes it


def test_a_seeded_min_p_row_draws_the_same_beside_a_top_p_row() -> None:
    """Alone it takes min_p_weights, beside a top-p row the filters: the same token."""
    logits = torch.randn(2, 4096, generator=torch.Generator().manual_seed(6)) * 2
    for index in range(40):
        alone = sample(logits[:1].clone(), [1.0], [0], [1.0], [9], [index], min_ps=[0.02])
        beside = sample(logits.clone(), [1.0, 1.0], [0, 0], [1.0, 0.8], [9, None], [index, 0],
                        torch.Generator().manual_seed(0), min_ps=[0.02, 0.0])  # fmt: skip
        assert alone[0] == beside[0], index


def draws(
    temperature: float = 1.0, min_p: float | None = None, top_p: float = 1.0, top_k: int = 0
) -> set[int]:
    """The tokens ``ROWS`` draws of the ``PROBS`` row pick."""
    logits = torch.tensor([LOGITS] * ROWS)
    n = ROWS
    min_ps = None if min_p is None else [min_p] * n
    picked = sample(
        logits, [temperature] * n, [top_k] * n, [top_p] * n, [None] * n, [0] * n,
        torch.Generator().manual_seed(0), min_ps=min_ps,
    )  # fmt: skip
    return set(picked)


def test_min_p_keeps_the_tokens_at_least_that_likely_relative_to_the_likeliest() -> None:
    assert draws() == {0, 1, 2, 3}
    assert draws(min_p=0.0) == {0, 1, 2, 3}
    assert draws(min_p=0.5) == {0, 1}  # 0.3 / 0.5 = 0.6 kept, 0.15 / 0.5 = 0.3 not
    assert draws(min_p=0.25) == {0, 1, 2}
    assert draws(min_p=1.0) == {0}


def test_min_p_is_applied_after_temperature() -> None:
    """At temperature 2 the probabilities go as their square roots: the
    third token is sqrt(0.3) = 0.55 of the first's, so min_p 0.5 keeps it."""
    assert draws(temperature=2.0, min_p=0.5) == {0, 1, 2}


def test_min_p_is_applied_before_top_p() -> None:
    """vLLM's order: min-p keeps 0.5 and 0.3, whose share is then 0.625 and
    0.375, so top-p 0.6 keeps the first alone. Top-p first (over 0.5, 0.3,
    ...) would have kept both."""
    assert draws(top_p=0.6) == {0, 1}
    assert draws(min_p=0.5, top_p=0.6) == {0}
    assert draws(min_p=0.1, top_k=2) == {0, 1}  # with top-k, the tighter of the two


def test_greedy_rows_and_rows_without_min_p_are_untouched() -> None:
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(1)) * 3
    temps = [0.0, 1.0, 0.7, 0.0, 1.3, 1.0, 0.9, 1.0]
    min_ps = [0.9, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]  # min-p on greedy rows alone
    args = (temps, [0] * 8, [1.0] * 8, list(range(8)), [3] * 8)  # every row seeded
    assert sample(logits.clone(), *args, min_ps=min_ps) == sample(logits.clone(), *args)
    assert plan_sampling(*args, 40, min_ps).min_ps == []  # nothing for the sampler to run
    # A sampling row with it beside rows without: theirs draw as before.
    with_one = [*min_ps[:2], 0.95, *min_ps[3:]]
    got = sample(logits.clone(), *args, min_ps=with_one)
    plain = sample(logits.clone(), *args)
    assert [g for i, g in enumerate(got) if i != 2] == [p for i, p in enumerate(plain) if i != 2]
    assert got[2] == logits[2].argmax().item()  # 0.95 of the likeliest: only it is left


def test_a_batch_without_min_p_builds_nothing_for_it() -> None:
    plan = plan_sampling([1.0, 0.5], [0, 0], [1.0, 0.9], [None, 1], [0, 0], 40, [0.0, 0.0])
    assert plan.min_ps == [] and not plan.any_min_p
    assert sampling_batch(plan, torch.device("cpu")).min_ps is None


def test_a_batch_whose_plan_has_min_p_needs_its_tensor() -> None:
    plan = plan_sampling([1.0], [0], [1.0], [None], [0], 4, [0.5])
    batch = sampling_batch(plan, torch.device("cpu"))
    with pytest.raises(ValueError, match="no min_ps"):
        sample_tensors(torch.tensor([LOGITS]), replace(batch, min_ps=None))


# ---------------------------------------------------------------- min_tokens' ban


def _row(row: int, **kw: object) -> AdjustedRow:
    fields: dict[str, object] = dict(
        presence=0.0, frequency=0.0, repetition=1.0, logit_bias=(), prompt_ids=(),
        output_ids=(), last_is_output=False,
    )  # fmt: skip
    fields.update(kw)
    return AdjustedRow(row, **fields)  # type: ignore[arg-type]


def test_banned_tokens_are_masked_out_penalties_and_bias_kept_there() -> None:
    vocab = 16
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    penalised = dict(frequency=-2.0, repetition=0.5, output_ids=(5, 5), logit_bias=((5, 100.0),))
    rows = [
        _row(0, banned=(2, 7, 7, vocab + 3)),  # a repeat, and an id past the vocabulary
        _row(2, banned=(5,), **penalised),
    ]
    plan = plan_adjustments(rows, 3, vocab)
    assert plan is not None
    adjust_logits_(logits, adjustment_tensors(plan, torch.zeros(3, dtype=torch.long)))
    assert logits[0, 2].item() == logits[0, 7].item() == -math.inf == logits[2, 5].item()
    others = [t for t in range(vocab) if t not in (2, 7)]
    assert torch.equal(logits[0, others], before[0, others])
    assert torch.equal(logits[1], before[1])
    # Greedy or sampled, a banned token is never picked.
    greedy = sample(logits.clone(), [0.0] * 3, [0] * 3, [1.0] * 3, [None] * 3, [0] * 3)
    assert greedy[2] != 5


def test_a_row_banning_alone_has_a_plan_of_its_places() -> None:
    plan = plan_adjustments([_row(1, banned=(3,))], 2, 8)
    assert plan is not None and plan.ban_at.tolist() == [11] and not plan.has_penalties

"""Verifying draft tokens (kernels/sampling_speculative.py)."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.sampling import sample
from slipstream.kernels.sampling_speculative import accept_greedy, verify_drafts


def test_greedy_rows_accept_drafts_up_to_the_first_the_model_did_not_pick() -> None:
    drafts = [[5, 6, 7], [1], [8, 9]]
    picks = [5, 6, 2, 0, 3, 4, 8, 9, 10]  # rows: 3 + 1, 1 + 1, 2 + 1
    assert accept_greedy(picks, drafts) == [[5, 6, 2], [3], [8, 9, 10]]


def test_picks_must_be_one_a_draft_and_one_more() -> None:
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [[1, 2]])
    with pytest.raises(ValueError):
        accept_greedy([1, 2, 3, 4], [[1, 2]])


def _p(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The rows' final distribution: temperature, then top-k (the reference)."""
    scaled = logits / temperature
    kth = scaled.topk(top_k, dim=-1).values[:, -1:]
    return torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)


def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def test_sampled_rows_accept_a_draft_as_often_as_the_model_draws_it() -> None:
    """Accepting draft d with probability p(d), else drawing from p without d:
    each output token is distributed as p. One sequence of two drafts,
    drawn 20,000 times with a fixed generator (deterministic); chi-square
    against p at each of its rows (top-k 6 of 7: 5 degrees of freedom,
    99.9 % below 20.5), and the lowest token never drawn."""
    vocab, draws = 7, 20_000
    logits = torch.tensor(
        [
            [2.0, 1.5, 0.3, 0.0, -1.0, 0.5, -3.0],  # row 0: d1 = 1 has p ~ 0.3
            [0.1, 0.2, 1.8, 0.4, 0.0, -0.5, 1.0],  # row 1, after d1: d2 = 6
            [1.0, 0.0, 0.0, 2.0, 0.5, 0.0, 0.0],  # row 2, after d2: the model's own
        ]
    )
    temperature, top_k = 0.9, 6
    p = _p(logits, temperature, top_k)
    drafts = [[1, 6]] * draws
    verified = verify_drafts(
        logits.repeat(draws, 1),
        drafts,
        [temperature] * draws,
        [top_k] * draws,
        [1.0] * draws,
        [None] * draws,
        [0] * draws,
        generator=torch.Generator().manual_seed(0),
    )
    first = torch.bincount(torch.tensor([v[0] for v in verified]), minlength=vocab)
    assert _chi_square(first.double(), p[0].double()) < 20.5
    accepted = [v for v in verified if len(v) > 1]
    assert abs(len(accepted) / draws - float(p[0, 1])) < 0.015
    second = torch.bincount(torch.tensor([v[1] for v in accepted]), minlength=vocab)
    assert _chi_square(second.double(), p[1].double()) < 20.5
    assert abs(sum(len(v) > 2 for v in accepted) / len(accepted) - float(p[1, 6])) < 0.02
    third = torch.bincount(torch.tensor([v[2] for v in accepted if len(v) > 2]), minlength=vocab)
    assert _chi_square(third.double(), p[2].double()) < 20.5


def test_a_seeded_sequence_gets_the_tokens_it_would_one_at_a_time() -> None:
    """A seeded row draws from (seed, output index) alone: the same seed gives
    the same tokens, and those are what sampling each output alone gives."""
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    drafts = [[7, 8, 9]]
    args = (drafts, [0.8], [0], [0.9], [1234], [5])
    first = verify_drafts(logits, *args)
    assert verify_drafts(logits, *args) == first
    one_at_a_time = sample(logits, [0.8] * 4, [0] * 4, [0.9] * 4, [1234] * 4, [5, 6, 7, 8])
    assert first == accept_greedy(one_at_a_time, drafts)
    # Greedy rows take the argmax: accept drafts that are the argmax, then add it.
    argmax = logits.argmax(dim=-1).tolist()
    greedy = verify_drafts(logits, [[*argmax[:2], -1]], [0.0], [0], [1.0], [None], [0])
    assert greedy == [argmax[:3]]


def test_a_drafting_rows_min_p_filters_its_draws() -> None:
    """min-p holds for the rows a draft is verified on as for a plain row's:
    at 1.0 only the likeliest token may be drawn, however hot the row."""
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    top = logits.argmax(dim=-1).tolist()
    drafts = [top[:3]]
    for seed in range(20):
        verified = verify_drafts(
            logits.clone(), drafts, [5.0], [0], [1.0], [seed], [0], min_ps=[1.0]
        )
        assert verified == [top]

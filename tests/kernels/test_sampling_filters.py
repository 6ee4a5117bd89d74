"""Top-k and top-p in place: the nucleus found among the largest candidates
equals the one a whole sort finds, and both match a float64 reference."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels import sampling_filters
from slipstream.kernels.sampling_filters import filter_top_k_, filter_top_p_


def _logits(rows: int, vocab: int, scale: float, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _reference_nucleus(row: torch.Tensor, p: float) -> set[int]:
    """The shortest descending run of ``row``'s softmax reaching ``p``, in float64."""
    probs = torch.softmax(row.double(), dim=0)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    return set(order[before < p].tolist()) | {int(order[0])}


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0], ids=["flat", "spread", "peaked"])
def test_top_p_keeps_the_nucleus(scale: float) -> None:
    logits = _logits(16, 512, scale)
    ps = torch.tensor([0.05, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99] * 2)
    kept = filter_top_p_(logits.clone(), ps)
    for row in range(16):
        got = set(torch.isfinite(kept[row]).nonzero().flatten().tolist())
        assert got == _reference_nucleus(logits[row], float(ps[row])), row


@pytest.mark.parametrize(
    ("candidates", "sorts"),
    [((4,), 1), ((512,), 0), ((100_000,), 1), ((16,), 1), ((4, 16), 1), ((4, 512), 0)],
    ids=["too-few", "enough", "sort", "some-rows", "two-tiers-then-sort", "second-tier-enough"],
)
def test_the_candidates_and_the_whole_sort_agree(
    monkeypatch, candidates: tuple[int, ...], sorts: int
) -> None:
    """Four candidates hold less than p in every row (those rows are sorted,
    in one call, or looked for again among 16 or 512), 16 in some, 512 of
    2,048 in all (no sort): the same logits kept, bit for bit, as sorting
    every row."""
    logits = _logits(32, 2048, 3.0, seed=1)
    ps = torch.linspace(0.1, 0.9, 32)
    monkeypatch.setattr(sampling_filters, "NUCLEUS_CANDIDATES", (100_000,))
    sorted_once = filter_top_p_(logits.clone(), ps)
    monkeypatch.setattr(sampling_filters, "NUCLEUS_CANDIDATES", candidates)
    calls = []
    sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: calls.append(1) or sort(*a, **k))
    assert torch.equal(filter_top_p_(logits.clone(), ps), sorted_once)
    assert len(calls) == sorts


def test_top_p_of_one_token_and_after_top_k() -> None:
    logits = torch.tensor([[1.0, 5.0, 2.0, 5.0 - 1e-3], [0.0, 0.0, 0.0, 0.0]])
    kept = filter_top_p_(logits.clone(), torch.tensor([1e-6, 0.6]))
    assert torch.isfinite(kept[0]).tolist() == [False, True, False, False]
    assert torch.isfinite(kept[1]).all()  # four equal logits: ties with the nucleus stay
    top2 = filter_top_k_(logits.clone(), torch.tensor([2, 0]), 2)
    assert torch.isfinite(top2[0]).tolist() == [False, True, False, True]
    assert torch.isfinite(top2[1]).all()  # k == 0 keeps all
    # the nucleus of what top-k left: the larger of the two at p 0.4
    both = filter_top_p_(top2, torch.tensor([0.4, 1.0]))
    assert torch.isfinite(both[0]).tolist() == [False, True, False, False]

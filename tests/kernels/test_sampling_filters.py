"""Top-k and top-p in place: the nucleus found among the largest candidates
equals the one a whole sort finds, and both match a float64 reference; the
CPU's weights from the top-k candidates are those of the whole-row filters."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from slipstream.kernels import fused_ops, sampling_filters
from slipstream.kernels.sampling_filters import (
    filter_top_k_,
    filter_top_p_,
    log_sum_exp_of_weights,
    top_k_weights,
    top_p_weights,
)
from slipstream.kernels.sampling_primitives import exp_weights_


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


def _whole_row_weights(
    scaled: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor | None
) -> torch.Tensor:
    row = filter_top_k_(scaled.clone(), ks, max(1, int(ks.max())))
    if ps is not None:
        filter_top_p_(row, ps)
    return exp_weights_(row)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_top_p", [False, True], ids=["top-k", "top-k-and-top-p"])
def test_top_k_weights_are_the_whole_row_filters_weights(threads: int, with_top_p: bool) -> None:
    """Bit for bit, over peaked and flat rows, k from 1 to past the nucleus
    (and off on some rows), p from one token to 1, one thread and two
    (torch's own sums over the same shape)."""
    torch.set_num_threads(threads)  # the autouse fixture restores 1
    gen = torch.Generator().manual_seed(3)
    for trial in range(24):
        rows, vocab = (1, 3, 16, 64)[trial % 4], (50, 1000, 49152)[trial % 3]
        scaled = torch.randn(rows, vocab, generator=gen) * (0.5, 3.0, 20.0)[trial % 3]
        ks = torch.randint(1, min(600, vocab - 1), (rows,), generator=gen)
        if rows > 1 and trial % 2:
            ks[::2] = 0  # rows without top-k beside rows with it
        ps = torch.tensor([1.0, 0.9, 0.5, 0.99, 1e-6])[torch.randint(0, 5, (rows,), generator=gen)]
        got = top_k_weights(scaled.clone(), ks, int(ks.max()), ps if with_top_p else None)
        assert got is not None, trial
        assert torch.equal(got, _whole_row_weights(scaled, ks, ps if with_top_p else None)), trial


def test_top_k_weights_leave_rows_they_cannot_match_to_the_whole_row() -> None:
    """k == 0 on every row, a NaN, an infinite maximum (among the candidates,
    or in a row without top-k, with top-p), or the k-th largest tied past
    the candidates: None, the rows untouched, and the whole-row path decides.
    k == 0 on some rows: those rows keep all, or their nucleus with top-p."""
    scaled = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0], [0.5, 0.1, 0.2, 0.3, 0.4, 0.6]])
    before = scaled.clone()
    ks = torch.tensor([2, 2])
    assert top_k_weights(scaled, ks, 2, None) is None  # row 0: 2.0 tied at k == 2, three of them
    assert top_k_weights(scaled, torch.tensor([3, 2]), 3, None) is None
    assert top_k_weights(scaled, torch.tensor([2, 0]), 2, torch.tensor([0.9, 0.9])) is None
    assert top_k_weights(scaled, torch.tensor([0, 0]), 1, None) is None
    for bad in (float("nan"), float("inf")):
        scaled[1, 5] = bad
        assert top_k_weights(scaled, ks, 2, None) is None
        assert top_k_weights(scaled, torch.tensor([3, 0]), 3, torch.tensor([0.9, 0.9])) is None
        scaled[1, 5] = 0.6
    assert torch.equal(scaled, before)
    scaled[0, 2:5] = torch.tensor([2.0, 1.5, 1.2])  # no tie: the candidates decide
    expected = _whole_row_weights(scaled, ks, None)
    got = top_k_weights(scaled.clone(), ks, 2, None)
    assert got is not None and torch.equal(got, expected)
    assert (got > 0).sum(dim=-1).tolist() == [2, 2]
    one_off = torch.tensor([2, 0])
    got = top_k_weights(scaled.clone(), one_off, 2, None)
    assert got is not None and torch.equal(got, _whole_row_weights(scaled, one_off, None))
    assert (got > 0).sum(dim=-1).tolist() == [2, 6]
    ps = torch.tensor([0.9, 0.5])  # row 1's nucleus at 0.5: 0.6, 0.5, 0.4 of its softmax
    got = top_k_weights(scaled.clone(), one_off, 2, ps)
    assert got is not None and torch.equal(got, _whole_row_weights(scaled, one_off, ps))
    assert (got > 0).sum(dim=-1).tolist() == [2, 3]


@pytest.mark.parametrize("vocab", [50, 49152])
def test_a_row_with_top_p_one_keeps_all_whatever_its_batch(vocab: int) -> None:
    """p >= 1 turns top-p off for its row: the same weights as the row's
    plain softmax, beside rows with top-p or not, on every path (a flat row
    used to lose the tail whose running sum rounds to 1 in float32, and to
    be sorted whole to find it, only when another row had top-p)."""
    scaled = _logits(4, vocab, 0.3, seed=5)  # flat: no float32 running sum reaches 1 early
    ps = torch.tensor([1.0, 0.9, 1.0, 0.5])
    alone = exp_weights_(scaled.clone())
    whole_row = exp_weights_(filter_top_p_(scaled.clone(), ps))
    candidates = top_p_weights(scaled.clone(), ps)
    assert candidates is not None and torch.equal(candidates, whole_row)
    for row in (0, 2):
        assert torch.equal(whole_row[row], alone[row])
    for row in (1, 3):
        assert (whole_row[row] == 0).any()
    ks = torch.tensor([0, 0, 0, 7])
    with_k = top_k_weights(scaled.clone(), ks, 7, ps)
    assert with_k is not None and torch.equal(with_k, _whole_row_weights(scaled, ks, ps))
    for row in (0, 2):
        assert torch.equal(with_k[row], alone[row])


@pytest.mark.parametrize("threads", [1, 2])
def test_the_log_sum_exp_of_the_weights_is_torchs(threads: int) -> None:
    torch.set_num_threads(threads)  # the autouse fixture restores 1
    scaled = _logits(64, 49152, 3.0, seed=5)
    values, indices = scaled.topk(300, dim=-1)
    filtered = scaled.masked_fill(scaled < values[:, -1:], float("-inf"))
    top = values[:, :1]
    weights = torch.zeros_like(scaled).scatter_(1, indices, (values - top).exp())
    expected = torch.logsumexp(filtered, dim=-1, keepdim=True)
    assert torch.equal(log_sum_exp_of_weights(weights, top), expected)


@pytest.mark.parametrize("native", [False, True], ids=["torch-topk", "fused-selection"])
@pytest.mark.parametrize("threads", [1, 2])
def test_top_p_weights_are_the_whole_row_filters_weights(
    monkeypatch, threads: int, native: bool
) -> None:
    """Bit for bit, over peaked and flat rows (nuclei within the first
    candidates, the second tier and a whole sort), p from one token to 1,
    the candidates from torch's topk or the fused kernels' selection."""
    torch.set_num_threads(threads)  # the autouse fixture restores 1
    if native:
        if not fused_ops.is_available(Path(os.environ["SLIPSTREAM_HOME"])):
            pytest.skip(f"the fused kernels are not built here: {fused_ops.failure()}")
    else:
        monkeypatch.setattr(sampling_filters, "_largest", lambda rows, k: rows.topk(k).values)
    gen = torch.Generator().manual_seed(7)
    for trial in range(18):
        rows, vocab = (1, 3, 16, 64)[trial % 4], (50, 1000, 49152)[trial % 3]
        scaled = torch.randn(rows, vocab, generator=gen) * (0.3, 3.0, 20.0)[trial % 3]
        ps = torch.tensor([1.0, 0.9, 0.5, 0.99, 1e-6])[torch.randint(0, 5, (rows,), generator=gen)]
        expected = exp_weights_(filter_top_p_(scaled.clone(), ps))
        got = top_p_weights(scaled.clone(), ps)
        assert got is not None and torch.equal(got, expected), trial


def test_top_p_weights_leave_a_row_without_a_finite_maximum_to_the_whole_row() -> None:
    """A NaN or +inf in a row, or a row of -inf: None, the rows untouched."""
    scaled = _logits(3, 100, 3.0)
    for row, column, bad in ((1, 7, float("nan")), (1, 7, float("inf")), (2, None, float("-inf"))):
        odd = scaled.clone()
        if column is None:
            odd[row] = bad
        else:
            odd[row, column] = bad
        before = odd.clone()
        assert top_p_weights(odd, torch.tensor([0.9, 0.9, 0.9])) is None
        assert torch.equal(odd.nan_to_num(), before.nan_to_num())
        assert torch.equal(odd.isnan(), before.isnan())

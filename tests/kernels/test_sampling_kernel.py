"""sample(): greedy, filters, seeded reproducibility and distribution sanity;
the inverse-CDF pick and the seeded draws under it."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.sampling import pick_by_cdf, sample, seeded_uniform

VOCAB = 50


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, VOCAB), generator=torch.Generator().manual_seed(seed)) * 3


def _sample_rows(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seeds: list[int | None] | None = None,
    output_indices: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    n = logits.shape[0]
    return sample(
        logits,
        [temperature] * n,
        [top_k] * n,
        [top_p] * n,
        seeds if seeds is not None else [None] * n,
        output_indices if output_indices is not None else [0] * n,
        generator,
    )


def test_greedy_is_argmax() -> None:
    logits = _logits(7)
    assert _sample_rows(logits, temperature=0.0) == logits.argmax(-1).tolist()


def test_greedy_takes_first_max_on_ties() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, [4, 9]] = 1.0
    assert _sample_rows(logits, temperature=0.0) == [4, 4]


def test_top_k_one_is_greedy() -> None:
    logits = _logits(16, seed=1)
    assert _sample_rows(logits, top_k=1, seeds=list(range(16))) == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_most_likely() -> None:
    logits = _logits(16, seed=2)
    generator = torch.Generator().manual_seed(0)
    tokens = _sample_rows(logits, temperature=5.0, top_p=1e-6, generator=generator)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_draws_only_from_the_k_largest() -> None:
    logits = _logits(1, seed=3).expand(400, VOCAB).contiguous()
    allowed = set(logits[0].topk(3).indices.tolist())
    tokens = _sample_rows(logits, temperature=10.0, top_k=3, seeds=list(range(400)))
    assert set(tokens) == allowed


def test_top_p_draws_only_from_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(400, 4).contiguous()
    tokens = sample(logits, [1.0] * 400, [0] * 400, [0.7] * 400, list(range(400)), [0] * 400)
    assert set(tokens) == {0, 1}


def test_seeded_rows_are_reproducible_and_batch_independent() -> None:
    row = _logits(1, seed=4)
    others = _logits(5, seed=5)
    alone = sample(row, [0.8], [10], [0.9], [1234], [7])
    batch = torch.cat([others[:2], row, others[2:]])
    mixed = sample(
        batch,
        [0.0, 1.0, 0.8, 1.5, 0.7, 1.0],
        [0, 5, 10, 0, 0, 2],
        [1.0, 1.0, 0.9, 0.5, 1.0, 1.0],
        [None, 1, 1234, None, 99, 3],
        [0, 3, 7, 1, 2, 9],
    )
    assert mixed[2] == alone[0]
    draws = {sample(row, [5.0], [0], [1.0], [1234], [i])[0] for i in range(20)}
    assert len(draws) > 1  # output_index changes the draw
    again = [sample(row, [5.0], [0], [1.0], [1234], [i])[0] for i in range(20)]
    assert again == [sample(row, [5.0], [0], [1.0], [1234], [i])[0] for i in range(20)]


def test_unseeded_rows_follow_the_generator() -> None:
    logits = _logits(8, seed=6)
    first = _sample_rows(logits, temperature=2.0, generator=torch.Generator().manual_seed(3))
    second = _sample_rows(logits, temperature=2.0, generator=torch.Generator().manual_seed(3))
    assert first == second


def test_temperature_distribution_matches_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20_000
    temperature = 1.5
    tokens = sample(
        logits.expand(n, 4).contiguous(),
        [temperature] * n,
        [0] * n,
        [1.0] * n,
        [None] * n,
        [0] * n,
        torch.Generator().manual_seed(0),
    )
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double() / n
    expected = torch.softmax(logits[0].double() / temperature, dim=0)
    torch.testing.assert_close(counts, expected, atol=0.015, rtol=0)
    # Seeded rows (one generator each) follow the same distribution.
    seeded = sample(
        logits.expand(4000, 4).contiguous(),
        [temperature] * 4000,
        [0] * 4000,
        [1.0] * 4000,
        list(range(4000)),
        [0] * 4000,
    )
    counts = torch.bincount(torch.tensor(seeded), minlength=4).double() / 4000
    torch.testing.assert_close(counts, expected, atol=0.03, rtol=0)


def test_row_argmax_is_torchs_argmax_through_its_chunks() -> None:
    """The chunked argmax returns torch's indices: the first maximum of a row
    (a tie across chunks and within one), a NaN as the maximum, rows all
    -inf, both dtypes, every chunk size, and widths no chunk divides."""
    from slipstream.kernels.sampling import row_argmax

    generator = torch.Generator().manual_seed(3)
    for cols in (4096, 640, 49152, 1000, 50):
        x = torch.randn((9, cols), generator=generator)
        top = x[0].max() + 1
        x[0, cols // 2], x[0, 7] = top, top  # a tie: the first wins
        x[1, 3], x[1, 5] = top, top  # a tie inside one chunk
        x[2, cols - 1] = top  # the last column
        x[3] = float("-inf")
        x[4, cols // 3], x[4, cols - 2] = float("nan"), float("nan")  # the first NaN
        x[5] = 0.0  # all equal
        for dtype in (torch.float32, torch.bfloat16):
            y = x.to(dtype)
            assert torch.equal(row_argmax(y), y.argmax(dim=-1)), (cols, dtype)
    assert row_argmax(torch.empty(0, 4096)).shape == (0,)


def test_greedy_over_a_real_vocabulary_is_argmax() -> None:
    """SmolLM2's vocabulary width: greedy rows and sampled rows as before."""
    logits = torch.randn((6, 49152), generator=torch.Generator().manual_seed(1)) * 3
    assert _sample_rows(logits, temperature=0.0) == logits.argmax(-1).tolist()
    seeded = _sample_rows(logits, seeds=[11] * 6, output_indices=list(range(6)))
    assert seeded == _sample_rows(logits, seeds=[11] * 6, output_indices=list(range(6)))


def _reference_pick(weights: torch.Tensor, uniforms: torch.Tensor) -> list[tuple[float, float]]:
    """Each row's target and cumulative weights, in float64 over the whole row."""
    cdf = weights.double().cumsum(-1)
    return [(float(u) * float(c[-1]), c) for u, c in zip(uniforms, cdf, strict=True)]


@pytest.mark.parametrize("vocab", [50, 512, 49_152], ids=["unchunked", "chunked", "vocabulary"])
def test_pick_by_cdf_lands_where_the_target_falls(vocab: int) -> None:
    """The picked token's cumulative interval holds the row's target (to
    rounding: chunk sums are float32), and a token of weight 0 is never
    picked, not even by the largest draw below 1 or by 0."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(64, vocab, generator=generator) ** 4
    weights[weights < 0.3] = 0.0  # filtered tokens
    weights[:, -3:] = 0.0  # the row ends in zeros: the largest draw stays before them
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
    uniforms[0], uniforms[1] = 1.0 - 2.0**-53, 0.0
    picked = pick_by_cdf(weights, uniforms).tolist()
    for row, (token, (target, cdf)) in enumerate(
        zip(picked, _reference_pick(weights, uniforms), strict=True)
    ):
        assert weights[row, token] > 0, row
        low = float(cdf[token - 1]) if token else 0.0
        slack = 1e-6 * float(cdf[-1])
        assert low - slack <= target <= float(cdf[token]) + slack, row


def test_inverse_cdf_follows_the_distribution_over_chunks() -> None:
    """Over a chunked row (512 tokens) the picks' frequencies are the weights'."""
    weights = torch.zeros(512)
    weights[[3, 130, 131, 400, 511]] = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    n = 20_000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    picked = pick_by_cdf(weights.expand(n, 512).contiguous(), uniforms)
    counts = torch.bincount(picked, minlength=512).double() / n
    torch.testing.assert_close(counts, weights.double(), atol=0.012, rtol=0)


def test_a_seeded_draw_is_a_fixed_number_in_the_unit_interval() -> None:
    draws = [seeded_uniform(seed, index) for seed in range(50) for index in range(20)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert draws == [seeded_uniform(seed, index) for seed in range(50) for index in range(20)]
    assert 0.45 < sum(draws) / len(draws) < 0.55


def test_a_row_with_a_nan_still_gets_a_token_of_the_vocabulary() -> None:
    for vocab in (50, 512):
        weights = torch.rand(3, vocab)
        weights[0, 7] = float("nan")
        weights[1] = float("nan")
        picked = pick_by_cdf(weights, torch.tensor([0.5, 0.99, 0.2], dtype=torch.float64))
        assert all(0 <= t < vocab for t in picked.tolist())


@pytest.mark.parametrize("vocab", [VOCAB, 49_152])
def test_bf16_logits_give_the_tokens_of_their_float32_widening(vocab: int) -> None:
    # A bf16 model's logits reach the sampler unwidened on the CPU: the argmax
    # reads them as they are and only the sampling rows are widened.
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn((12, vocab), generator=gen) * 3).bfloat16()
    logits[3, 7] = logits[3].max()  # a tie: the first maximum wins either way
    params = (
        [0.0, 0.8, 1.0, 0.0, 1.3, 0.7, 0.0, 1.0, 0.9, 0.0, 1.1, 0.6],
        [0, 0, 5, 0, 0, 20, 1, 0, 0, 0, 3, 0],
        [1.0, 1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 0.5, 1.0, 1.0, 0.8, 0.95],
        [None, 7, None, None, 3, None, None, 9, None, None, None, 21],
        list(range(12)),
    )
    low = sample(logits, *params, generator=torch.Generator().manual_seed(5))
    wide = sample(logits.float(), *params, generator=torch.Generator().manual_seed(5))
    assert low == wide
    greedy = ([0.0] * 12, [0] * 12, [1.0] * 12, [None] * 12, [0] * 12)
    assert sample(logits, *greedy) == logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("top_k", "top_p", "greedy_rows"),
    [(0, 1.0, False), (40, 1.0, False), (40, 0.9, False), (0, 0.9, True), (40, 1.0, True)],
    ids=["temperature", "top-k", "top-k-and-top-p", "top-p-beside-greedy", "top-k-beside-greedy"],
)
def test_a_scratch_gives_the_same_tokens_and_is_written(
    top_k: int, top_p: float, greedy_rows: bool
) -> None:
    """The runner's scratch, kept from step to step: the same tokens as
    fresh tensors (the sampling rows are scaled in it), over a real
    vocabulary's width and a bf16 model's logits."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(12, 49_152, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
        temperatures = [0.0 if greedy_rows and i % 3 == 0 else 0.8 for i in range(12)]
        args = (temperatures, [top_k] * 12, [top_p] * 12, list(range(12)), [2] * 12)
        scratch = torch.full((12 * 49_152 + 7,), float("nan"))
        assert sample(logits, *args, scratch=scratch) == sample(logits, *args)
        assert not scratch[:49_152].isnan().any(), "the sampler wrote its rows elsewhere"

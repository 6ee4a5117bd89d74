"""Penalties and logit bias (``logit_adjustments``) against a plain per-token
reference on a small vocabulary, and through the sampler: greedy rows see
them, other rows are untouched, a seeded row's draw does not depend on its
batch."""

from __future__ import annotations

import math

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

VOCAB = 37


def reference(logits: list[float], row: AdjustedRow, last_token: int) -> list[float]:
    """One row adjusted token by token, as vLLM's and OpenAI's docs write it."""
    generated = list(row.output_ids) + ([last_token] if row.last_is_output else [])
    bias = dict(row.logit_bias)
    out = []
    for t, x in enumerate(logits):
        x += bias.get(t, 0.0)
        if row.repetition != 1.0 and (t in generated or t in row.prompt_ids):
            x = x / row.repetition if x > 0 else x * row.repetition
        count = generated.count(t)
        x -= row.frequency * count + row.presence * (count > 0)
        out.append(x)
    return out


def _row(row: int, **kw: object) -> AdjustedRow:
    fields: dict[str, object] = dict(
        presence=0.0, frequency=0.0, repetition=1.0, logit_bias=(), prompt_ids=(),
        output_ids=(), last_is_output=False,
    )  # fmt: skip
    fields.update(kw)
    return AdjustedRow(row, **fields)  # type: ignore[arg-type]


ROWS = [
    _row(0, logit_bias=((3, -100.0), (5, 4.5), (36, 0.25))),
    _row(2, presence=0.7, output_ids=(1, 1, 4, 9, 1), last_is_output=True),
    _row(3, frequency=1.5, output_ids=(2, 2, 2, 7), last_is_output=True),
    _row(4, repetition=1.3, prompt_ids=(0, 5, 6, 6, 30), output_ids=(8,), last_is_output=True),
    _row(5, repetition=0.8, prompt_ids=(11, 12), output_ids=()),  # first output: no last
    _row(
        6,
        presence=-0.5,
        frequency=0.4,
        repetition=1.7,
        logit_bias=((12, 2.0), (0, -3.0)),
        prompt_ids=(12, 13, 2),
        output_ids=(12, 14, 14),
        last_is_output=True,
    ),  # everything on one row, a token in several places
]


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def _adjustments(rows: list[AdjustedRow], num_rows: int, last_tokens: torch.Tensor):
    plan = plan_adjustments(rows, num_rows, VOCAB)
    assert plan is not None
    return adjustment_tensors(plan, last_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_adjusted_rows_match_the_reference_and_the_others_are_untouched(seed):
    num_rows = 8  # rows 1 and 7 ask for nothing
    logits = _logits(num_rows, seed)
    before = logits.clone()
    last_tokens = torch.randint(0, VOCAB, (num_rows,), generator=torch.Generator().manual_seed(9))
    adjust_logits_(logits, _adjustments(ROWS, num_rows, last_tokens))
    for row in ROWS:
        expected = reference(before[row.row].tolist(), row, int(last_tokens[row.row]))
        assert logits[row.row].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-5)
    for untouched in (1, 7):
        assert torch.equal(logits[untouched], before[untouched])


def test_repetition_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 0.0, 3.0] + [0.0] * (VOCAB - 4)])
    row = _row(0, repetition=2.0, prompt_ids=(0, 1), output_ids=(2,))
    adjust_logits_(logits, _adjustments([row], 1, torch.zeros(1, dtype=torch.long)))
    assert logits[0, :4].tolist() == [1.0, -4.0, 0.0, 3.0]


def test_the_last_input_token_counts_as_generated():
    """A row's last output may be on the device alone (a step planned
    ahead): it is read from ``last_tokens`` and counted with the rest."""
    logits = torch.zeros(2, VOCAB)
    row = _row(1, frequency=1.0, output_ids=(4,), last_is_output=True)
    adjust_logits_(logits, _adjustments([row], 2, torch.tensor([0, 4])))
    assert logits[1, 4].item() == -2.0
    assert logits[0].abs().sum().item() == 0.0 and logits[1].abs().sum().item() == 2.0


def test_no_row_asking_has_no_plan():
    assert plan_adjustments([], 4, VOCAB) is None


def test_a_biased_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="logit_bias token ids"):
        plan_adjustments([_row(0, logit_bias=((VOCAB, 1.0),))], 1, VOCAB)


def test_a_pending_token_among_the_settled_ones_is_refused():
    """-1 would index the row before (on a GPU: end the CUDA context)."""
    with pytest.raises(ValueError, match="penalised token ids"):
        plan_adjustments([_row(1, frequency=1.0, output_ids=(4, -1))], 2, VOCAB)


def test_a_greedy_row_takes_the_argmax_of_its_adjusted_logits():
    logits = _logits(3, 1)
    top = logits.argmax(dim=-1).tolist()
    rows = [_row(1, logit_bias=((top[1], -100.0),))]
    args = ([0.0] * 3, [0] * 3, [1.0] * 3, [None] * 3, [0] * 3)  # every row greedy
    plain = sample(logits.clone(), *args)
    adjusted_logits = logits.clone()
    got = sample(adjusted_logits, *args, adjustments=_adjustments(rows, 3, torch.zeros(3).long()))
    assert plain == top and got[0] == top[0] and got[2] == top[2]
    assert got[1] != top[1] and got[1] == adjusted_logits[1].argmax().item()


def test_a_sampled_row_never_draws_a_banned_token():
    logits = torch.zeros(64, VOCAB)  # every token equally likely but the banned one
    rows = [_row(i, logit_bias=((5, -100.0),)) for i in range(64)]
    adjustments = _adjustments(rows, 64, torch.zeros(64).long())
    plan = plan_sampling([1.0] * 64, [0] * 64, [1.0] * 64, [None] * 64, [0] * 64, VOCAB)
    batch = sampling_batch(plan, torch.device("cpu"))
    picked = sample_tensors(logits, batch, torch.Generator().manual_seed(0), None, adjustments)
    assert 5 not in picked.tolist()
    assert math.isclose(logits[0, 5].item(), -100.0)


def test_a_seeded_adjusted_row_draws_the_same_in_any_batch():
    row_logits = _logits(1, 3)
    ask = dict(presence=0.5, frequency=0.5, output_ids=(1, 2, 2), last_is_output=True)

    def draw(num_rows: int, at: int) -> int:
        logits = _logits(num_rows, 4)
        logits[at] = row_logits[0]
        last = torch.zeros(num_rows, dtype=torch.long)
        last[at] = 3
        seeds = [None] * num_rows
        seeds[at] = 42
        out = sample(
            logits, [0.9] * num_rows, [0] * num_rows, [1.0] * num_rows, seeds, [4] * num_rows,
            torch.Generator().manual_seed(num_rows),
            adjustments=_adjustments([_row(at, **ask)], num_rows, last),
        )  # fmt: skip
        return out[at]

    assert draw(1, 0) == draw(5, 3) == draw(3, 1)

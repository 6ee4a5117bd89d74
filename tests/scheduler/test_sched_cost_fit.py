"""The start-up calibration's fit (``cost_model.fit_relative``): least
squares in relative error, no coefficient below zero."""

from __future__ import annotations

import random

import pytest

from slipstream.scheduler.cost_model import CostCoefficients, CostModel, StepShape, fit_relative

TRUE = CostCoefficients(
    base_s=0.6e-3,
    per_prefill_token_s=2.5e-6,
    per_decode_seq_s=4e-6,
    per_context_token_s=5e-7,
    per_prefill_step_s=0.3e-3,
)

# The calibration's shapes at bench slo's GPU set-up (512-token budget, 32
# sequences): prefills alone, decodes at contexts 64 and 512, mixed steps.
SHAPES = (
    [StepShape(n, 0, n) for n in (16, 128, 256, 512)]
    + [StepShape(0, b, b * (ctx + 1)) for ctx in (64, 512) for b in (1, 4, 16, 32)]
    + [StepShape(128, d, 128 + d * 65) for d in (16, 31)]
)


def seconds(c: CostCoefficients, s: StepShape) -> float:
    return (
        c.base_s
        + c.per_prefill_token_s * s.num_prefill_tokens
        + c.per_decode_seq_s * s.num_decode_seqs
        + c.per_context_token_s * s.num_context_tokens
        + (c.per_prefill_step_s if s.num_prefill_tokens else 0.0)
    )


def alone(c: CostCoefficients, prompt: int, output: int) -> float:
    return CostModel(c).service_seconds(0, prompt, output, 512)


def test_steps_a_linear_model_explains_give_back_its_coefficients():
    fit = fit_relative([(s, seconds(TRUE, s)) for s in SHAPES], swap_s_per_block=1e-4)
    for name in ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert fit.per_prefill_step_s == pytest.approx(TRUE.per_prefill_step_s, rel=1e-6)
    assert fit.swap_s_per_block == 1e-4


def test_one_slow_large_step_does_not_take_the_fixed_cost_away():
    """The 32-sequence decode at context 512 timed 2.5x slow (one noisy run
    of the largest step): a fit in absolute seconds follows it and puts the
    fixed cost at zero, so a short request alone is predicted at a fraction
    of its time and every deadline set from it is that much too tight. In
    relative error the one step is one step."""
    slow = SHAPES.index(StepShape(0, 32, 32 * 513))
    timed = [(s, seconds(TRUE, s) * (2.5 if i == slow else 1.0)) for i, s in enumerate(SHAPES)]
    fit = fit_relative(timed)
    assert fit.base_s > 0.5 * TRUE.base_s
    for prompt, output in ((32, 8), (64, 24), (128, 48)):
        assert alone(fit, prompt, output) == pytest.approx(alone(TRUE, prompt, output), rel=0.1)


@pytest.mark.parametrize("seed", range(20))
def test_the_fit_is_the_best_with_no_coefficient_below_zero(seed):
    """On noisy steps (some wanting a coefficient below zero): every
    coefficient is >= 0, and the fit is a minimum of the relative error over
    that region (its KKT conditions: no free coefficient can move, and
    raising one held at zero makes the error no smaller)."""
    rng = random.Random(seed)
    timed = [(s, seconds(TRUE, s) * rng.uniform(0.5, 2.0)) for s in SHAPES]
    fit = fit_relative(timed)
    theta = [
        fit.base_s,
        fit.per_prefill_token_s,
        fit.per_decode_seq_s,
        fit.per_context_token_s,
        fit.per_prefill_step_s,
    ]
    assert min(theta) >= 0.0

    def error(coeffs: list[float]) -> float:
        c = CostCoefficients(*coeffs[:4], 0.0, coeffs[4])
        return sum((1.0 - seconds(c, s) / t) ** 2 for s, t in timed)

    # Convex: a minimum over the region where no coordinate step (1 % of
    # the true coefficient) that stays in it lowers the error.
    truth = [
        TRUE.base_s,
        TRUE.per_prefill_token_s,
        TRUE.per_decode_seq_s,
        TRUE.per_context_token_s,
        TRUE.per_prefill_step_s,
    ]
    best = error(theta)
    for i, step in enumerate(0.01 * t for t in truth):
        for move in (step, -step):
            moved = list(theta)
            moved[i] += move
            if moved[i] >= 0.0:
                assert error(moved) >= best * (1 - 1e-9), (i, move)


def test_no_steps_give_the_built_in_guess():
    assert fit_relative([]) == CostCoefficients()

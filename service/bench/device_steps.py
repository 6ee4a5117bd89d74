"""Step times of a real device for ``bench slo --sim --device-steps NAME``:
the simulator's device then is this function, not the cost model, and the
model is calibrated on it as the engine calibrates on its runner
(``calibration.fit_steps`` over ``calibration``'s shapes) and refits online
from its steps. What a device's steps look like that a linear model does not
say: on a GPU, a decode-only step replays a CUDA graph and any prefill makes
the step eager.

``h100``: SmolLM2-135M's shape in bf16 on one H100 (docs/gpu.md, "Measured on
an H100"): a graphed decode step 1.6 ms + 6.4 µs a sequence (1.60 / 3.24 ms
at 1 / 256, ``bench step``), an eager step ~10 ms of kernel launches + 15 µs
a prefill token: the engine before steps with a prefill were graphed.

``h100-whole-step``: the same GPU since a step with a prefill replays one
graph of the whole step (docs/gpu.md, "A step with a prefill as one
graph"): a step of up to ``PREFILL_GRAPH_TOKENS`` tokens takes the graphed
decode step's time and ~0.2 µs a prefill token (a 256-token chunk beside
0 / 8 / 64 / 256 decodes: 1.49-1.62 / 1.72-1.78 / 1.97-2.07 / 3.15-3.35
ms); a larger step is eager, as above.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from slipstream.scheduler.cost_model import CostCoefficients, StepShape
from slipstream.scheduler.plan import StepPlan
from slipstream.service.engine.calibration import calibration_plans, fit_steps
from slipstream.service.engine.config import PREFILL_GRAPH_TOKENS

H100_GRAPHED_S = 1.6e-3
H100_PER_SEQ_S = 6.4e-6
H100_EAGER_S = 10e-3
H100_PER_PREFILL_TOKEN_S = 15e-6
H100_PER_CONTEXT_TOKEN_S = 2e-9
H100_GRAPHED_PER_PREFILL_TOKEN_S = 0.2e-6


def h100_step(plan: StepPlan, max_graphed: int) -> float:
    """Seconds an H100 took for ``plan`` (graphs captured up to ``max_graphed`` sequences)."""
    return _h100_seconds(StepShape.of(plan), max_graphed, whole_step=False)


def h100_whole_step(plan: StepPlan, max_graphed: int) -> float:
    """Seconds an H100 took for ``plan`` with the whole-step graphs."""
    return _h100_seconds(StepShape.of(plan), max_graphed, whole_step=True)


def _h100_seconds(shape: StepShape, max_graphed: int, whole_step: bool) -> float:
    """A decode-only step of up to ``max_graphed`` sequences replays a graph;
    with ``whole_step``, so does a step with a prefill of up to
    ``PREFILL_GRAPH_TOKENS`` tokens (a decode is one token); others are eager."""
    prefill = shape.num_prefill_tokens
    rest = (
        H100_PER_SEQ_S * shape.num_decode_seqs + H100_PER_CONTEXT_TOKEN_S * shape.num_context_tokens
    )
    if prefill == 0 and shape.num_decode_seqs <= max_graphed:
        return H100_GRAPHED_S + rest
    if prefill and whole_step and prefill + shape.num_decode_seqs <= PREFILL_GRAPH_TOKENS:
        return H100_GRAPHED_S + H100_GRAPHED_PER_PREFILL_TOKEN_S * prefill + rest
    return H100_EAGER_S + H100_PER_PREFILL_TOKEN_S * prefill + rest


DEVICE_STEPS: dict[str, Callable[[StepPlan, int], float]] = {
    "h100": h100_step,
    "h100-whole-step": h100_whole_step,
}


def device_steps(name: str, max_num_seqs: int) -> Callable[[StepPlan], float]:
    return partial(DEVICE_STEPS[name], max_graphed=max_num_seqs)


def calibrated_on(
    steps: Callable[[StepPlan], float], token_budget: int, max_num_seqs: int, block_size: int
) -> CostCoefficients:
    """The start-up calibration's coefficients, had its steps run on ``steps``."""
    plans = calibration_plans(block_size, 1 << 20, token_budget, max_num_seqs)
    return fit_steps([(plan, steps(plan)) for plan in plans])

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

``h200-loaded``: SmolLM2's shape on an H200 as the engine's host ran it
under overload (``bench slo --device cuda``, 1,000 requests a cell at 1.5x,
2026-11-28; docs/gpu.md, "1,000 requests a cell"): every step costs the
host's floor, 2.37 ms, plus 0.033 ms a sequence (a least-squares line
through the steps its class-0 misses lived through: 2.4-3.0 ms at 8.5-12
sequences, 3.2-3.5 ms at 26-31) and the whole-step graph's 0.2 µs a prefill
token. A request alone steps in about 1 ms on the same engine idle (the
deadline yardstick's scale times its calibration's fixed cost, ~1 ms in
every such report): deadlines set from that (``bench slo --yardstick``)
and steps of this floor are the gap the engine runs in.
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


H200_LOADED_FLOOR_S = 2.37e-3
H200_LOADED_PER_SEQ_S = 0.033e-3


def h200_loaded_step(plan: StepPlan, max_graphed: int) -> float:
    """Seconds a step took an H200's engine under overload, its host's floor
    included (``max_graphed`` unused: the floor does not depend on it)."""
    shape = StepShape.of(plan)
    return (
        H200_LOADED_FLOOR_S
        + H200_LOADED_PER_SEQ_S * len(plan.seqs)
        + H100_GRAPHED_PER_PREFILL_TOKEN_S * shape.num_prefill_tokens
    )


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
    "h200-loaded": h200_loaded_step,
}


def device_steps(name: str, max_num_seqs: int) -> Callable[[StepPlan], float]:
    return partial(DEVICE_STEPS[name], max_graphed=max_num_seqs)


def calibrated_on(
    steps: Callable[[StepPlan], float], token_budget: int, max_num_seqs: int, block_size: int
) -> CostCoefficients:
    """The start-up calibration's coefficients, had its steps run on ``steps``."""
    plans = calibration_plans(block_size, 1 << 20, token_budget, max_num_seqs)
    return fit_steps([(plan, steps(plan)) for plan in plans])

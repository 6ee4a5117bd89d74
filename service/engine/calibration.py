"""Start-up calibration of the scheduler's step-cost model on the real runner.

``calibrate(runner, ...)`` times a few synthetic steps before the engine
takes traffic — prefill chunks of several sizes, decode batches of several
sizes at short and long context, and block swaps device <-> host — and fits
``slipstream.scheduler.cost_model.CostModel`` to them (least squares). The
engine then keeps it current by feeding every executed step to
``CostModel.observe_plan(plan, seconds)``.

Each plan runs once untimed (the first call of a shape pays one-off
kernel set-up) and then ``repeats`` times; the fit takes each plan's
*fastest* run. Another process briefly holding a core slows a run by
10-20x on a small CPU; the minimum shrugs that off, whereas a mean once
turned a 27 ms step into a 650 ms estimate and made every deadline derived
from it 20x too loose.

The synthetic plans write garbage K/V into device blocks; run this only
while the pool is empty (before ``Engine.start``). Typical cost: 2-4 s on CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

from slipstream.kernels.block_copy import copy_blocks
from slipstream.scheduler.cost_model import CostCoefficients, CostModel
from slipstream.scheduler.plan import ScheduledSeq, StepPlan
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine.runner import ModelRunner

_TOKEN = 5


def calibrate(
    runner: ModelRunner,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    *,
    repeats: int = 3,
) -> CostModel:
    """A cost model fitted to the fastest of ``repeats`` timed runs of each
    synthetic step on ``runner``."""
    num_blocks = runner.device_pool[0][0].shape[0]
    plans = list(
        _calibration_plans(runner.block_size, num_blocks, max_num_batched_tokens, max_num_seqs)
    )
    fit = CostModel(CostCoefficients(), forgetting=1.0, prior_weight=1e-3)
    for plan in plans:
        runner.execute(plan)  # warm-up: this shape's one-off set-up stays out of the fit
        fit.observe_plan(plan, min(_timed(runner, plan) for _ in range(repeats)))
    model = CostModel(fit.coefficients)
    model.set_swap_cost(measure_swap_seconds_per_block(runner))
    return model


def _timed(runner: ModelRunner, plan: StepPlan) -> float:
    start = time.perf_counter()
    runner.execute(plan)
    return time.perf_counter() - start


def measure_swap_seconds_per_block(runner: ModelRunner, num_blocks: int = 32) -> float:
    """Seconds to copy one block device -> host (the direction a swap-out
    takes; swap-in costs the same on CPU)."""
    num_blocks = min(num_blocks, runner.device_pool[0][0].shape[0], runner.host_pool[0][0].shape[0])
    if num_blocks == 0:
        return CostCoefficients().swap_s_per_block
    pairs = [(i, i) for i in range(num_blocks)]
    copy_blocks(runner.device_pool, runner.host_pool, pairs)
    fastest = math.inf
    for _ in range(3):
        start = time.perf_counter()
        copy_blocks(runner.device_pool, runner.host_pool, pairs)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest / num_blocks


def _calibration_plans(
    block_size: int, num_blocks: int, budget: int, max_seqs: int
) -> Iterator[StepPlan]:
    for n in sorted({16, budget // 4, budget // 2, budget}):
        if n >= 1:
            yield synthetic_plan([(0, n)], block_size, num_blocks)
    for context in (64, 512):
        for batch in sorted({1, 4, min(16, max_seqs), min(64, max_seqs)}):
            if batch * (-(-(context + 1) // block_size)) <= num_blocks:
                yield synthetic_plan([(context, 1)] * batch, block_size, num_blocks)


def synthetic_plan(shapes: list[tuple[int, int]], block_size: int, num_blocks: int) -> StepPlan:
    """One greedy step: a sequence per (start_pos, num_new), each over its own
    consecutive blocks (sequence 0 from block 0). Raises ValueError when the
    ``num_blocks`` pool cannot hold them."""
    seqs, next_block = [], 0
    for i, (start, num_new) in enumerate(shapes):
        count = -(-(start + num_new) // block_size)
        blocks = list(range(next_block, next_block + count))
        next_block += count
        if next_block > num_blocks:
            raise ValueError("the device pool is too small for the calibration plan")
        seqs.append(
            ScheduledSeq(
                req_id=f"calibrate-{i}",
                token_ids=[_TOKEN] * num_new,
                start_pos=start,
                block_ids=blocks,
                sample=True,
                output_index=1 if num_new == 1 else 0,
                sampling=SamplingParams(),
            )
        )
    return StepPlan(step=0, seqs=seqs)

"""Start-up calibration of the scheduler's step-cost model on the real runner.

``calibrate(runner, ...)`` times a few synthetic steps before the engine
takes traffic — prefill chunks of several sizes, decode batches of several
sizes at short and long context, and block swaps device <-> host — and fits
``slipstream.scheduler.cost_model.CostModel`` to them (non-negative least
squares in relative error, ``cost_model.fit_relative``). The
engine then keeps it current by feeding every executed step to
``CostModel.observe_plan(plan, seconds)``.

Each plan runs once untimed (the first call of a shape pays one-off
kernel set-up) and then ``repeats`` times; the fit takes each plan's
*fastest* run. Another process briefly holding a core slows a run by
10-20x on a small CPU; the minimum shrugs that off, whereas a mean once
turned a 27 ms step into a 650 ms estimate and made every deadline derived
from it 20x too loose.

The synthetic plans write garbage K/V into device blocks; run this only
while the pool is empty (before ``Engine.start``). Typical cost: 2-4 s on CPU
for ``small``, tens of seconds for SmolLM2-135M on two cores.

``calibrate_cached`` keeps the result under ``$SLIPSTREAM_HOME/cache/calibration``,
keyed by everything a step's time depends on (model, CPU, dtype, threads,
attention backend, block size, step budget), so only a machine's first start
pays for it; the cost model still refits online from every executed step.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path

import structlog

from slipstream.kernels.block_copy import copy_blocks
from slipstream.kernels.compute_thread import on_own_thread
from slipstream.scheduler.cost_model import CostCoefficients, CostModel, StepShape, fit_relative
from slipstream.scheduler.plan import ScheduledSeq, StepPlan
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine.runner import ModelRunner

log = structlog.get_logger(__name__)

_TOKEN = 5
# Bump when the plans or the fit change: older cached results no longer apply.
# 2: the fit takes the timed steps as measured (1 clipped them against the
# built-in guess and came out up to 20x slow on a fast machine): re-measure.
# 3: a fifth coefficient, the fixed cost of a step holding a prefill.
# 4: prefill chunks beside decodes (mixed steps) among the plans.
# 5: timed on a thread of its own, as the engine's steps run (compute_thread.py);
# steps timed beside the caller's idle OpenMP team ran up to 3x slow.
# 6: fitted in relative error, no coefficient below zero (cost_model.fit_relative).
CALIBRATION_VERSION = 6


def calibrate(
    runner: ModelRunner,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    *,
    repeats: int = 3,
    quick: bool = False,
) -> CostModel:
    """A cost model fitted to the fastest of ``repeats`` timed runs of each
    synthetic step on ``runner``, after one untimed warm-up run.

    ``quick`` (a server's start-up) times fewer shapes (three prefill sizes,
    three decode batch sizes at two contexts: still twice the four unknowns
    and more) twice each with no separate warm-up, so the first run carries
    the shape's one-off set-up and the minimum discards it: about a third of
    the full cost. The engine's online refit corrects what it misses.

    On the CPU it runs on a thread of its own, as the engine's steps do (see
    compute_thread.py), so that it times them as they will run."""
    if runner.device_pool[0][0].device.type == "cpu":
        return on_own_thread(
            lambda: _calibrate(runner, max_num_batched_tokens, max_num_seqs, repeats, quick),
            "slipstream-calibrate",
        )
    return _calibrate(runner, max_num_batched_tokens, max_num_seqs, repeats, quick)


def _calibrate(
    runner: ModelRunner, max_num_batched_tokens: int, max_num_seqs: int, repeats: int, quick: bool
) -> CostModel:
    num_blocks = runner.device_pool[0][0].shape[0]
    plans = list(
        calibration_plans(
            runner.block_size, num_blocks, max_num_batched_tokens, max_num_seqs, quick
        )
    )
    if quick:
        repeats = 2
    timed = []
    for plan in plans:
        if not quick:
            runner.execute(plan)  # this shape's one-off set-up stays out of the fit
        timed.append((plan, min(_timed(runner, plan) for _ in range(repeats))))
    model = CostModel(fit_steps(timed))
    model.set_swap_cost(measure_swap_seconds_per_block(runner))
    return model


def fit_steps(timed: list[tuple[StepPlan, float]]) -> CostCoefficients:
    """The timed steps' coefficients, as measured: least squares in relative
    error with none below zero (``cost_model.fit_relative``). The fixed cost
    of a step holding a prefill comes out where the steps show one (a GPU's
    eager step against a graphed decode) and at zero where they do not."""
    return fit_relative([(StepShape.of(plan), seconds) for plan, seconds in timed])


def calibrate_cached(
    runner: ModelRunner,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    cache_dir: Path,
    identity: Mapping[str, object],
) -> CostModel:
    """``calibrate`` once per machine and set-up: the coefficients are read
    from ``cache_dir`` when a file for the same key exists, else measured and
    saved (atomically). ``identity`` names the model, CPU, dtype, threads and
    attention backend; the runner adds its pool and block sizes."""
    key = {
        "version": CALIBRATION_VERSION,
        **identity,
        "block_size": runner.block_size,
        "num_device_blocks": runner.device_pool[0][0].shape[0],
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_seqs": max_num_seqs,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    path = cache_dir / f"cost-{digest[:16]}.json"
    cached = _read_cached(path, key)
    if cached is not None:
        log.info("cost_model_cached", path=str(path))
        return CostModel(cached)
    start = time.perf_counter()
    model = calibrate(runner, max_num_batched_tokens, max_num_seqs, quick=True)
    _write_cached(path, key, model.coefficients)
    log.info("cost_model_calibrated", seconds=round(time.perf_counter() - start, 1), path=str(path))
    return model


def _read_cached(path: Path, key: Mapping[str, object]) -> CostCoefficients | None:
    try:
        data = json.loads(path.read_text())
        if data["key"] != json.loads(json.dumps(key, sort_keys=True, default=str)):
            return None
        return CostCoefficients(**data["coefficients"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # damaged: measure again
        log.warning("cost_model_cache_unreadable", path=str(path), error=str(exc))
        return None


def _write_cached(path: Path, key: Mapping[str, object], coeffs: CostCoefficients) -> None:
    text = json.dumps({"key": key, "coefficients": asdict(coeffs)}, sort_keys=True, default=str)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as exc:  # a read-only cache costs the next start a calibration, no more
        log.warning("cost_model_cache_unwritable", path=str(path), error=str(exc))
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # readers see the old file or the whole new one
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        log.warning("cost_model_cache_unwritable", path=str(path), error=str(exc))


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


def calibration_plans(
    block_size: int, num_blocks: int, budget: int, max_seqs: int, quick: bool = False
) -> Iterator[StepPlan]:
    """The synthetic steps ``calibrate`` times: prefills alone of a few sizes,
    decode batches of a few sizes at a short and a long context, and a
    prefill chunk beside decode batches. The largest prefill is the step
    budget or what the pool holds, whichever is less (a GPU's 8192-token
    budget over a small pool).

    The mixed steps are what a loaded engine runs most: on a GPU such a step
    costs more than its parts (an H200, SmolLM2's shape: a 256-token chunk
    beside 64 decodes 4.5 ms, the decodes alone 1.5 ms, the chunk alone
    1.9 ms), which steps of one kind never show; without them the fit put
    the fixed cost of a step holding a prefill at 0 and the engine's refit
    took it to 2.4 ms under load. (Fitted in relative error, two mixed steps
    among a dozen raise that cost part of the way; the refit does the rest.)"""
    budget = min(budget, num_blocks * block_size)
    prefills = {16, budget // 4, budget} if quick else {16, budget // 4, budget // 2, budget}
    for n in sorted(prefills):
        if n >= 1:
            yield synthetic_plan([(0, n)], block_size, num_blocks)
    batches = {1, min(16, max_seqs), min(64, max_seqs)} | (set() if quick else {min(4, max_seqs)})
    for context in (64, 512):
        for batch in sorted(batches):
            if batch * (-(-(context + 1) // block_size)) <= num_blocks:
                yield synthetic_plan([(context, 1)] * batch, block_size, num_blocks)
    chunk = min(256, budget // 4)
    for decodes in sorted({min(16, max_seqs - 1), min(64, max_seqs - 1)}):
        blocks = -(-chunk // block_size) + decodes * (-(-(64 + 1) // block_size))
        if chunk >= 1 and decodes >= 1 and chunk + decodes <= budget and blocks <= num_blocks:
            yield synthetic_plan([(0, chunk)] + [(64, 1)] * decodes, block_size, num_blocks)


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

"""Sampling with the per-row parameters as tensors: the one sampler body,
the GPU step's and, through ``sampling.sample``, the CPU's.

Inverse-CDF sampling (``sampling_primitives``: one uniform draw a row, the
first token whose cumulative probability passes it), split in two so the
device never waits for the host and the host never reads the device:

- ``plan_sampling`` (host, plain lists): which rows sample rather than take
  the argmax, their temperatures / min-p / top-k / top-p, which carry a
  seed, and the few facts that fix tensor shapes and the filters run
  (``max_top_k``, ``any_top_p``, ``any_min_p``);
- ``sample_tensors`` (any device): the math over tensors, with shapes known
  from the plan, so nothing in it synchronises (no ``.item()``, no
  ``.tolist()``): the greedy argmax (``row_argmax``), the temperature
  division (``divide_rows``; over the logits themselves when every row
  samples, over the sampling rows' gather otherwise), min-p (a batch
  without it runs none), top-k and top-p, in vLLM's order
  (``sampling_filters``), the unnormalised softmax (``exp_weights_``) and
  the pick (``pick_by_cdf``). When every row samples no argmax is taken.
  Before all of it, the rows whose requests ask for penalties or a logit
  bias are adjusted in place (``logit_adjustments``); a batch without
  them runs none of that.
  On the CPU, where the host may read the device, a batch with top-k
  takes its weights from the rows' top-k candidates
  (``top_k_weights``: the same weights, 3-5x faster), and one with top-p
  (or min-p) alone takes the exp over the unfiltered rows
  (``top_p_weights``, ``min_p_weights``).

``sampling.sample`` (the CPU runner's sampler, lists in, tokens out) plans a
batch and runs ``sample_tensors`` over it, so the CPU and the GPU step pick
by the same code, row by row:

- greedy rows (``temperature <= 0`` or ``top_k == 1``): the argmax, the
  first maximum on ties;
- seeded rows: a draw from ``(seed, output_index)`` alone
  (``seeded_uniform``, a few integer operations on the host, one float64 a
  row sent to the device), the same in any batch. On a GPU the softmax, the
  top-p cumsum and the float64 cumulative sum round differently from the
  CPU's, so a seeded row can differ from the CPU's token where its draw
  falls within rounding of a boundary between two tokens: same tokens for a
  seed "where the math allows";
- unseeded rows: one batched draw of a uniform a row from ``generator``, in
  row order; on a GPU the CUDA generator's stream (no reproducibility is
  promised for unseeded rows).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from slipstream.kernels.logit_adjustments import LogitAdjustments, adjust_logits_
from slipstream.kernels.sampling_filters import (
    filter_min_p_,
    filter_top_k_,
    filter_top_p_,
    min_p_weights,
    top_k_weights,
    top_p_weights,
)
from slipstream.kernels.sampling_primitives import (
    divide_rows,
    exp_weights_,
    pick_by_cdf,
    row_argmax,
    seeded_draws,
)


@dataclass(frozen=True, slots=True)
class SamplingPlan:
    """Host-side facts of one step's sampling over ``num_rows`` logits rows.

    ``rows`` are the rows that sample (not greedy), ascending; the per-row
    lists below are aligned with ``rows``. ``top_ks`` are 0 where top-k is off
    (k <= 0 or k >= vocab). ``unseeded`` / ``seeded`` index into ``rows``.
    """

    num_rows: int
    rows: list[int]
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    unseeded: list[int]
    seeded: list[int]
    seeds: list[int]  # aligned with ``seeded``
    output_indices: list[int]  # aligned with ``seeded``
    max_top_k: int
    any_top_p: bool
    # Aligned with ``rows`` where a sampling row asks for min-p, else empty.
    min_ps: list[float] = dataclasses.field(default_factory=list)

    @property
    def all_greedy(self) -> bool:
        return not self.rows

    @property
    def any_min_p(self) -> bool:
        return bool(self.min_ps)


def plan_sampling(
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    seeds: list[int | None],
    output_indices: list[int],
    vocab_size: int,
    min_ps: list[float] | None = None,
) -> SamplingPlan:
    """The plan ``sample_tensors`` runs; the arguments are ``sampling.sample``'s
    (``min_ps`` None: min-p off on every row)."""
    n = len(temperatures)
    every = (top_ks, top_ps, seeds, output_indices) + (() if min_ps is None else (min_ps,))
    if not all(len(x) == n for x in every):
        raise ValueError(f"every per-row list must have {n} entries")
    rows = [i for i in range(n) if not (temperatures[i] <= 0.0 or top_ks[i] == 1)]
    ks = [top_ks[i] if 0 < top_ks[i] < vocab_size else 0 for i in rows]
    seeded = [j for j, i in enumerate(rows) if seeds[i] is not None]
    asked = min_ps is not None and any(min_ps)  # the common batch: one pass, no list
    row_min_ps = [min_ps[i] for i in rows] if asked else []  # type: ignore[index]
    return SamplingPlan(
        num_rows=n,
        rows=rows,
        temperatures=[temperatures[i] for i in rows],
        top_ks=ks,
        top_ps=[top_ps[i] for i in rows],
        unseeded=[j for j, i in enumerate(rows) if seeds[i] is None],
        seeded=seeded,
        seeds=[int(seeds[rows[j]]) for j in seeded],  # type: ignore[arg-type]
        output_indices=[output_indices[rows[j]] for j in seeded],
        max_top_k=max(ks, default=0),
        any_top_p=any(top_ps[i] < 1.0 for i in rows),
        min_ps=row_min_ps if any(row_min_ps) else [],
    )


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """A ``SamplingPlan``'s lists as tensors on the logits' device (the runner
    stages them with the rest of the step's metadata). ``seeded_uniforms``
    is float64 ``[len(plan.seeded)]`` (``seeded_uniforms``), None if none."""

    plan: SamplingPlan
    rows: torch.Tensor  # int64 [R]
    temperatures: torch.Tensor  # float32 [R]
    top_ks: torch.Tensor  # int64 [R]
    top_ps: torch.Tensor  # float32 [R]
    unseeded: torch.Tensor  # int64 [U]
    seeded: torch.Tensor  # int64 [S]
    seeded_uniforms: torch.Tensor | None
    min_ps: torch.Tensor | None = None  # float32 [R]; None where the plan has no min-p


def sampling_batch(plan: SamplingPlan, device: torch.device) -> SamplingBatch:
    """The batch built with plain ``torch.tensor`` calls (tests, the CPU); the
    GPU runner builds its tensors from pinned staging instead."""

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    uniforms = None
    if plan.seeded:
        uniforms = seeded_uniforms(plan.seeds, plan.output_indices).to(device)
    return SamplingBatch(
        plan=plan,
        rows=ints(plan.rows),
        temperatures=floats(plan.temperatures),
        top_ks=ints(plan.top_ks),
        top_ps=floats(plan.top_ps),
        unseeded=ints(plan.unseeded),
        seeded=ints(plan.seeded),
        seeded_uniforms=uniforms,
        min_ps=floats(plan.min_ps) if plan.any_min_p else None,
    )


def seeded_uniforms(seeds: list[int], output_indices: list[int]) -> torch.Tensor:
    """float64 ``[len(seeds)]`` on the CPU: row i's draw for ``(seeds[i],
    output_indices[i])`` (``seeded_uniform``; the GPU runner stages
    the same draws with the step's metadata)."""
    return torch.tensor(seeded_draws(seeds, output_indices), dtype=torch.float64)


def sample_tensors(
    logits: torch.Tensor,
    batch: SamplingBatch,
    generator: torch.Generator | None = None,
    scratch: torch.Tensor | None = None,
    adjustments: LogitAdjustments | None = None,
) -> torch.Tensor:
    """int64 ``[N]`` on the logits' device: one token per row of ``logits
    [N, vocab]``, by the batch's plan (the module docstring says how).
    float32 logits (every runner's since the LM heads write float32), or
    low-precision ones: the argmax reads them as they are, which gives the
    indices it gives over their exact float32 widening, and the rows that
    sample are widened by their division by the (float32) temperatures.
    ``generator`` (on the logits' device; default: its global RNG) draws
    the unseeded rows. The logits are read, never written, but where
    ``adjustments`` (penalties, logit biases: ``logit_adjustments``) adjust
    them in place first, greedy rows' too. ``scratch``
    (float32, on the logits' device, at least ``len(plan.rows) * vocab``
    elements; kept by the caller from step to step): where the sampling
    rows are scaled and filtered, in place of a fresh vocabulary-wide tensor
    a step, which the CPU pages in on every call once it passes glibc's
    mmap threshold (23 of a 256-row sample's 47 ms on two Zen 3 cores)."""
    plan = batch.plan
    if logits.dim() != 2 or logits.shape[0] != plan.num_rows:
        raise ValueError(f"logits must be [{plan.num_rows}, vocab], got {tuple(logits.shape)}")
    if adjustments is not None:
        adjust_logits_(logits, adjustments, scratch)
    if plan.all_greedy:
        return row_argmax(logits)
    every_row = len(plan.rows) == plan.num_rows
    rows = logits if every_row else logits.index_select(0, batch.rows)
    out = None
    if scratch is not None:
        out = scratch[: len(plan.rows) * logits.shape[1]].view(len(plan.rows), logits.shape[1])
    scaled = divide_rows(rows, batch.temperatures, out)  # float32: the temperatures are
    on_cpu = scaled.device.type == "cpu"  # the host reads a few flags
    min_ps = batch.min_ps
    if plan.any_min_p and min_ps is None:
        raise ValueError("the plan has min-p rows but the batch carries no min_ps")
    # Min-p alone on the CPU takes min_p_weights; any other filter runs after it.
    if min_ps is not None and not (on_cpu and not plan.max_top_k and not plan.any_top_p):
        filter_min_p_(scaled, min_ps)
        min_ps = None
    weights = None
    if on_cpu:
        if plan.max_top_k:
            top_ps = batch.top_ps if plan.any_top_p else None
            weights = top_k_weights(scaled, batch.top_ks, plan.max_top_k, top_ps)
        elif plan.any_top_p:
            weights = top_p_weights(scaled, batch.top_ps)
        elif min_ps is not None:
            weights = min_p_weights(scaled, min_ps)
    if weights is None:
        if min_ps is not None:
            filter_min_p_(scaled, min_ps)
        if plan.max_top_k:
            filter_top_k_(scaled, batch.top_ks, plan.max_top_k)
        if plan.any_top_p:
            filter_top_p_(scaled, batch.top_ps)
        weights = exp_weights_(scaled)
    picked = pick_by_cdf(weights, _uniforms(batch, generator))
    if every_row:
        return picked
    return row_argmax(logits).index_copy_(0, batch.rows, picked)


def _uniforms(batch: SamplingBatch, generator: torch.Generator | None) -> torch.Tensor:
    """float64 ``[R]`` draws in [0, 1) on the batch's device: the unseeded
    rows' from ``generator`` in one call, in row order, the seeded rows'
    staged in the batch."""
    plan, device = batch.plan, batch.rows.device
    if len(plan.unseeded) == len(plan.rows):
        return torch.rand(len(plan.rows), generator=generator, dtype=torch.float64, device=device)
    if batch.seeded_uniforms is None:
        raise ValueError("the plan has seeded rows but the batch carries no seeded draws")
    uniforms = torch.empty(len(plan.rows), dtype=torch.float64, device=device)
    uniforms.index_copy_(0, batch.seeded, batch.seeded_uniforms)
    if plan.unseeded:
        draws = torch.rand(len(plan.unseeded), generator=generator, dtype=torch.float64,
                           device=device)  # fmt: skip
        uniforms.index_copy_(0, batch.unseeded, draws)
    return uniforms

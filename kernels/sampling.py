"""Next-token sampling over a batch on the CPU: greedy, temperature, min-p,
top-k, top-p, with the per-row parameters as lists and the tokens as a list.

``sample`` is the CPU runner's entry to the one sampler body,
``device_sampling.sample_tensors``: it plans the batch
(``plan_sampling``), builds the plan's tensors and runs it, so the CPU and
the GPU step pick by the same code. A batch with no sampling row takes
``row_argmax`` alone, once any penalties or logit biases have adjusted
their rows (``logit_adjustments``). The math (one uniform draw a row, the
inverse-CDF pick, the seeded draws) is ``sampling_primitives``'; its public
names are importable from here too.
"""

from __future__ import annotations

import torch

from slipstream.kernels.device_sampling import plan_sampling, sample_tensors, sampling_batch
from slipstream.kernels.logit_adjustments import LogitAdjustments
from slipstream.kernels.sampling_primitives import (
    divide_rows,
    exp_weights_,
    pick_by_cdf,
    row_argmax,
    seeded_uniform,
)

__all__ = [
    "divide_rows",
    "exp_weights_",
    "pick_by_cdf",
    "row_argmax",
    "sample",
    "seeded_uniform",
]


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    seeds: list[int | None],
    output_indices: list[int],
    generator: torch.Generator | None = None,
    scratch: torch.Tensor | None = None,
    adjustments: LogitAdjustments | None = None,
    min_ps: list[float] | None = None,
) -> list[int]:
    """One token per row of ``logits [N, vocab]`` (float32, or a low-precision
    model's: see ``sample_tensors``).

    Greedy rows (``temperature <= 0`` or ``top_k == 1``) take ``argmax`` (first max on
    ties). ``top_k == 0`` and ``top_p == 1.0`` disable those filters; top-k keeps every
    logit tied with the k-th largest. A seeded row's draw comes from ``(seed,
    output_index)`` alone; unseeded rows draw from ``generator`` (on the logits' device;
    default: its global RNG) in one batched call. ``scratch``: see ``sample_tensors``.
    ``adjustments``: penalties and logit biases, made in place on their rows
    first (``logit_adjustments``), before greedy rows take their argmax too.
    ``min_ps`` (None: off on every row): a sampling row keeps the tokens
    whose probability is at least its min-p times the likeliest's, after
    its temperature and before top-k and top-p (``sampling_filters``).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, vocab], got {tuple(logits.shape)}")
    n, vocab = logits.shape
    if len(temperatures) != n:
        raise ValueError(f"every per-row list must have {n} entries")
    plan = plan_sampling(temperatures, top_ks, top_ps, seeds, output_indices, vocab, min_ps)
    if plan.all_greedy and adjustments is None:
        return row_argmax(logits).tolist()
    batch = sampling_batch(plan, logits.device)
    return sample_tensors(logits, batch, generator, scratch, adjustments).tolist()

"""The logit adjustments a request may ask for, made on the rows that ask
before the sampler (``device_sampling.sample_tensors``) reads them, so a
greedy row's argmax sees them too: OpenAI's ``logit_bias``,
``presence_penalty`` and ``frequency_penalty``, vLLM's (the CTRL
paper's) ``repetition_penalty``, and vLLM's ``min_tokens`` mask. In vLLM's
order, on each adjusted row ``x``::

    x[t] += bias[t]                                    each biased token t
    x[t] = x[t] / r  if x[t] > 0  else  x[t] * r       t in the prompt or generated
    x[t] -= frequency * count[t] + presence * (count[t] > 0)
    x[t] = -inf                                        each banned token t

where ``count[t]`` is how often the request has generated t so far, and
the banned tokens are a request's EOS and stop token ids while fewer than
its ``min_tokens`` outputs are out (ids past the vocabulary skipped: no
row can sample them). The ban is made before the penalties, which keep
-inf as it is (their factors are positive and finite).

Split as the sampler is, so the device never waits for the host:

- ``plan_adjustments`` (host, plain lists): the adjusted rows' penalties,
  and the places they touch as flat indices into the logits (``row *
  vocab + token``): each biased token, each occurrence of a token a
  penalty reads (generated, or with a repetition penalty in the prompt),
  repeats kept;
- ``adjustment_tensors``: the plan sent up in two copies (its integers and
  its floats; pinned and non-blocking off the CPU);
- ``adjust_logits_`` (any device): torch ops with shapes known from the
  plan, nothing that synchronises, over those places alone, gathers and
  scatters: no vocabulary-wide pass (64 rows of 49,152 logits are 12.6
  MB). Each token's count is summed in a ``[rows, vocab]`` table whose
  entries at those places alone are zeroed first (the CPU sampler's
  scratch, already paged in, or a fresh one); every occurrence of a place
  computes the same new logit from the same inputs, so repeats write the
  same value.

A step where no row asks has no plan, and runs none of this.

A row sampling output ``k > 0`` feeds output ``k - 1`` as its last token,
which a step planned ahead of its predecessor's results holds on the device
alone (``staging.resolve_pending_tokens``). So a row's generated tokens are
its settled outputs (``k - 1`` of them, host lists) and its last input
token, which the runner passes as a tensor on the logits' device. Either
way they are the request's own tokens: the adjustment is the same in any
batch and after a preemption's recompute, and a seeded row draws the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

import numpy as np
import torch


class AdjustedRow(NamedTuple):
    """One sampled row's adjustments and the tokens they are over."""

    row: int  # among the step's sampled rows
    presence: float
    frequency: float
    repetition: float
    logit_bias: Sequence[tuple[int, float]]  # (token id, bias), ids distinct
    prompt_ids: Sequence[int]  # read where repetition != 1
    output_ids: Sequence[int]  # generated before the row's last input token
    last_is_output: bool  # its last input token was generated (output index > 0)
    banned: Sequence[int] = ()  # masked to -inf (min_tokens' EOS and stop ids)


@dataclass(frozen=True, slots=True)
class AdjustmentPlan:
    """Host-side facts of one step's adjustments over ``num_rows`` sampled
    rows: the per-row lists are aligned with ``rows`` (ascending), a "slot"
    is an index into them, a place is ``row * vocab_size + token``."""

    num_rows: int
    vocab_size: int
    rows: list[int]
    presence: list[float]
    frequency: list[float]
    repetition: list[float]
    seen: np.ndarray  # int64 places: the settled generated tokens, then the prompts'
    seen_slots: np.ndarray  # int64, aligned with ``seen``
    seen_counts_at: np.ndarray  # int64: ``slot * vocab_size + token``, the count table's
    num_generated: int  # the leading entries of ``seen`` that were generated
    last_slots: list[int]  # the slots whose last input token was generated
    bias_at: np.ndarray  # int64 places, one a biased token
    bias: np.ndarray  # float32, aligned with ``bias_at``
    ban_at: np.ndarray  # int64 places, one a banned token (repeats harmless)

    @property
    def has_penalties(self) -> bool:
        return bool(len(self.seen) or self.last_slots)


def plan_adjustments(
    adjusted: Sequence[AdjustedRow], num_rows: int, vocab_size: int
) -> AdjustmentPlan | None:
    """The plan ``adjust_logits_`` runs for ``adjusted`` (rows ascending,
    each below ``num_rows``); None when there are none. Raises ValueError
    for a biased token outside the vocabulary (the fronts refuse one first)."""
    if not adjusted:
        return None
    rows = [row.row for row in adjusted]
    if any(a >= b for a, b in pairwise(rows)) or rows[-1] >= num_rows:
        raise ValueError(f"adjusted rows must ascend below {num_rows}")
    generated: list[np.ndarray] = []
    prompts: list[np.ndarray] = []
    generated_slots: list[np.ndarray] = []
    prompt_slots: list[np.ndarray] = []
    bias_at: list[np.ndarray] = []
    bias: list[np.ndarray] = []
    ban_at: list[np.ndarray] = []
    last_slots = []
    for j, row in enumerate(adjusted):
        if row.presence or row.frequency or row.repetition != 1.0:
            generated.append(np.asarray(row.output_ids, dtype=np.int64))
            generated_slots.append(np.full(len(generated[-1]), j, dtype=np.int64))
            if row.last_is_output:
                last_slots.append(j)
        if row.repetition != 1.0:
            prompts.append(np.asarray(row.prompt_ids, dtype=np.int64))
            prompt_slots.append(np.full(len(prompts[-1]), j, dtype=np.int64))
        if row.logit_bias:
            ids = np.fromiter((t for t, _ in row.logit_bias), np.int64, len(row.logit_bias))
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
            bias_at.append(ids + row.row * vocab_size)
            bias.append(np.fromiter((b for _, b in row.logit_bias), np.float32, len(ids)))
        if row.banned:
            ids = np.asarray(row.banned, dtype=np.int64)
            ban_at.append(ids[(ids >= 0) & (ids < vocab_size)] + row.row * vocab_size)
    tokens = _joined(generated + prompts, np.int64)
    slots = _joined(generated_slots + prompt_slots, np.int64)
    if len(tokens) and not 0 <= tokens.min() <= tokens.max() < vocab_size:
        # A pending token (-1) taken for a settled one would index another
        # row here, or on a GPU end the process's CUDA context.
        raise ValueError(f"penalised token ids must be in [0, {vocab_size})")
    return AdjustmentPlan(
        num_rows=num_rows,
        vocab_size=vocab_size,
        rows=rows,
        presence=[row.presence for row in adjusted],
        frequency=[row.frequency for row in adjusted],
        repetition=[row.repetition for row in adjusted],
        seen=tokens + np.asarray(rows, dtype=np.int64)[slots] * vocab_size,
        seen_slots=slots,
        seen_counts_at=tokens + slots * vocab_size,
        num_generated=sum(len(part) for part in generated),
        last_slots=last_slots,
        bias_at=_joined(bias_at, np.int64),
        bias=_joined(bias, np.float32),
        ban_at=_joined(ban_at, np.int64),
    )


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


@dataclass(frozen=True, slots=True)
class LogitAdjustments:
    """An ``AdjustmentPlan`` as tensors on the logits' device, with the
    step's ``last_tokens`` (int64 ``[num_rows]``: each sampled row's last
    input token, where the plan's ``last_slots`` read theirs)."""

    plan: AdjustmentPlan
    presence: torch.Tensor  # float32 [P], by slot
    frequency: torch.Tensor  # float32 [P]
    repetition: torch.Tensor  # float32 [P]
    seen: torch.Tensor  # int64 places
    seen_slots: torch.Tensor  # int64
    seen_counts_at: torch.Tensor  # int64
    last_rows: torch.Tensor  # int64 [L]: the sampled rows of ``last_slots``
    last_slots: torch.Tensor  # int64 [L]
    bias_at: torch.Tensor  # int64 places
    bias: torch.Tensor  # float32
    last_tokens: torch.Tensor
    ban_at: torch.Tensor  # int64 places


def adjustment_tensors(plan: AdjustmentPlan, last_tokens: torch.Tensor) -> LogitAdjustments:
    """The plan's tensors on ``last_tokens``' device: its integers in one
    copy, its floats in another, from pinned memory without waiting off the
    CPU (as ``token_logprobs`` sends its rows)."""
    device = last_tokens.device
    last_rows = [plan.rows[j] for j in plan.last_slots]
    int_parts = [
        plan.seen,
        plan.seen_slots,
        plan.seen_counts_at,
        np.asarray(last_rows, dtype=np.int64),
        np.asarray(plan.last_slots, dtype=np.int64),
        plan.bias_at,
        plan.ban_at,
    ]
    float_parts = [
        np.asarray(plan.presence, dtype=np.float32),
        np.asarray(plan.frequency, dtype=np.float32),
        np.asarray(plan.repetition, dtype=np.float32),
        plan.bias,
    ]
    ints = _upload(np.concatenate(int_parts), device).split([len(p) for p in int_parts])
    floats = _upload(np.concatenate(float_parts), device).split([len(p) for p in float_parts])
    seen, seen_slots, seen_counts_at, last_rows_t, last_slots, bias_at, ban_at = ints
    presence, frequency, repetition, bias = floats
    return LogitAdjustments(
        plan, presence, frequency, repetition, seen, seen_slots, seen_counts_at, last_rows_t,
        last_slots, bias_at, bias, last_tokens, ban_at,
    )  # fmt: skip


def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(values)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def adjust_logits_(
    logits: torch.Tensor, adjustments: LogitAdjustments, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """Adjusts the plan's places of ``logits [num_rows, vocab]`` (contiguous)
    in place, by the module docstring's formulas in float32, and returns
    ``logits``; nothing else is written. ``scratch`` (float32, on the
    logits' device; any contents): the count table where it holds one
    (``len(plan.rows) * vocab`` elements), else a fresh one."""
    a, plan = adjustments, adjustments.plan
    vocab = plan.vocab_size
    if tuple(logits.shape) != (plan.num_rows, vocab) or not logits.is_contiguous():
        raise ValueError(f"logits must be contiguous [{plan.num_rows}, {vocab}], "
                         f"got {tuple(logits.shape)}")  # fmt: skip
    flat = logits.view(-1)
    if len(plan.bias):  # one place a biased token: no repeats
        flat.index_add_(0, a.bias_at, a.bias.to(flat.dtype))
    if len(plan.ban_at):  # before the penalties, which keep -inf
        flat.index_fill_(0, a.ban_at, float("-inf"))
    if not plan.has_penalties:
        return logits
    last_tokens = a.last_tokens.index_select(0, a.last_rows)
    places = torch.cat([a.seen, a.last_rows * vocab + last_tokens])  # repeats kept
    counts_at = torch.cat([a.seen_counts_at, a.last_slots * vocab + last_tokens])
    generated_at = torch.cat([a.seen_counts_at[: plan.num_generated], counts_at[len(a.seen) :]])
    table_size = len(plan.rows) * vocab
    table = scratch if scratch is not None and scratch.numel() >= table_size else None
    table = (
        torch.empty(table_size, dtype=torch.float32, device=flat.device) if table is None else table
    )
    table.index_fill_(0, counts_at, 0.0)
    table.index_add_(0, generated_at, table.new_ones(len(generated_at)))
    counts = table.index_select(0, counts_at)
    slots = torch.cat([a.seen_slots, a.last_slots])
    r = a.repetition.index_select(0, slots)
    x = flat.index_select(0, places).float()  # biased already
    x = torch.where(x > 0, x / r, x * r)
    x -= a.frequency.index_select(0, slots) * counts
    x -= a.presence.index_select(0, slots) * (counts > 0)
    # Repeats of a place computed the same value from the same inputs.
    flat.index_copy_(0, places, x.to(flat.dtype))
    return logits

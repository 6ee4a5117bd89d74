"""Verifying draft tokens (speculative decoding by prompt lookup): which of a
sequence's drafts the model accepts, and the token it adds after them.

A drafting sequence ran as one query ``[last, d1 .. dk]``, so the step has
``k + 1`` rows of logits for it: row ``i`` is the model's next token after
``d_i`` (row 0: after ``last``). Verification walks the rows in order: row
``i`` either accepts ``d_(i+1)`` and goes on, or picks the token that
replaces it and stops; a row past the last draft (all accepted) picks one
token of its own. A sequence thus gets 1 to ``k + 1`` tokens.

A prompt-lookup draft is a point proposal (``q`` one-hot on ``d``), so the
speculative-sampling rule is: accept ``d`` with probability ``p(d)``
(``p``: the row's final distribution, after temperature, top-k and top-p),
else draw the replacement from ``p`` with ``d``'s mass removed and
renormalised. ``verify_drafts`` draws each row's token ``x`` from ``p`` as
the sampler always does and accepts ``d`` exactly when ``x == d``, the
replacement being ``x`` itself: ``P(accept) = P(x = d) = p(d)``, and a
rejected row's ``x`` is distributed as ``p`` given ``x != d``, which is
``p`` without ``d``, renormalised. So each output token is distributed as
the model's own sampling would draw it, and a row takes its draw as a
plain decode of that output would: a seeded request's draw comes from
``(seed, output_index)`` alone, so it is as reproducible as without drafts
(the same seed, the same output) and, where its logits are the same, has
the same tokens; a greedy row (``p`` one-hot on the argmax) accepts
exactly the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from slipstream.kernels.sampling import sample


def verify_drafts(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    seeds: list[int | None],
    output_indices: list[int],
    generator: torch.Generator | None = None,
    scratch: torch.Tensor | None = None,
    min_ps: list[float] | None = None,
) -> list[list[int]]:
    """Each sequence's verified tokens. ``logits [sum(len(d) + 1), vocab]``:
    the sequences' rows in order, ``len(d) + 1`` each; the per-sequence
    lists are ``sample``'s parameters, ``output_indices`` the output its
    first row samples (row ``i``: output ``output_index + i``).
    ``generator``, ``scratch`` and ``min_ps`` (per sequence): ``sample``'s."""
    counts = [len(d) + 1 for d in drafts]
    if logits.dim() != 2 or logits.shape[0] != sum(counts):
        raise ValueError(f"{tuple(logits.shape)} logits for drafts of {[len(d) for d in drafts]}")
    outputs = [o + i for o, n in zip(output_indices, counts, strict=True) for i in range(n)]
    picks = sample(
        logits,
        _per_row(temperatures, counts),
        _per_row(top_ks, counts),
        _per_row(top_ps, counts),
        _per_row(seeds, counts),
        outputs,
        generator=generator,
        scratch=scratch,
        min_ps=None if min_ps is None else _per_row(min_ps, counts),
    )
    return accept_greedy(picks, drafts)


_T = TypeVar("_T")


def _per_row(values: list[_T], counts: list[int]) -> list[_T]:
    """Each sequence's value repeated for each of its ``counts`` rows."""
    return [v for v, n in zip(values, counts, strict=True) for _ in range(n)]


def accept_greedy(picks: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each sequence's verified tokens from its rows' ``picks`` (``len(d) +
    1`` a sequence, concatenated in order; greedy picks, or draws as
    ``verify_drafts`` takes them): the picks up to and including the first
    that differs from its draft (all of them where every draft was picked)."""
    verified = []
    row = 0
    for seq_drafts in drafts:
        num_drafts = len(seq_drafts)
        rows = picks[row : row + num_drafts + 1]
        if len(rows) != num_drafts + 1:
            raise ValueError(f"{len(picks)} picks for drafts of {[len(d) for d in drafts]}")
        accepted = 0
        while accepted < num_drafts and rows[accepted] == seq_drafts[accepted]:
            accepted += 1
        verified.append(list(rows[: accepted + 1]))
        row += num_drafts + 1
    if row != len(picks):
        raise ValueError(f"{len(picks)} picks for drafts of {[len(d) for d in drafts]}")
    return verified

"""Min-p, top-k and top-p over a batch of scaled logits, in place: the
filters the sampler (``device_sampling.sample_tensors``, on any device; on
the CPU through ``sampling.sample``) applies before it picks, in that order
(vLLM's): min-p first, so top-p's nucleus is taken over what min-p kept.

Min-p (vLLM's) keeps the logits whose probability is at least ``min_p``
times the row's likeliest: ``exp(x - max) >= min_p``, that is ``x >= max +
log(min_p)``, compared in logit space (no softmax; 0 keeps all, as log 0 is
-inf).

Top-k keeps every logit at or above its row's k-th largest. Top-p keeps
every logit at or above the smallest of the nucleus: the shortest run of
the row's logits in descending order whose probabilities (softmax over the
row) sum to p, the first always in. A row with p >= 1 keeps all, whatever
the rows beside it ask: its weights do not depend on its batch, and on the
CPU it costs no search (a row whose running sum never reaches 1 in float32
was sorted whole, ~4.3 ms, to find that out). On the CPU the nucleus is looked for
among each row's largest logits first (``topk``), ``NUCLEUS_CANDIDATES``
of them, then more for the rows whose candidates held less than p, and a
row is sorted whole only when the last tier holds less than p too: the
same threshold, as the candidates are the sorted row's first entries and
their running sum the same sequential sum. On a Zen 3 core, 49,152 tokens,
a whole-row sort costs ~4.3 ms a row, 1,024 candidates ~0.5 and 8,192
~1.1 (a flat row's nucleus at p 0.9 often holds a few thousand).
Elsewhere the row is sorted: a data-dependent choice would make the host
wait for the device.

On the CPU, a batch with top-k takes ``top_k_weights`` instead of both
filters and ``exp_weights_``: the same weights from each row's ``max_top_k
+ 1`` largest logits. Filtering the whole row to -inf
and taking its exp cost 21 ms at 64 rows of a 49,152-token vocabulary
on a Zen 3 core (torch's CPU exp leaves its fast path for -inf), against
4.7 for the same exp over finite logits.
"""

from __future__ import annotations

import torch

from slipstream.kernels.sampling_primitives import exp_weights_, fused_op

# Candidates a row's nucleus is looked for among, tier by tier.
NUCLEUS_CANDIDATES = (1024, 8192)


def filter_min_p_(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Sets each row's logits whose probability is below ``min_ps`` times its
    likeliest token's to -inf (the module docstring); rows with 0 keep all."""
    floor = scaled.amax(dim=-1, keepdim=True).add_(min_ps.to(scaled.dtype).log().unsqueeze(1))
    return scaled.masked_fill_(scaled < floor, float("-inf"))


def min_p_weights(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor | None:
    """CPU: ``exp_weights_`` of ``scaled`` after ``filter_min_p_``, bit for
    bit, written over ``scaled`` (returned): the exp is taken over the finite
    row and the weights below the floor set to 0 after it, as
    ``top_p_weights`` does (the filtered row's ``-inf``s take torch's slow
    exp: 14.8 against 3.7 ms for 64 rows of 49,152 on one core). None, and
    ``scaled`` as it was, where a row's maximum is not finite."""
    top = scaled.amax(dim=-1, keepdim=True)
    if not bool(top.isfinite().all()):
        return None
    outside = scaled < top + min_ps.to(scaled.dtype).log().unsqueeze(1)
    return scaled.sub_(top).exp_().masked_fill_(outside, 0.0)


def filter_top_k_(scaled: torch.Tensor, top_ks: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Sets each row's logits below its ``top_ks`` largest to -inf (ties with
    the k-th kept); rows with k == 0 keep all. ``max_top_k`` is ``top_ks``'
    maximum, known on the host."""
    largest = scaled.topk(max_top_k, dim=-1).values
    kth = largest.gather(1, (top_ks.clamp_min(1) - 1).unsqueeze(1))
    kth = kth.masked_fill((top_ks == 0).unsqueeze(1), float("-inf"))
    return scaled.masked_fill_(scaled < kth, float("-inf"))


def filter_top_p_(scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Sets each row's logits below its nucleus of mass ``top_ps`` to -inf
    (see the module docstring); rows with p >= 1 keep all."""
    return scaled.masked_fill_(scaled < nucleus_smallest(scaled, top_ps), float("-inf"))


def top_p_weights(scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor | None:
    """CPU: ``exp_weights_`` of ``scaled`` after ``filter_top_p_``, bit for
    bit, written over ``scaled`` (returned): the exp is taken over the finite
    row and the weights outside the nucleus set to 0 after it, where the
    filtered row's ``-inf``s take torch's slow exp. The row's maximum is
    always in its nucleus, so the difference each weight is the exp of is
    the same. None, and ``scaled`` as it was, where a row's maximum is not
    finite (a NaN, an infinity)."""
    top = scaled.amax(dim=-1, keepdim=True)
    if not bool(top.isfinite().all()):
        return None
    outside = scaled < nucleus_smallest(scaled, top_ps, finite=True)
    return scaled.sub_(top).exp_().masked_fill_(outside, 0.0)


def nucleus_smallest(
    scaled: torch.Tensor, top_ps: torch.Tensor, finite: bool = False
) -> torch.Tensor:
    """Each row's smallest logit in its nucleus of mass ``top_ps`` (``[N,
    1]``; see the module docstring), -inf where p >= 1. ``finite``: the rows
    hold no NaN, so their candidates may come from the fused CPU kernels'
    selection."""
    ps = top_ps.to(scaled.dtype).unsqueeze(1)
    vocab = scaled.shape[1]
    tiers = [c for c in NUCLEUS_CANDIDATES if c < vocab]
    if scaled.device.type != "cpu" or not tiers:
        log_total = torch.logsumexp(scaled, dim=-1, keepdim=True)
        return _smallest_kept(scaled, log_total, ps).masked_fill_(ps >= 1, float("-inf"))
    smallest = torch.full_like(ps, float("-inf"))
    searched = (ps[:, 0] < 1).nonzero()[:, 0]  # the rows with a nucleus to find
    if not len(searched):
        return smallest
    every_row = len(searched) == len(ps)
    among = scaled if every_row else scaled.index_select(0, searched)
    among_ps = ps if every_row else ps.index_select(0, searched)
    log_total = torch.logsumexp(among, dim=-1, keepdim=True)
    rows = torch.arange(len(searched))  # of ``among``: those whose nucleus is still to find
    ends = torch.empty_like(log_total)
    for tier, candidates in enumerate(tiers):
        part = among if tier == 0 else among.index_select(0, rows)
        values = _largest(part, candidates) if finite else part.topk(candidates, dim=-1).values
        end, mass = _nucleus_end(values, log_total[rows], among_ps[rows])
        ends[rows] = end
        rows = rows[(mass[:, -1] < among_ps[rows, 0]).nonzero()[:, 0]]  # held less than p
        if not len(rows):
            break
    else:
        part = among.index_select(0, rows)
        ends[rows] = _smallest_kept(part, log_total[rows], among_ps[rows])
    return smallest.index_copy_(0, searched, ends)


def _smallest_kept(scaled: torch.Tensor, log_total: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """The nucleus' smallest logit of each row, its whole row sorted: ``[N, 1]``."""
    return _nucleus_end(scaled.sort(dim=-1, descending=True).values, log_total, ps)[0]


def _nucleus_end(
    values: torch.Tensor, log_total: torch.Tensor, ps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Of descending ``values`` (a row's largest logits, or all of them): the
    smallest in the nucleus (``[N, 1]``; the last value where they hold less
    than p) and the running sum of their probabilities."""
    mass = (values - log_total).exp_().cumsum(dim=-1)
    # The nucleus: every entry whose mass before it is below p (a prefix, as
    # the running sum never falls), the first included.
    kept = (mass[:, :-1] < ps).sum(dim=-1, keepdim=True)
    return values.gather(1, kept), mass


def top_k_weights(
    scaled: torch.Tensor, top_ks: torch.Tensor, max_top_k: int, top_ps: torch.Tensor | None
) -> torch.Tensor | None:
    """CPU: ``exp_weights_`` of ``scaled`` after ``filter_top_k_`` (and, with
    ``top_ps``, ``filter_top_p_``), bit for bit, from each row's ``max_top_k
    + 1`` largest logits, written over ``scaled`` (returned). None, and
    ``scaled`` as it was, where a row needs the whole-row path: top-k off
    on every row, a NaN or an infinite maximum among the candidates (or in
    a row without top-k, with top-p), or the k-th largest tied past them. A
    row with top-k off among rows with it keeps all: its weights are the
    exp of the whole row, elementwise as ``exp_weights_`` takes it, or with
    top-p ``top_p_weights``' of it.

    The same bits: the kept logits are exactly the candidates at or above
    the k-th (no tie past the last candidate), each weight is the same exp
    of the same difference from the row's maximum, every other weight 0.
    With top-p, the filtered row's log-sum-exp is torch's own sum of those
    weights over the whole row (``torch.logsumexp`` sums ``exp(x - max)``
    over the same shape), and the nucleus' running sum is the candidates'
    sequential cumsum, which the whole-row path computes over the same
    leading entries."""
    vocab = scaled.shape[1]
    off = top_ks == 0
    if bool(off.all()):
        return None
    width = min(max_top_k + 1, vocab)
    values, indices = scaled.topk(width, dim=-1)
    kth = values.gather(1, (top_ks.clamp_min(1) - 1).unsqueeze(1))
    top = values[:, :1]
    if bool(values.isnan().any()) or not bool(top.isfinite().all()):
        return None
    if width < vocab and bool(((values[:, -1:] == kth) & ~off.unsqueeze(1)).any()):
        return None  # the k-th largest may be tied past the candidates
    kept = (values >= kth) & ~off.unsqueeze(1)
    candidates = (values - top).exp_().masked_fill_(~kept, 0.0)
    # Rows without top-k: the exp of the whole row, as exp_weights_ takes it
    # (and with top-p, as top_p_weights does).
    whole = off.nonzero()[:, 0]
    unfiltered = scaled.index_select(0, whole)
    if top_ps is None or not len(whole):
        unfiltered = exp_weights_(unfiltered)
    elif (unfiltered := top_p_weights(unfiltered, top_ps[whole])) is None:
        return None
    # In place: a fresh vocabulary-wide tensor is paged in on every call
    # (7.9 ms of zeros at 64 rows, where zeroing the scaled rows takes ~1).
    weights = scaled.zero_().scatter_(1, indices, candidates).index_copy_(0, whole, unfiltered)
    if top_ps is None:
        return weights
    log_total = log_sum_exp_of_weights(weights, top)
    ps = top_ps.to(scaled.dtype).unsqueeze(1)
    smallest = _nucleus_end(values.masked_fill(~kept, float("-inf")), log_total, ps)[0]
    candidates.masked_fill_(values < smallest.masked_fill_(ps >= 1, float("-inf")), 0.0)
    return weights.scatter_(1, indices, candidates).index_copy_(0, whole, unfiltered)


def log_sum_exp_of_weights(weights: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp`` of the row whose ``exp(row - top)`` are ``weights``
    (``top`` finite, ``[N, 1]``), bit for bit: what it computes, over the same
    shape (a sum of the candidates alone rounds differently in ~1 row in 13)."""
    return weights.sum(dim=-1, keepdim=True).log_().add_(top)


def _largest(rows: torch.Tensor, k: int) -> torch.Tensor:
    """``rows.topk(k).values`` for rows without NaN: the fused CPU kernels'
    ``row_top_values`` where that library is loaded (2.7x faster at 1,024
    of 49,152 on a Zen 3 core: docs/kernels.md), else torch's."""
    native = fused_op("row_top_values")
    on_cpu = rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.is_contiguous()
    if native is not None and on_cpu:
        return native(rows, k)
    return rows.topk(k, dim=-1).values

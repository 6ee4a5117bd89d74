"""Top-k and top-p over a batch of scaled logits, in place: the filters the
sampler (``device_sampling.sample_tensors``, on any device; on the CPU
through ``sampling.sample``) applies before it picks.

Top-k keeps every logit at or above its row's k-th largest. Top-p keeps
every logit at or above the smallest of the nucleus: the shortest run of
the row's logits in descending order whose probabilities (softmax over the
row) sum to p, the first always in. On the CPU the nucleus is looked for
among the ``NUCLEUS_CANDIDATES`` largest first (``topk``), and a row is
sorted whole only when they hold less than p: the same threshold, as the
candidates are the sorted row's first entries and their running sum the
same sequential sum. A whole-vocabulary sort costs ~4.5 ms a row on a
Zen 3 core (49,152 tokens); the candidates ~0.5. Elsewhere the row is sorted:
a data-dependent choice would make the host wait for the device.
"""

from __future__ import annotations

import torch

NUCLEUS_CANDIDATES = 1024


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
    (see the module docstring). A row with p == 1 may lose a tail whose
    running sum rounds to 1."""
    ps = top_ps.to(scaled.dtype).unsqueeze(1)
    log_total = torch.logsumexp(scaled, dim=-1, keepdim=True)
    candidates = min(NUCLEUS_CANDIDATES, scaled.shape[1])
    if scaled.device.type != "cpu" or candidates == scaled.shape[1]:
        return scaled.masked_fill_(scaled < _smallest_kept(scaled, log_total, ps), float("-inf"))
    values = scaled.topk(candidates, dim=-1).values
    smallest, mass = _nucleus_end(values, log_total, ps)
    short = (mass[:, -1:] < ps).nonzero()[:, 0]  # rows whose candidates hold less than p
    if len(short):
        rows = scaled.index_select(0, short)
        smallest[short] = _smallest_kept(rows, log_total[short], ps[short])
    return scaled.masked_fill_(scaled < smallest, float("-inf"))


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

"""The sampler's primitives: the greedy argmax, the temperature division,
the unnormalised softmax, the seeded draw and the inverse-CDF pick.

A sampling row takes one uniform draw ``u`` in [0, 1) and the first token
whose cumulative probability (float64, vocabulary order) exceeds ``u`` times
the row's total: token i with probability ``p_i`` (inverse transform
sampling, ``pick_by_cdf``). A row with a seed draws ``u`` from
``(seed, output_index)`` alone (``seeded_uniform``), so it gets the same
draw whatever batch it lands in, and with the same logits the same token
(preemption and recompute reproduce it). One draw a row where the
exponential race (``argmax(p_i / E_i)``) drew a vocabulary's worth: on a
Zen 3 core that race cost ~1.2 ms a row and step for a 49,152-token
vocabulary, more than a decode step of the row itself.

The one sampler that runs them is ``device_sampling.sample_tensors``
(``sampling.sample`` plans a batch and runs it on the CPU); the top-k and
top-p filters between the division and the softmax are
``sampling_filters``'. Everything here but ``seeded_uniform`` (host
integers) runs the same torch ops on any device without a host read.
"""

from __future__ import annotations

from typing import Any

import torch

_MASK64 = (1 << 64) - 1
# Column chunks ``row_argmax`` and ``pick_by_cdf`` reduce first, the first that divides the row.
_ARGMAX_CHUNKS = (128, 64, 32)


def divide_rows(
    x: torch.Tensor, divisors: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [N, vocab] / divisors[:, None]``, into ``out`` (float32 ``[N,
    vocab]``) or a new tensor, the divisors expanded to x's shape first: the
    same quotients, and on the CPU torch's broadcast of a column divides ~7x
    slower than an expanded one (10.5 against 1.5 ms for 64 rows of a
    49,152-token vocabulary on a Zen 3 core)."""
    return torch.div(x, divisors.unsqueeze(1).expand_as(x), out=out)


def exp_weights_(scaled: torch.Tensor) -> torch.Tensor:
    """``exp(scaled - row max)`` in place: each row's softmax before its
    division by the row's sum, which ``pick_by_cdf`` does not need; a
    filtered ``-inf`` becomes 0. In place, as a vocabulary-wide temporary
    fresh each step is paged in each step once it passes glibc's mmap
    threshold (256 rows of 49,152 float32s do)."""
    return scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()


def pick_by_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: for each row of ``weights [N, vocab]`` (non-negative,
    any total above 0), the first token whose cumulative weight exceeds
    ``uniforms[i]`` (in [0, 1)) times the row's total, summed in float64 in
    vocabulary order: token j with probability ``weights[j] / total``. Where a
    chunk of ``_ARGMAX_CHUNKS`` divides the row, the sums go by chunk (the
    chunks' totals, then within the chunk the target falls in): a cumulative
    sum over a whole vocabulary runs in scalar code. A token of weight 0 is
    never picked: each target stays below the total it is looked up in, so
    the sum rises past it at a token that adds to it. A row with a NaN still
    gets a token of the vocabulary. The same ops on any device (no host
    reads)."""
    rows, cols = weights.shape
    chunk = next((c for c in _ARGMAX_CHUNKS if cols % c == 0 and cols >= 4 * c), 0)
    uniforms = uniforms.double().unsqueeze(1)
    if not chunk:
        cdf = weights.cumsum(dim=-1, dtype=torch.float64)
        picked = torch.searchsorted(cdf, _below_last(uniforms * cdf[:, -1:], cdf), right=True)
        return picked[:, 0].clamp_max_(cols - 1)
    chunks = weights.view(rows, cols // chunk, chunk)
    # The chunks' own sums in the weights' dtype (in float64 they would be
    # summed from a float64 copy of the whole row), accumulated in float64.
    chunk_cdf = chunks.sum(dim=-1).cumsum(dim=-1, dtype=torch.float64)
    targets = _below_last(uniforms * chunk_cdf[:, -1:], chunk_cdf)
    # [N, 1]; past the last chunk only for a NaN, kept in for the gathers
    picked = torch.searchsorted(chunk_cdf, targets, right=True).clamp_max_(cols // chunk - 1)
    before = chunk_cdf.gather(1, (picked - 1).clamp_min(0)).masked_fill(picked == 0, 0.0)
    within = chunks.gather(1, picked.unsqueeze(2).expand(rows, 1, chunk))[:, 0]
    within_cdf = within.cumsum(dim=-1, dtype=torch.float64)
    offset = torch.searchsorted(within_cdf, _below_last(targets - before, within_cdf), right=True)
    return (picked * chunk + offset)[:, 0].clamp_max_(cols - 1)


def _below_last(targets: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    """``targets`` (``[N, 1]``), each kept below the last entry of its ``cdf`` row."""
    total = cdf[:, -1:]
    return torch.minimum(targets, torch.nextafter(total, torch.zeros_like(total)))


def seeded_uniform(seed: int, output_index: int) -> float:
    """A seeded row's draw in [0, 1): the top 53 bits of SplitMix64 of
    ``(seed, output_index)``, the same on every device and in every batch."""
    return (_row_seed(seed, output_index) >> 11) * 2.0**-53


def seeded_draws(seeds: list[int], output_indices: list[int]) -> list[float]:
    """``seeded_uniform`` of each ``(seeds[i], output_indices[i])``: a step's
    seeded rows' draws, as the CPU sampler and the GPU staging both take them."""
    return [seeded_uniform(s, i) for s, i in zip(seeds, output_indices, strict=True)]


def _row_seed(seed: int, output_index: int) -> int:
    """SplitMix64 of (seed, output_index): distinct, well-mixed 64-bit words."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-d tensor: the same indices (the first
    maximum of each row; a NaN counts as the maximum, as there), on the CPU
    several times faster. torch's CPU argmax keeps an index per element in
    scalar code: 15.8 ms for 256 rows of a 49,152-token vocabulary on two
    Zen 3 cores, where a plain ``amax`` takes 2.5. Where the fused CPU
    kernels are loaded (a compiled engine) their ``row_argmax`` makes one
    pass of chunk maxima and reads one chunk again (1 thread: 4.4 -> 3.7 ms
    there, docs/kernels.md). Otherwise the vectorized ``amax`` finds the
    maximum of each chunk of columns in torch, the argmax runs over those
    maxima (the first chunk holding the row's maximum) and then within that
    chunk: 3.7 ms on two cores (bf16: 30.8 -> 6.3). Other devices, and rows
    no chunk divides, take torch's argmax."""
    rows, cols = x.shape
    on_cpu = x.device.type == "cpu" and x.is_contiguous()
    if on_cpu and cols and x.dtype in (torch.float32, torch.bfloat16):
        native = fused_op("row_argmax")
        if native is not None:
            return native(x)
    chunk = next((c for c in _ARGMAX_CHUNKS if cols % c == 0 and cols >= 4 * c), 0)
    if not chunk or not on_cpu:
        return x.argmax(dim=-1)
    best = x.view(rows, cols // chunk, chunk).amax(dim=-1).argmax(dim=-1)
    within = x.gather(1, best.unsqueeze(1) * chunk + torch.arange(chunk)).argmax(dim=-1)
    return best * chunk + within


def fused_op(name: str) -> Any:
    """``torch.ops.slipstream.<name>`` where the fused CPU kernels are loaded
    (a compiled engine), else None (the sampler never builds them)."""
    try:
        return getattr(torch.ops.slipstream, name)
    except AttributeError:
        return None

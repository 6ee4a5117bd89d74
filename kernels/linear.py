"""Dense projections, with weights optionally packed once for oneDNN.

``F.linear`` on the CPU re-lays out a bf16 weight into oneDNN's blocked format
on every call; packing it once at load time removes that from every step
(measured on an AVX-512/AMX CPU, 1 thread, the ``small`` model's shapes: batch
1 2.35 -> 1.82 ms, batch 64 18.6 -> 10.9 ms per layer's four projections).
bf16 packing needs AVX-512 or AVX-NE-CONVERT. fp32 weights gain too: oneDNN's
small-batch kernels beat MKL's (see ``cpu_features.py``). The caller decides,
from ``cpu_features.choose_dtype``, and asks only where the probe said yes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class WeightPackingFailed(ValueError):
    """oneDNN refused to pack a weight: the asked-for layout does not fit this
    CPU (it lacks the instructions oneDNN needs), a configuration error."""


class Linear:
    """``y = x @ weight.T + bias`` for 2-D ``x`` of shape ``[tokens, in_features]``.

    ``pack`` asks for the oneDNN-packed layout of a bf16 or fp32 CPU weight; it
    raises ``WeightPackingFailed`` where oneDNN cannot pack.
    """

    __slots__ = ("bias", "is_packed", "out_features", "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False
    ) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
        self.out_features = weight.shape[0]
        self.bias = bias
        self.is_packed = (
            pack and weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
        )
        self.weight = _packed(weight) if self.is_packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    except RuntimeError as exc:
        raise WeightPackingFailed(
            f"cannot pack {str(weight.dtype).removeprefix('torch.')} weights for oneDNN "
            f"on this CPU ({exc}); "
            "run with --dtype auto or --dtype float32"
        ) from None

"""Dense projections, with weights packed once at load time: for oneDNN, or
for the panel kernel (``csrc/linear_cpu.cpp``, float32 on AVX2 CPUs).

``F.linear`` on the CPU re-lays out a bf16 weight into oneDNN's blocked format
on every call; packing it once at load time removes that from every step
(measured on an AVX-512/AMX CPU, 1 thread, the ``small`` model's shapes: batch
1 2.35 -> 1.82 ms, batch 64 18.6 -> 10.9 ms per layer's four projections).
bf16 packing needs AVX-512 or AVX-NE-CONVERT. fp32 weights gain too: oneDNN's
small-batch kernels beat MKL's (see ``cpu_features.py``). The caller decides,
from ``cpu_features.choose_dtype``, and asks only where the probe said yes.

Panels (the compiled step's choice for float32 where the CPU has AVX2):
measured on the AMD EPYC (Zen 3, AVX2) with 2 threads over all 30 layers of
``smollm2`` (weights streamed from memory, as in a step): 1.55x oneDNN's
packed GEMM at 1 token, 1.6x at 4-8, 1.2-1.35x from 16 to 512 (``csrc/
linear_cpu.cpp`` says why). One layout serves every batch size, so the
weights are held once.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.kernels import extensions

SOURCE = Path(__file__).resolve().parent / "csrc" / "linear_cpu.cpp"
EXTENSION = extensions.Extension(
    name="linear_cpu",
    cflags=("-O3", "-fopenmp", "-Wno-psabi"),
    ldflags=("-fopenmp",),
    probe="linear_cpu_isa",
    what="float32 panel projection kernel",
    fallback="oneDNN's projections",
)
PANEL = 16  # output features per panel (csrc/linear_cpu.cpp)
NO_AVX2 = "the CPU has no AVX2"


def panels_available(home: Path | None = None) -> bool:
    """Builds or loads the panel kernel once per process; True only where it
    loaded *and* runs its AVX2 variant (the baseline one is a reference, not
    a speed-up). Never raises."""
    return extensions.attempt_once(EXTENSION, home or extensions.default_home(), SOURCE, _runs_avx2)


def _runs_avx2() -> bool | str:
    return torch.ops.slipstream.linear_cpu_isa() == "avx2" or NO_AVX2


def panels_failure() -> str | None:
    return extensions.failure(SOURCE)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 16), K, 16]``: panel ``p`` holds rows
    ``16p .. 16p + 15`` of the weight, k-major, zero past ``N``."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, k)
    padded[:n] = weight
    return padded.view(num_panels, PANEL, k).transpose(1, 2).contiguous()


class WeightPackingFailed(ValueError):
    """oneDNN refused to pack a weight: the asked-for layout does not fit this
    CPU (it lacks the instructions oneDNN needs), a configuration error."""


class Linear:
    """``y = x @ weight.T + bias`` for 2-D ``x`` of shape ``[tokens, in_features]``.

    ``pack`` asks for the oneDNN-packed layout of a bf16 or fp32 CPU weight; it
    raises ``WeightPackingFailed`` where oneDNN cannot pack. ``panels`` (which
    wins over ``pack``) asks for the panel kernel's layout, for a float32 CPU
    weight, once ``panels_available()`` said yes; other weights ignore it.
    """

    __slots__ = ("bias", "is_packed", "out_features", "uses_panels", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        pack: bool = False,
        panels: bool = False,
    ) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
        self.out_features = weight.shape[0]
        self.bias = bias
        on_cpu = weight.device.type == "cpu"
        self.uses_panels = panels and on_cpu and weight.dtype == torch.float32
        self.is_packed = (
            not self.uses_panels
            and pack
            and on_cpu
            and weight.dtype in (torch.bfloat16, torch.float32)
        )
        if self.uses_panels:
            self.weight = pack_panels(weight)
        else:
            self.weight = _packed(weight) if self.is_packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_panels:
            if x.stride(-1) != 1:
                x = x.contiguous()
            return torch.ops.slipstream.panel_linear(x, self.weight, self.bias, self.out_features)
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

"""Dense projections, with weights packed once at load time: for oneDNN, or
for the panel kernel (``csrc/linear_cpu.cpp``: float32 on AVX2 CPUs, bf16
calls of a few rows on AVX512-BF16 CPUs).

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

bf16 panels (the library's ``avx512`` variant: AVX512-BF16 dot products)
serve calls of at most ``max_bf16_panel_rows()`` rows; larger calls stay on
oneDNN, so a bf16 weight with panels is held twice (panels and oneDNN's
layout). Measured on an AMD EPYC (Zen 5, avx512_bf16, no AMX), 2 threads,
``smollm2``'s projections over its 30 layers and its LM head (``python -m
slipstream.kernels.bench_linear``): the panels take 0.80-0.94 of oneDNN's
time from 1 to 128 rows, about the same at 192-256, 1.02-1.05x at 512
(docs/kernels.md). Where the CPU has AMX-BF16, oneDNN's tiles do the
arithmetic of the larger calls, and the panels keep the calls of up to 4
rows (measured on a Xeon, 2 threads: oneDNN at 1.55-1.98x the panels' time
at 1-4 rows, 0.93x at 8, 0.21-0.23x at 64-128).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.kernels import cpu_features, extensions
from slipstream.kernels.cpu_features import CpuFeatures

SOURCE = Path(__file__).resolve().parent / "csrc" / "linear_cpu.cpp"
EXTENSION = extensions.Extension(
    name="linear_cpu",
    cflags=("-O3", "-fopenmp", "-Wno-psabi"),
    ldflags=("-fopenmp",),
    probe="linear_cpu_isa",
    what="panel projection kernel",
    fallback="oneDNN's projections",
    set_max_isa="linear_set_max_isa",
)
PANEL = 16  # output features per panel (csrc/linear_cpu.cpp)
# bf16 calls of up to this many rows take the panels, larger ones oneDNN
# (docs/kernels.md: the crossover on an AMD EPYC Zen 5); with AMX, up to 4.
MAX_BF16_PANEL_ROWS = 128
MAX_BF16_PANEL_ROWS_AMX = 4
# Columns a row that Linear._near_max looks among first for sums near its maximum.
NEAR_MAX_SCAN = 8
NO_AVX2 = "the CPU has no AVX2"


def panels_available(home: Path | None = None) -> bool:
    """Builds or loads the panel kernel once per process; True only where it
    loaded *and* runs its AVX2 variant (the baseline one is a reference, not
    a speed-up). Never raises."""
    return extensions.attempt_once(EXTENSION, home or extensions.default_home(), SOURCE, _runs_avx2)


def _runs_avx2() -> bool | str:
    return torch.ops.slipstream.linear_cpu_isa() in ("avx2", "avx512") or NO_AVX2


def bf16_panels_available(home: Path | None = None) -> bool:
    """True where the panel kernel loaded and runs its ``avx512`` variant
    (AVX512-BF16, as capped by ``cpu_features.detect()``)."""
    return panels_available(home) and torch.ops.slipstream.linear_cpu_isa() == "avx512"


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


def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` (K even) -> ``[ceil(N / 16), K / 2, 16, 2]``: panel ``p``
    holds rows ``16p .. 16p + 15``, k in pairs, so that one 64-byte row
    ``[p, i]`` is ``W[16p + j, 2i + t]`` for j < 16, t < 2; zero past ``N``."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"bf16 panels need an even number of input features, got {k}")
    num_panels = -(-n // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, k)
    padded[:n] = weight
    return padded.view(num_panels, PANEL, k // 2, 2).transpose(1, 2).contiguous()


def max_bf16_panel_rows(cpu: CpuFeatures | None = None) -> int:
    """The most rows a bf16 call sends to the panels on ``cpu`` (default: the
    answer ``cpu_features.detect()`` gives): fewer where AMX-BF16 does
    oneDNN's arithmetic."""
    flags = (cpu or cpu_features.detect()).flags
    return MAX_BF16_PANEL_ROWS_AMX if "amx_bf16" in flags else MAX_BF16_PANEL_ROWS


class WeightPackingFailed(ValueError):
    """oneDNN refused to pack a weight: the asked-for layout does not fit this
    CPU (it lacks the instructions oneDNN needs), a configuration error."""


class Linear:
    """``y = x @ weight.T + bias`` for 2-D ``x`` of shape ``[tokens, in_features]``.

    ``pack`` asks for the oneDNN-packed layout of a bf16 or fp32 CPU weight; it
    raises ``WeightPackingFailed`` where oneDNN cannot pack. ``panels`` asks
    for the panel kernel's layout, once ``panels_available()`` said yes: a
    float32 CPU weight takes panels for every call (and wins over ``pack``);
    a bf16 one with an even in_features, where ``bf16_panels_available()``,
    takes them for calls of up to ``max_panel_rows`` rows and keeps the
    oneDNN (or plain) weight for the rest, or, with ``float_out``, for every
    call, which may then write float32 sums (a bf16 model's logits; no oneDNN
    copy is kept), and pick each row's greatest output (``argmax``: a bf16
    model's greedy tokens). Other weights ignore it. Where AMX does oneDNN's
    arithmetic a ``float_out`` weight keeps the cut: its larger calls return
    oneDNN's sums widened to float32, those near each row's maximum re-scored
    in float32 (``_near_max``), and so does any ``float_out`` bf16 CPU weight
    off the panels.

    ``float_out`` on a GPU: a bf16 or fp16 weight's calls write float32 sums
    (cuBLAS's ``mm`` with ``out_dtype``, where torch has it), so a 16-bit
    model's logits are not rounded before the sampler sees them.
    """

    __slots__ = (
        "bias",
        "float_mm",
        "has_argmax",
        "is_packed",
        "max_panel_rows",
        "out_features",
        "panels",
        "plain",
        "uses_panels",
        "weight",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        pack: bool = False,
        panels: bool = False,
        float_out: bool = False,
    ) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
        self.out_features = weight.shape[0]
        self.bias = bias
        on_cpu = weight.device.type == "cpu"
        fp32_panels = panels and on_cpu and weight.dtype == torch.float32
        bf16_panels = (
            panels
            and on_cpu
            and weight.dtype == torch.bfloat16
            and weight.shape[1] % 2 == 0
            and bf16_panels_available()
        )
        self.uses_panels = fp32_panels or bf16_panels
        self.max_panel_rows = 0
        self.panels: torch.Tensor | None = None
        if fp32_panels:
            self.panels = pack_panels(weight)
            self.max_panel_rows = sys.maxsize
        elif bf16_panels:
            self.panels = pack_bf16_panels(weight)
            cut = max_bf16_panel_rows()
            # float32 sums on the panels at every row count, except where AMX
            # does oneDNN's arithmetic (4x the panels' speed at 64 rows on a
            # Xeon): there the larger calls stay on oneDNN and are re-scored
            every_row = float_out and cut >= MAX_BF16_PANEL_ROWS
            self.max_panel_rows = sys.maxsize if every_row else cut
        every_call = fp32_panels or (bf16_panels and self.max_panel_rows == sys.maxsize)
        self.has_argmax = bf16_panels and float_out
        # A float_out bf16 CPU weight whose calls (some or all) leave the
        # panels: their bf16 sums are widened and the columns near each row's
        # maximum re-scored in float32 from the plain weight (``_rescored``).
        self.plain = (
            weight
            if float_out and on_cpu and weight.dtype == torch.bfloat16 and not every_call
            else None
        )
        self.float_mm = (
            float_out
            and not on_cpu
            and weight.dtype in (torch.bfloat16, torch.float16)
            and mm_writes_float32(weight.device)
        )
        self.is_packed = (
            not every_call and pack and on_cpu and weight.dtype in (torch.bfloat16, torch.float32)
        )
        # A weight whose panels serve every call is held as its panels alone.
        self.weight = self.panels if every_call else _packed(weight) if self.is_packed else weight

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: a contiguous float32 ``[tokens, out_features]`` buffer
        the caller keeps, which a call on panels writes and returns instead
        of a fresh tensor (a large one is mapped and faulted in on every
        call): a float32 call's result, or a bf16 call's sums unrounded, or
        a ``float_out`` call's re-scored sums off the panels. The other paths
        leave it untouched."""
        # ``panels is not None`` first: with no panels max_panel_rows is 0, and
        # a step that samples nothing (a prefill chunk) calls with 0 rows.
        if self.panels is not None and x.shape[0] <= self.max_panel_rows:
            if x.stride(-1) != 1:
                x = x.contiguous()
            ops, fp32 = torch.ops.slipstream, x.dtype == torch.float32
            if out is not None:
                into = ops.panel_linear_out if fp32 else ops.panel_linear_bf16_out
                into(x, self.panels, self.bias, out)
                return out
            op = ops.panel_linear if fp32 else ops.panel_linear_bf16
            return op(x, self.panels, self.bias, self.out_features)
        if self.float_mm:
            y = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
            return y if self.bias is None else y.add_(self.bias)
        y = self._off_panels(x)
        return y if self.plain is None else self._rescored(x, y, out)

    def _off_panels(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)

    def _near_max(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows, columns and float32 sums of every bf16 sum in ``y`` near its
        row's maximum, the only columns that can hold the float32 maximum.

        A bf16 sum is its float32 value rounded to 8 significant bits, within
        2**-8 of its size; a column more than 2**-7 of the row's rounded
        maximum below it cannot be the greatest float32 sum. The cut is set
        at 2**-6 (rounded to bf16, within 2**-9 of it): one or two columns a
        row, found among each row's 8 greatest (a row whose eighth is still
        near is scanned whole). 256 rows of SmolLM2's vocabulary on a Zen 5,
        2 threads: 4 ms for the 8 greatest, where a whole-row compare and
        ``nonzero`` took 9."""
        k = min(NEAR_MAX_SCAN, y.shape[-1])
        values, columns = y.topk(k, dim=-1)
        top = values[:, :1].float()
        cut = (top - top.abs() * 2**-6).to(y.dtype)
        near = values >= cut
        rows, nth = near.nonzero(as_tuple=True)
        cols = columns[rows, nth]
        whole = near[:, -1] if k < y.shape[-1] else near[:, :0].any(dim=-1)
        if bool(whole.any()):
            keep = ~whole[rows]
            scanned = whole.nonzero().squeeze(1)
            more_rows, more_cols = (y[scanned] >= cut[scanned]).nonzero(as_tuple=True)
            rows = torch.cat((rows[keep], scanned[more_rows]))
            cols = torch.cat((cols[keep], more_cols))
        plain = self.plain
        assert plain is not None
        sums = torch.einsum("ck,ck->c", x[rows].float(), plain[cols].float())
        if self.bias is not None:
            sums += self.bias[cols].float()
        return rows, cols, sums

    def _rescored(self, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """oneDNN's bf16 sums ``y`` widened (into ``out`` where given), the
        columns near each row's maximum re-scored in float32: the greatest of
        them is the float32 maximum, as the panels would write it, where two
        sums 1/8 apart near 20 would otherwise tie (docs/kernels.md)."""
        rows, cols, sums = self._near_max(x, y)
        wide = y.float() if out is None else out.copy_(y)
        wide[rows, cols] = sums
        return wide

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """int64 ``[tokens]``: the column of each row's greatest output (the
        first of equals), from the float32 sums, none of them stored (a
        greedy step's LM head without its logits: 256 rows of SmolLM2's
        49,152, 17.4 -> 14.5 ms with the argmax on a Zen 5, docs/kernels.md).
        Only where ``has_argmax``."""
        if not self.has_argmax:
            raise ValueError("argmax needs a bf16 weight on panels with float_out")
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.shape[0] > self.max_panel_rows:
            return self._rescored_argmax(x)
        return torch.ops.slipstream.panel_linear_bf16_argmax(
            x, self.panels, self.bias, self.out_features
        )

    def _rescored_argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``argmax`` off the panels: oneDNN's bf16 sums, then the float32
        maximum among each row's near-maximum columns (the first of equals),
        with no ``[rows, out_features]`` float32 logits written."""
        y = self._off_panels(x)
        rows, cols, sums = self._near_max(x, y)
        n = x.shape[0]
        best = torch.full((n,), -torch.inf).scatter_reduce_(0, rows, sums, "amax")
        at_best = sums == best[rows]
        first = torch.full((n,), self.out_features, dtype=torch.int64)
        first.scatter_reduce_(0, rows[at_best], cols[at_best], "amin")
        missing = first == self.out_features  # a row with a NaN has no column near its maximum
        if bool(missing.any()):
            first[missing] = y[missing].argmax(dim=-1)
        return first


_MM_WRITES_FLOAT32: dict[str, bool] = {}


def mm_writes_float32(device: torch.device) -> bool:
    """Whether torch multiplies 16-bit matrices into float32 on ``device``'s
    kind (``torch.mm(..., out_dtype=torch.float32)``: CUDA in recent torch,
    not the CPU), asked once per kind with two 2x2 bf16 matrices."""
    kind = device.type
    if kind not in _MM_WRITES_FLOAT32:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        try:
            ok = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _MM_WRITES_FLOAT32[kind] = ok
    return _MM_WRITES_FLOAT32[kind]


def _packed(weight: torch.Tensor) -> torch.Tensor:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    except RuntimeError as exc:
        raise WeightPackingFailed(
            f"cannot pack {str(weight.dtype).removeprefix('torch.')} weights for oneDNN "
            f"on this CPU ({exc}); "
            "run with --dtype auto or --dtype float32"
        ) from None

"""Fused elementwise kernels for the work between a layer's matrix
multiplications (``csrc/fused_ops_cpu.cpp``): residual add + RMSNorm, SiLU
and multiply, RoPE in place. Built and cached like the attention kernel
(``extensions``); ``is_available()`` never raises, and the model keeps its
eager torch ops when the build fails.

Each op matches its eager torch composition up to the last bit of fp32
(the sum of squares and exp round differently); the parity tests hold them
to it. ``decoder_layers_`` runs a model's whole layer loop (these ops, the
projections and the attention kernel) in one call. ``row_argmax``
(``torch.ops.slipstream.row_argmax``) and ``row_top_values`` are the
sampler's, used by ``sampling.row_argmax`` and by top-p's candidates
(``sampling_filters``) wherever this library is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from slipstream.kernels import extensions
from slipstream.kernels.attention import AttentionMetadata

SOURCE = Path(__file__).resolve().parent / "csrc" / "fused_ops_cpu.cpp"
# -fno-math-errno lets the vector expf of libmvec replace expf; -ffp-contract=off
# keeps every product and sum rounded as eager torch rounds it.
EXTENSION = extensions.Extension(
    name="fused_ops_cpu",
    cflags=("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wno-psabi"),
    ldflags=("-fopenmp", "-lmvec"),
    probe="fused_ops_cpu_isa",
    what="fused CPU elementwise kernels",
    fallback="eager torch ops",
    set_max_isa="fused_ops_set_max_isa",
)

_fakes_registered = False


def is_available(home: Path | None = None) -> bool:
    """Builds or loads the library once per process; True if it loaded."""
    return extensions.attempt_once(
        EXTENSION, home or extensions.default_home(), SOURCE, _register_fakes
    )


def failure() -> str | None:
    return extensions.failure(SOURCE)


def add_rms_norm_(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += delta`` in place; returns ``rms_norm(x) * weight``."""
    return torch.ops.slipstream.add_rms_norm_(x, delta, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.slipstream.rms_norm(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up [T, 2I]``."""
    return torch.ops.slipstream.silu_and_mul(gate_up)


def rotary_neox_(
    qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """RoPE in place on ``qk [T, heads, head_dim]`` (heads packed, any token
    stride): ``x * cos + roll(x, D/2) * signed_sin`` at each token's position."""
    torch.ops.slipstream.rotary_neox_(qk, cos, signed_sin, positions)


def decoder_weights(layers: Sequence[Any]) -> tuple[list[Any], ...]:
    """What ``decoder_layers_`` takes of a model's layers (each with ``qkv``,
    ``o_proj``, ``gate_up``, ``down`` projections and ``input_norm``,
    ``post_norm`` weights): per projection its weight, panels, bias and
    (packed, out_features, max_panel_rows) as ``linear.Linear`` holds them."""
    weights: list[torch.Tensor] = []
    panels: list[torch.Tensor | None] = []
    biases: list[torch.Tensor | None] = []
    info: list[int] = []
    norms: list[torch.Tensor] = []
    for layer in layers:
        for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            weights.append(proj.weight)
            panels.append(proj.panels)
            biases.append(proj.bias)
            info += [int(proj.is_packed), proj.out_features, proj.max_panel_rows]
        norms += [layer.input_norm, layer.post_norm]
    return weights, panels, biases, info, norms


def decoder_layers_(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    panels: list[torch.Tensor | None],
    biases: list[torch.Tensor | None],
    info: list[int],
    norms: list[torch.Tensor],
    k_storages: list[torch.Tensor],
    v_storages: list[torch.Tensor],
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    heads: tuple[int, int, int],
    scale: float,
    eps: float,
    part_ns: torch.Tensor | None = None,
) -> None:
    """Every decoder layer over the residual stream ``x`` in place, in one
    call: for each layer, input RMSNorm (the previous layer's residual add
    folded in), qkv projection, RoPE, KV write, paged attention, o projection,
    add + RMSNorm, gate_up, SiLU·mul, down — the fused forward's Python loop,
    op for op. ``heads`` is (num_heads, num_kv_heads, head_dim); the weights
    come from ``decoder_weights``, the storages are head-major (kv_layout).
    The projections, KV write and attention are the panel, oneDNN and fused
    attention kernels, which must be loaded. ``part_ns``, an int64 [2]
    tensor, gets the nanoseconds spent in attention and in the projections
    added to it."""
    num_heads, num_kv_heads, head_dim = heads
    torch.ops.slipstream.decoder_layers_(
        x, weights, panels, biases, info, norms, k_storages, v_storages, cos, signed_sin,
        positions, meta.block_tables, meta.seq_lens_t, meta.query_start_loc, meta.slot_mapping,
        num_heads, num_kv_heads, head_dim, scale, eps, part_ns,
    )  # fmt: skip


def _register_fakes() -> bool:
    """Shapes for tracing, so a model calling these compiles under torch.compile."""
    global _fakes_registered
    if _fakes_registered:
        return True
    torch.library.register_fake(
        "slipstream::add_rms_norm_", lambda x, d, w, eps: x.new_empty(x.shape)
    )
    torch.library.register_fake("slipstream::rms_norm", lambda x, w, eps: x.new_empty(x.shape))
    torch.library.register_fake(
        "slipstream::silu_and_mul", lambda gu: gu.new_empty(gu.shape[0], gu.shape[1] // 2)
    )
    torch.library.register_fake("slipstream::rotary_neox_", lambda qk, c, s, p: None)
    torch.library.register_fake("slipstream::decoder_layers_", lambda *args: None)
    _fakes_registered = True
    return True

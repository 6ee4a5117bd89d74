"""Triton kernels for the elementwise work between a GPU step's projections,
one launch per stage where eager torch takes several: RMSNorm with the
residual add folded in, RoPE in place on the projection's output, SiLU and
multiply. The same contract as the CPU's ``fused_ops`` (whose torch
references the tests compare against):

    add_rms_norm_(x, delta, w, eps)   x += delta (in x's dtype); returns rms_norm(x) * w
    rms_norm(x, w, eps)               rms_norm(x) * w
    silu_and_mul(gate_up)             silu(gate_up[:, :I]) * gate_up[:, I:]
    rotary_neox_(qk, cos, ssin, pos)  qk = qk * cos[pos] + roll(qk, D/2) * ssin[pos], in place

A GPU step is launch-bound (a SmolLM2 step that is not a graphed decode
took ~10 ms on an H100 whatever its size) and a graphed one kernel-count
bound: per layer these take the eager elementwise work from ~11 kernels
(norms, RoPE's four products and sums, SiLU, the multiply, two adds) to 4.
Norms and products accumulate in float32 and store in the tensors' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.backend import check_launchable


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_d,
    stride_o,
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        # Rounded to the stream's dtype, as the eager add stores it, before the norm reads it.
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _silu_and_mul_kernel(
    gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_neox_kernel(
    qk_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_t,
    stride_h,
    stride_table,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HEAD_DIM)
    rolled = (dims + HEAD_DIM // 2) % HEAD_DIM
    base = qk_ptr + t * stride_t + heads * stride_h
    x = tl.load(base + dims, mask=mask, other=0.0).to(tl.float32)
    x_rolled = tl.load(base + rolled, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + pos * stride_table + dims, mask=dims < HEAD_DIM, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + dims, mask=dims < HEAD_DIM, other=0.0)
    out = x * cos.to(tl.float32) + x_rolled * sin.to(tl.float32)
    tl.store(base + dims, out.to(qk_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected [rows, n] with unit column stride, got {tuple(x.shape)}")
    return x


def _norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    _rows(x)
    check_launchable(_rms_norm_kernel, x, weight)
    n = x.shape[1]
    if weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{n}], got {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    d = x if delta is None else _rows(delta)
    if d.shape != x.shape:
        raise ValueError(f"delta {tuple(d.shape)} does not match x {tuple(x.shape)}")
    _rms_norm_kernel[(x.shape[0],)](
        x, d, weight, out, x.stride(0), d.stride(0), out.stride(0), n, eps,
        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out


def add_rms_norm_(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += delta`` in place; returns ``rms_norm(x) * weight``."""
    return _norm(x, delta, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up [T, 2I]``."""
    _rows(gate_up)
    check_launchable(_silu_and_mul_kernel, gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block)
    return out


def rotary_neox_(
    qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """RoPE in place on ``qk [T, heads, head_dim]`` (heads packed, any token
    stride): ``x * cos + roll(x, D/2) * signed_sin`` at each token's position;
    ``cos`` and ``signed_sin`` are ``[max_positions, head_dim]`` tables."""
    if qk.dim() != 3 or qk.stride(2) != 1:
        raise ValueError(f"qk must be [T, heads, head_dim] with unit dim stride, got {qk.shape}")
    check_launchable(_rotary_neox_kernel, qk, cos, signed_sin, positions)
    num_tokens, num_heads, head_dim = qk.shape
    tables = cos.shape == signed_sin.shape and cos.shape[1:] == (head_dim,)
    if not (tables and cos.is_contiguous() and signed_sin.is_contiguous()):
        raise ValueError("cos and signed_sin must be contiguous [max_positions, head_dim] tables")
    if num_tokens == 0:
        return
    _rotary_neox_kernel[(num_tokens,)](
        qk, cos, signed_sin, positions, qk.stride(0), qk.stride(1), cos.stride(0), num_heads,
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip

"""The GPU step's fused elementwise stages (under the interpreter) against
the eager torch ops the model's reference forward makes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_modules import interpreted

pytestmark = pytest.mark.triton

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.fixture(scope="module")
def ops():
    return interpreted("triton_elementwise")


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 576, 100])  # SmolLM2's hidden size, and one not a power of two
def test_add_rms_norm_adds_in_place_and_normalizes(ops, dtype, n):
    x, delta = _randn(7, n, dtype=dtype, seed=0), _randn(7, n, dtype=dtype, seed=1)
    weight = _randn(n, dtype=dtype, seed=2)
    want_x = x + delta  # the eager add, in x's dtype
    want = F.rms_norm(want_x.float(), (n,), weight.float(), 1e-5).to(dtype)
    got = ops.add_rms_norm_(x, delta, weight, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(x, want_x)
    else:  # the interpreter rounds float32 to bfloat16 toward zero, a GPU to nearest
        torch.testing.assert_close(x, want_x, atol=0, rtol=2**-7)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), want, **TOLERANCE[dtype])


def test_rms_norm_reads_rows_through_their_stride(ops):
    """The final norm takes the sampled rows; any row stride is read as such."""
    wide = _randn(5, 96, dtype=torch.float32, seed=3)
    x = wide[:, :64]
    weight = _randn(64, dtype=torch.float32, seed=4)
    want = F.rms_norm(x, (64,), weight, 1e-6)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), want, **TOLERANCE[torch.float32])
    assert ops.rms_norm(x[:0], weight, 1e-6).shape == (0, 64)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, weight[:32], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 100])
def test_silu_and_mul(ops, dtype, inter):
    gate_up = _randn(6, 2 * inter, dtype=dtype, seed=5)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).to(dtype)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 64), (5, 80)])
def test_rotary_in_place_on_the_projections_view(ops, dtype, heads, head_dim):
    """RoPE on q and k as the model takes them: a view of the qkv
    projection's rows (token stride wider than the heads), in place, at each
    token's own position; v's columns beside them untouched."""
    tokens, max_pos = 9, 40
    qkv = _randn(tokens, (heads + 3) * head_dim, dtype=dtype, seed=6)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    v_before = qkv[:, heads * head_dim :].clone()
    angles = _randn(max_pos, head_dim, dtype=torch.float32, seed=7)
    cos, signed_sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.tensor([0, 3, 39, 1, 1, 7, 20, 2, 5])
    c, s = cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1)
    x = qk.float()
    want = (x * c.float() + x.roll(head_dim // 2, dims=-1) * s.float()).to(dtype)
    ops.rotary_neox_(qk, cos, signed_sin, positions)
    torch.testing.assert_close(qk, want, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, heads * head_dim :], v_before)

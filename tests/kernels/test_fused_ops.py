"""The fused elementwise kernels (``slipstream.kernels.fused_ops``) against the
eager torch ops they replace: fp32 to the last bits, bf16 to one rounding.

Built once into ``$SLIPSTREAM_HOME/cache/extensions`` (the test home); a
machine without a C++ compiler skips, any other build failure fails.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels import extensions, fused_ops

# fp32: the sum of squares and exp round differently from torch's; bf16: one
# rounding at the end where eager torch rounds after every op.
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 64, 257]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the fused kernels cannot be built here")
    if not fused_ops.is_available(Path(os.environ["SLIPSTREAM_HOME"])):
        pytest.fail(f"the fused kernels did not build: {fused_ops.failure()}")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_adds_in_place_and_normalizes(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    want_x = x + delta
    want = F.rms_norm(want_x, (576,), weight, 1e-5)
    got = fused_ops.add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(x, want_x)  # the residual add rounds as eager's does
    _close(got, want)
    _close(fused_ops.rms_norm(want_x, weight, 1e-5), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_eager(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(fused_ops.silu_and_mul(gate_up), F.silu(gate) * up)
    # Rows read through a stride (a slice of a wider output).
    wide = torch.randn(rows, 2 * 1536 + 64, generator=g).to(dtype)
    part = wide[:, : 2 * 1536]
    gate, up = part.chunk(2, dim=-1)
    _close(fused_ops.silu_and_mul(part), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 64), (3, 128), (1, 2)])
def test_rotary_matches_eager_on_a_strided_view(
    dtype: torch.dtype, heads: int, head_dim: int
) -> None:
    g = torch.Generator().manual_seed(heads)
    tokens, positions_in_table = 37, 500
    qkv = torch.randn(tokens, heads * head_dim + 3 * head_dim, generator=g).to(dtype)
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # token stride > heads * dim
    cos = torch.randn(positions_in_table, head_dim, generator=g).to(dtype)
    signed_sin = torch.randn(positions_in_table, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, positions_in_table, (tokens,), generator=g)
    untouched = qkv[:, heads * head_dim :].clone()
    c, s = cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1)
    want = qk * c + qk.roll(head_dim // 2, dims=-1) * s
    fused_ops.rotary_neox_(qk, cos, signed_sin, positions)
    if dtype == torch.float32:
        assert torch.equal(qk, want)  # two products and a sum, rounded as eager rounds them
    _close(qk, want)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 255, 256, 257, 1000, 49152])
def test_row_argmax_is_torchs_argmax(dtype: torch.dtype, cols: int) -> None:
    """The first maximum of each row, across its chunks of 256 and within one;
    the first NaN where a row has one; the first column of a row of -inf;
    -0.0 and 0.0 as equal."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(10, cols, generator=g)
    top = x.max() + 1
    x[0, cols // 2], x[0, cols - 1] = top, top
    x[1, 3 % cols], x[1, 5 % cols] = top, top
    x[2] = float("-inf")
    x[3, cols // 3], x[3, cols - 1] = float("nan"), float("nan")
    x[4] = 0.0
    x[4, cols // 2 :] = -0.0
    x[5, cols - 1] = float("inf")
    x[6] = torch.round(x[6])  # ties of whole numbers
    y = x.to(dtype)
    assert torch.equal(torch.ops.slipstream.row_argmax(y), y.argmax(dim=-1))


@pytest.mark.parametrize(
    ("cols", "k"),
    [(7, 7), (50, 1), (1000, 50), (49_152, 1024), (49_152, 8192), (49_152, 49_152)],
)
def test_row_top_values_are_torchs_topk_values(cols: int, k: int) -> None:
    """Descending, ties kept, across the buckets' edges: whole numbers,
    -inf and +inf among them, peaked and flat rows."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(9, cols, generator=g) * torch.tensor([0.3, 3.0, 30.0]).repeat(3).unsqueeze(1)
    x[3:6] = torch.round(x[3:6])  # ties of whole numbers
    x[6, ::3] = float("-inf")
    x[7, cols // 2] = float("inf")
    x[8] = -x[8].abs()  # every value negative
    assert torch.equal(torch.ops.slipstream.row_top_values(x, k), x.topk(k, dim=-1).values)


def test_bad_arguments_are_errors_not_crashes() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="delta must match"):
        fused_ops.add_rms_norm_(x, torch.randn(4, 9), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused_ops.silu_and_mul(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="k must be in"):
        torch.ops.slipstream.row_top_values(x, 9)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.slipstream.row_top_values(x.t(), 2)
    with pytest.raises(RuntimeError, match="outside the rope table"):
        fused_ops.rotary_neox_(
            torch.randn(2, 1, 4), torch.randn(3, 4), torch.randn(3, 4), torch.tensor([0, 3])
        )
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.slipstream.row_argmax(torch.randn(4, 8).t())


def test_a_failed_build_logs_one_line_and_reports_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "fused_ops_cpu.cpp"
    broken.write_text("#error this source does not compile\n")
    with caplog.at_level(logging.INFO, logger="slipstream.kernels"):
        outcome = extensions.attempt(fused_ops.EXTENSION, tmp_path, broken)
    assert isinstance(outcome, str) and "does not compile" in outcome
    ours = [r for r in caplog.records if r.name.startswith("slipstream")]
    assert len(ours) == 1 and "eager torch ops" in ours[0].getMessage()

"""The float32 panel projection (``kernels/linear.py``, ``csrc/linear_cpu.cpp``)
against a float64 reference: every row-tile remainder (1..6 rows), widths
that are not a multiple of the 16-feature panel, bias or none, strided rows,
and both thread counts.

Built once into ``$SLIPSTREAM_HOME/cache/extensions`` (the test home); a
machine without a C++ compiler or without AVX2 skips.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels import linear
from slipstream.kernels.linear import Linear, pack_panels


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the panel kernel cannot be built here")
    if not linear.panels_available(Path(os.environ["SLIPSTREAM_HOME"])):
        if linear.panels_failure() == linear.NO_AVX2:
            pytest.skip("the panel kernel runs only on AVX2 CPUs")
        pytest.fail(f"the panel kernel did not build: {linear.panels_failure()}")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


def test_packing_lays_out_panels_k_major_and_zero_pads() -> None:
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = pack_panels(w)
    assert panels.shape == (2, 3, 16) and panels.is_contiguous()
    assert torch.equal(panels[0, :, 5], w[5])
    assert torch.equal(panels[1, :, 3], w[19])
    assert not panels[1, :, 4:].any()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 64, 131])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 8), (37, 50), (960, 576)])
def test_matches_float64(rows: int, out_features: int, in_features: int, threads: int) -> None:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    for bias in (None, b):
        got = Linear(w, bias, panels=True)(x)
        assert got.shape == (rows, out_features)
        # fp32 FMA sums over K terms: error ~ sqrt(K) * eps * |terms|.
        torch.testing.assert_close(got, _reference(x, w, bias), rtol=1e-5, atol=1e-4)


def test_strided_rows_and_a_non_contiguous_view() -> None:
    w = torch.randn(48, 64)
    wide = torch.randn(9, 100)
    x = wide[:, 10:74]  # rows 100 apart: a stride the kernel reads in place
    torch.testing.assert_close(
        Linear(w, panels=True)(x), _reference(x, w, None), rtol=1e-5, atol=1e-4
    )
    xt = torch.randn(64, 9).t()  # columns apart: copied first
    torch.testing.assert_close(
        Linear(w, panels=True)(xt), _reference(xt, w, None), rtol=1e-5, atol=1e-4
    )


def test_only_float32_cpu_weights_use_panels() -> None:
    assert Linear(torch.randn(4, 4), panels=True).uses_panels
    bf16 = Linear(torch.randn(4, 4, dtype=torch.bfloat16), panels=True)
    assert not bf16.uses_panels and bf16.weight.shape == (4, 4)


def test_bad_arguments_are_errors_not_crashes() -> None:
    panels = pack_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.slipstream.panel_linear(torch.ones(2, 8, dtype=torch.bfloat16), panels, None, 20)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.slipstream.panel_linear(torch.ones(2, 9), panels, None, 20)
    with pytest.raises(RuntimeError, match="number of panels"):
        torch.ops.slipstream.panel_linear(torch.ones(2, 8), panels, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.slipstream.panel_linear(torch.ones(2, 8), panels, torch.ones(3), 20)

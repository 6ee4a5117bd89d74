"""The panel projections (``kernels/linear.py``, ``csrc/linear_cpu.cpp``)
against a float64 reference: float32 at every row-tile remainder (1..6
rows), bf16 (AVX512-BF16) at every row count of its 8-row tiles and a panel
left unpaired, widths that are not a multiple of the 16-feature panel, bias
or none, strided rows, and both thread counts; which calls take the bf16
panels (rows, the variant as capped by a forced CPU answer), and their float32
sums for a bf16 model's logits or its greedy tokens (each row's argmax).

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

from slipstream.kernels import extensions, linear
from slipstream.kernels.cpu_features import CpuFeatures, detect
from slipstream.kernels.linear import Linear, pack_bf16_panels, pack_panels


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
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 64, 128, 131])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(16, 8), (37, 50), (48, 300), (960, 576)]
)
def test_matches_float64(rows: int, out_features: int, in_features: int, threads: int) -> None:
    """2-128 rows walk k in blocks of 64 (300: the last one partial), the
    sums carried from block to block; 1 row and 131 walk it whole."""
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


@pytest.mark.parametrize("in_features", [300, 576])
def test_blocks_of_k_sum_in_the_same_order_as_the_whole_walk(in_features: int) -> None:
    """128 rows take the blocks, 129 the walk tile by tile over the whole of
    k: each output is the same sum in the same order, so the same bits."""
    gen = torch.Generator().manual_seed(in_features)
    layer = Linear(torch.randn(80, in_features, generator=gen), panels=True)
    x = torch.randn(129, in_features, generator=gen)
    assert torch.equal(layer(x[:128]), layer(x)[:128])


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


@pytest.mark.parametrize("rows", [0, 1, 7, 64])
def test_a_kept_output_buffer_gets_the_same_bits(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(37, 50, generator=g), torch.randn(37, generator=g)
    x = torch.randn(rows, 50, generator=g)
    layer = Linear(w, b, panels=True)
    buffer = torch.full((80, 37), float("nan"))
    got = layer(x, out=buffer[:rows])
    assert torch.equal(got, layer(x))
    assert rows == 0 or got.data_ptr() == buffer.data_ptr()
    assert buffer[rows:].isnan().all()  # rows past the call's untouched
    plain = Linear(w, b)  # no panels: a fresh result, the buffer left alone
    assert torch.equal(plain(x, out=buffer[:rows]), F.linear(x, w, b))
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.slipstream.panel_linear_out(x, layer.panels, b, torch.empty(37, rows).t())


def test_float32_and_even_width_bf16_weights_use_panels() -> None:
    assert Linear(torch.randn(4, 4), panels=True).uses_panels
    bf16 = Linear(torch.randn(4, 4, dtype=torch.bfloat16), panels=True)
    assert bf16.uses_panels is linear.bf16_panels_available()
    assert bf16.weight.shape == (4, 4)  # kept for the calls of many rows
    odd = Linear(torch.randn(4, 5, dtype=torch.bfloat16), panels=True)
    assert not odd.uses_panels and odd.max_panel_rows == 0
    assert not Linear(torch.randn(4, 4, dtype=torch.float16), panels=True).uses_panels


def test_bf16_packing_pairs_k_inside_each_panel_row() -> None:
    w = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).bfloat16()
    panels = pack_bf16_panels(w)
    assert panels.shape == (2, 3, 16, 2) and panels.is_contiguous()
    assert torch.equal(panels[0, 1, 5], w[5, 2:4])
    assert torch.equal(panels[1, 2, 3], w[19, 4:6])
    assert not panels[1, :, 4:].any()
    with pytest.raises(ValueError, match="even"):
        pack_bf16_panels(torch.ones(4, 5, dtype=torch.bfloat16))


@pytest.fixture
def bf16_panels() -> None:
    if not linear.bf16_panels_available():
        isa = torch.ops.slipstream.linear_cpu_isa()
        pytest.skip(f"bf16 panels need AVX512-BF16 (this CPU, as reported, runs {isa})")


def _bf16_case(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    return torch.randn(rows, k, generator=gen).bfloat16(), w, b


@pytest.mark.usefixtures("bf16_panels")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 43, 130])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(16, 8), (37, 50), (80, 2), (48, 300), (1024, 576)]
)
def test_bf16_panels_match_float64(rows: int, out_features: int, in_features: int, threads: int):
    """The op itself, at any row count; 37 and 80 features leave a partial
    panel and an odd number of panels (one unpaired); 300 and 576 inputs span
    several blocks of k (64 pairs), the last one partial, whose sums carry
    from block to block for every row tile (43 and 130 rows: 6 and 17)."""
    torch.set_num_threads(threads)
    x, w, b = _bf16_case(rows, out_features, in_features, rows * 1000 + out_features)
    panels = pack_bf16_panels(w)
    for bias in (None, b):
        got = torch.ops.slipstream.panel_linear_bf16(x, panels, bias, out_features)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        # Exact products, fp32 sums, one rounding to bf16 (half an ulp: 2^-9).
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3)
        # Into a float32 buffer: the same sums, unrounded (fp32's sums alone).
        sums = torch.full((rows, out_features), float("nan"))
        torch.ops.slipstream.panel_linear_bf16_out(x, panels, bias, sums)
        torch.testing.assert_close(sums.double(), want, rtol=1e-5, atol=1e-4)
        assert torch.equal(sums.bfloat16(), got)


@pytest.mark.usefixtures("bf16_panels")
def test_bf16_calls_of_few_rows_take_the_panels_and_the_rest_onednn() -> None:
    if not detect().can_pack_bf16:
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU (as reported)")
    most = linear.max_bf16_panel_rows()
    x, w, b = _bf16_case(most + 1, 48, 64, 3)
    layer = Linear(w, b, pack=True, panels=True)
    plain = Linear(w, b, pack=True)
    assert layer.uses_panels and layer.is_packed and layer.max_panel_rows == most
    few = x[:most]
    on_panels = torch.ops.slipstream.panel_linear_bf16(few, layer.panels, b, 48)
    assert torch.equal(layer(few), on_panels)
    assert torch.equal(layer(x), plain(x))
    strided = torch.randn(2, 100).bfloat16()[:, 10:74]
    want = F.linear(strided.double(), w.double(), b.double())
    torch.testing.assert_close(layer(strided).double(), want, rtol=2**-8, atol=1e-3)


@pytest.mark.usefixtures("bf16_panels")
def test_a_float_out_layer_takes_every_call_on_the_panels_and_keeps_no_other_copy() -> None:
    """The LM head of a bf16 model: float32 logits out of the panels at any
    row count (more than a projection's cut too), the weight held once."""
    most = linear.max_bf16_panel_rows()
    x, w, b = _bf16_case(most + 3, 48, 64, 5)
    layer = Linear(w, b, pack=detect().can_pack_bf16, panels=True, float_out=True)
    assert layer.uses_panels and not layer.is_packed and layer.weight is layer.panels
    out = torch.empty(most + 3, 48)
    assert layer(x, out=out) is out
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(layer(x), out.bfloat16())  # without a buffer: bf16, as before


@pytest.mark.usefixtures("bf16_panels")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "out_features"), [(0, 16), (1, 37), (9, 80), (130, 4000)])
def test_bf16_argmax_is_the_float32_sums_first_maximum(rows, out_features, threads) -> None:
    """Each row's column of its greatest float32 sum, none stored: the argmax
    of what ``panel_linear_bf16_out`` writes, exactly (the same sums); ties
    go to the first column, across panels and threads' ranges too."""
    torch.set_num_threads(threads)
    x, w, b = _bf16_case(rows, out_features, 64, rows + out_features)
    w[out_features - 1] = w[out_features // 2] = w[3]  # three columns alike
    x[: rows // 2] = w[3]  # half the rows lean on them
    panels = pack_bf16_panels(w)
    for bias in (None, b):
        if bias is not None:
            bias[out_features - 1] = bias[out_features // 2] = bias[3]
        sums = torch.empty(rows, out_features)
        torch.ops.slipstream.panel_linear_bf16_out(x, panels, bias, sums)
        got = torch.ops.slipstream.panel_linear_bf16_argmax(x, panels, bias, out_features)
        assert got.dtype == torch.int64 and torch.equal(got, sums.argmax(dim=-1))
    assert (got[: rows // 2] == 3).all()


@pytest.mark.usefixtures("bf16_panels")
def test_argmax_is_only_for_a_float_out_layer() -> None:
    w = torch.randn(32, 64).bfloat16()
    x = torch.randn(3, 100).bfloat16()[:, 20:84]  # strided rows: copied first
    head = Linear(w, panels=True, float_out=True)
    assert head.has_argmax
    assert torch.equal(head.argmax(x), F.linear(x.float(), w.float()).argmax(dim=-1))
    for layer in (Linear(w, panels=True), Linear(w.float(), panels=True)):
        assert not layer.has_argmax
        with pytest.raises(ValueError, match="float_out"):
            layer.argmax(x)


def _answer(*flags: str) -> CpuFeatures:
    return CpuFeatures("forced", flags, "DEFAULT", can_pack_bf16=False)


def test_bf16_calls_leave_the_panels_sooner_where_amx_does_onednns_arithmetic() -> None:
    avx512 = _answer("avx512_bf16", "avx512f", "avx2")
    amx = _answer("amx_bf16", "avx512_bf16", "avx512f", "avx2")
    assert linear.max_bf16_panel_rows(avx512) == linear.MAX_BF16_PANEL_ROWS == 128
    assert linear.max_bf16_panel_rows(amx) == linear.MAX_BF16_PANEL_ROWS_AMX == 4


def test_an_avx2_answer_keeps_bf16_weights_off_the_panels() -> None:
    """Whatever this CPU runs: capped at avx2 no weight takes bf16 panels and
    the op refuses; float32 panels stay. Restored to this run's answer."""
    w = torch.randn(32, 64).bfloat16()
    try:
        assert extensions.cap_isa(linear.EXTENSION, _answer("avx2")) == "avx2"
        assert not linear.bf16_panels_available()
        assert not Linear(w, panels=True).uses_panels
        assert Linear(w.float(), panels=True).uses_panels
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            torch.ops.slipstream.panel_linear_bf16(w[:1], pack_bf16_panels(w), None, 32)
    finally:
        extensions.cap_isa(linear.EXTENSION)


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


@pytest.mark.usefixtures("bf16_panels")
def test_bad_bf16_arguments_are_errors_not_crashes() -> None:
    panels = pack_bf16_panels(torch.randn(20, 8).bfloat16())
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.slipstream.panel_linear_bf16(x.float(), panels, None, 20)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.slipstream.panel_linear_bf16(torch.ones(2, 10).bfloat16(), panels, None, 20)
    with pytest.raises(RuntimeError, match="number of panels"):
        torch.ops.slipstream.panel_linear_bf16(x, panels, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.slipstream.panel_linear_bf16(x, panels, torch.ones(20), 20)
    for out in (
        torch.empty(2, 20, dtype=torch.float16),
        torch.empty(3, 20),
        torch.empty(20, 2).t(),
    ):
        with pytest.raises(RuntimeError, match="out must be"):
            torch.ops.slipstream.panel_linear_bf16_out(x, panels, None, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_with_no_rows_on_a_layer_without_panels(dtype: torch.dtype) -> None:
    # A step that samples nothing (a prefill chunk) calls the LM head with 0 rows.
    layer = Linear(torch.randn(8, 16, dtype=dtype), pack=False, panels=False)
    assert layer(torch.empty(0, 16, dtype=dtype)).shape == (0, 8)


def _near_tie_case(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of x equal to weight row 3, so columns 3 and 7 lead with float32
    sums ~60 and 7's greater by a hair (weight row 7 is row 3 with one
    element nudged up): bf16 rounds both to one value (1/4 apart there),
    and the bf16 argmax is 3 where the float32 one is 7."""
    x, w, b = _bf16_case(rows, 300, 64, rows)
    w[7] = w[3]
    w[7, 0] = w[3, 0] + w[3, 0].abs().clamp(min=0.05)  # x[:, 0] = w[3, 0], > 0 after
    w[3, 0] = w[7, 0] - 2.0**-6 * torch.sign(w[7, 0])  # the nudge: one bf16 step or so
    x[:] = w[3]
    x[:, 0] = w[3, 0].abs()
    return x, w, b


@pytest.mark.usefixtures("bf16_panels")
def test_a_float_out_layer_where_amx_does_onednns_arithmetic_re_scores_its_near_maximum(
    monkeypatch,
) -> None:
    """Where AMX does oneDNN's arithmetic the LM head keeps the panels' cut:
    calls of more than 4 rows return oneDNN's bf16 sums widened, with the
    columns near each row's maximum re-scored in float32, so the logits'
    argmax and ``argmax`` are the float32 sums' (7 here), not the bf16
    tie's lower id (3); calls of up to 4 rows stay on the panels."""
    monkeypatch.setattr(linear, "max_bf16_panel_rows", lambda cpu=None: 4)
    x, w, b = _near_tie_case(9)
    sums64 = F.linear(x.double(), w.double())
    assert sums64[:, 7].gt(sums64[:, 3]).all() and sums64.argmax(dim=-1).eq(7).all()
    plain = F.linear(x, w)
    assert torch.equal(plain[:, 3], plain[:, 7])  # the tie a bf16 LM head made
    head = Linear(w, pack=detect().can_pack_bf16, panels=True, float_out=True)
    assert head.uses_panels and head.max_panel_rows == 4 and head.plain is w
    out = torch.empty(9, 300)
    logits = head(x, out=out)
    assert logits is out and logits.argmax(dim=-1).eq(7).all()
    torch.testing.assert_close(logits[:, [3, 7]].double(), sums64[:, [3, 7]], rtol=1e-6, atol=0)
    assert torch.equal(head(x), logits)  # without a buffer: the same, fresh
    assert head.argmax(x).eq(7).all()
    assert head.argmax(x[:4]).eq(7).all()  # on the panels
    broken = x.clone()
    broken[0] = float("nan")  # a row of NaNs has no near column: its bf16 argmax, the others theirs
    assert head.argmax(broken)[1:].eq(7).all() and head.argmax(x[:0]).shape == (0,)
    crowded = w.clone()
    crowded[20:40] = w[3]  # 21 columns at the rounded maximum: rows scanned whole
    head = Linear(crowded, pack=detect().can_pack_bf16, panels=True, float_out=True)
    assert head.argmax(x).eq(7).all() and head(x).argmax(dim=-1).eq(7).all()
    for bias in (b, None):  # every row's tokens against the float64 sums
        xs, ws, _ = _bf16_case(40, 300, 64, 11)
        layer = Linear(ws, bias, pack=detect().can_pack_bf16, panels=True, float_out=True)
        want = F.linear(xs.double(), ws.double(), None if bias is None else bias.double())
        assert torch.equal(layer.argmax(xs), want.argmax(dim=-1))
        assert torch.equal(layer(xs).argmax(dim=-1), want.argmax(dim=-1))


def test_a_float_out_bf16_layer_off_the_panels_re_scores_too() -> None:
    """A bf16 model's LM head without panels (eager, or a CPU without
    AVX512-BF16): float32 logits whose argmax is the float32 sums'."""
    x, w, _ = _near_tie_case(5)
    head = Linear(w, float_out=True)
    assert not head.uses_panels and head.plain is w and not head.has_argmax
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.argmax(dim=-1).eq(7).all()
    assert Linear(w)(x).dtype == torch.bfloat16 and Linear(w).plain is None

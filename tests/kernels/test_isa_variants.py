"""Which instruction-set variant the native kernels run, and who may cap it.

The C++ side checks CPUID; the Python side caps the choice at what
``cpu_features.detect()`` reports (``extensions.max_isa``), so a forced
answer (an AVX2-only or a no-AVX2 CPU) is never exceeded. The cap is tested
with hand-built ``CpuFeatures`` on any machine; the variants themselves run
where this CPU executes them and skip, saying so, where it does not.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_cpu_attention import MIXED, _case, run_variant

from slipstream.kernels import cpu_attention, extensions, fused_ops, linear
from slipstream.kernels.cpu_answer import EMULATED_AVX512
from slipstream.kernels.cpu_features import CpuFeatures, detect, forced, native

ORDER = ("portable", "avx2", "avx512")


def features(*flags: str) -> CpuFeatures:
    return CpuFeatures("forced", flags, "DEFAULT", can_pack_bf16=False)


@pytest.mark.parametrize(
    ("flags", "cap"),
    [
        ((), "portable"),
        (("avx2",), "avx2"),
        (("avx512_bf16", "avx2"), "avx2"),  # bf16 without avx512f: no AVX-512 variant
        (("avx512f", "avx2"), "avx512"),
        (("amx_bf16", "avx512_bf16", "avx512f", "avx2"), "avx512"),
    ],
)
def test_max_isa_follows_the_reported_flags(flags: tuple[str, ...], cap: str) -> None:
    assert extensions.max_isa(features(*flags)) == cap


@pytest.fixture(scope="module")
def libraries() -> Iterator[list[extensions.Extension]]:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    home = Path(os.environ["SLIPSTREAM_HOME"])
    assert cpu_attention.is_available(home), cpu_attention.failure()
    assert fused_ops.is_available(home), fused_ops.failure()
    assert linear.panels_available(home) or linear.panels_failure() == linear.NO_AVX2
    exts = [cpu_attention.EXTENSION, fused_ops.EXTENSION, linear.EXTENSION]
    yield exts
    for ext in exts:  # back to what this machine reports
        extensions.cap_isa(ext)


def _cpu_best(ext: extensions.Extension) -> str:
    """What the library picks uncapped (restored by the fixture)."""
    picked = extensions.cap_isa(ext, features("avx512f", "avx2"))
    assert picked is not None
    return picked


@pytest.mark.parametrize("ext_name", ["paged_attention_cpu", "fused_ops_cpu", "linear_cpu"])
@pytest.mark.parametrize(
    "flags", [(), ("avx2",), ("avx512f", "avx2")], ids=["none", "avx2", "avx512"]
)
def test_a_forced_answer_caps_the_variant(
    libraries: list[extensions.Extension], ext_name: str, flags: tuple[str, ...]
) -> None:
    ext = next(e for e in libraries if e.name == ext_name)
    best = _cpu_best(ext)
    cap = extensions.max_isa(features(*flags))
    want = min(best, cap, key=ORDER.index)
    assert extensions.cap_isa(ext, features(*flags)) == want
    assert getattr(torch.ops.slipstream, ext.probe)() == want
    extensions.cap_isa(ext)
    assert getattr(torch.ops.slipstream, ext.probe)() == extensions.cap_isa(ext, detect())


def test_avx512_is_reported_only_with_avx512f_in_detect() -> None:
    """On this machine: the probe after loading never says avx512 unless detect() does."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    assert cpu_attention.is_available(Path(os.environ["SLIPSTREAM_HOME"]))
    if "avx512f" not in detect().flags:
        assert torch.ops.slipstream.paged_attention_cpu_isa() != "avx512"
        assert torch.ops.slipstream.fused_ops_cpu_isa() != "avx512"


def test_auto_runs_the_capped_variant(libraries: list[extensions.Extension]) -> None:
    """bf16 K/V: "auto" under an AVX2-only answer computes exactly what the named
    avx2 variant does, and (where this CPU has it) not what avx512 does (P is
    rounded to bf16 there), so a cap that did not reach the C++ side would fail."""
    q, batch, meta = _case(MIXED, 8, 2, 64, 16, torch.bfloat16, seed=5)
    avx2 = run_variant("avx2", q, batch, meta, 0.125)
    try:
        extensions.cap_isa(cpu_attention.EXTENSION, features("avx2"))
        auto = cpu_attention.paged_attention(q, batch.k_cache, batch.v_cache, meta, 0.125)
    finally:
        extensions.cap_isa(cpu_attention.EXTENSION)
    assert torch.equal(auto, avx2)
    if _cpu_best(cpu_attention.EXTENSION) == "avx512":
        assert not torch.equal(run_variant("avx512", q, batch, meta, 0.125), avx2)
        # The machine's own answer, whatever answer the run is forced to (the
        # emulating build's machine is the AVX-512 CPU it reports).
        machine = detect() if forced() == EMULATED_AVX512 else native()
        try:
            extensions.cap_isa(cpu_attention.EXTENSION, machine)
            uncapped = cpu_attention.paged_attention(q, batch.k_cache, batch.v_cache, meta, 0.125)
        finally:
            extensions.cap_isa(cpu_attention.EXTENSION)
        assert torch.equal(uncapped, run_variant("avx512", q, batch, meta, 0.125))


@pytest.fixture(params=ORDER)
def fused_variant(
    libraries: list[extensions.Extension], request: pytest.FixtureRequest
) -> Iterator[str]:
    isa = str(request.param)
    picked = torch.ops.slipstream.fused_ops_set_max_isa(isa)
    try:
        if picked != isa:
            pytest.skip(f"this CPU cannot run the {isa} fused ops (it runs {picked})")
        yield isa
    finally:
        extensions.cap_isa(fused_ops.EXTENSION)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_fused_ops_variant_matches_eager(fused_variant: str, dtype: torch.dtype) -> None:
    """Widths that leave a vector tail (577, 2 x 1000, head_dim 80) at each variant."""
    tol = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(67, 577, generator=g) * 3).to(dtype)
    delta = torch.randn(67, 577, generator=g).to(dtype)
    weight = torch.randn(577, generator=g).to(dtype)
    want_x = x + delta
    want = F.rms_norm(want_x.double(), (577,), weight.double(), 1e-5)
    got = fused_ops.add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(x, want_x)
    torch.testing.assert_close(got.double(), want, rtol=tol[0], atol=tol[1] * 10)

    gate_up = torch.randn(67, 2000, generator=g).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(
        fused_ops.silu_and_mul(gate_up).double(), F.silu(gate) * up, rtol=tol[0], atol=tol[1] * 10
    )

    qk = torch.randn(9, 5, 80, generator=g).to(dtype)
    angles = torch.randn(40, 40, generator=g)
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = angles.sin()
    ssin = torch.cat([-sin, sin], dim=-1).to(dtype)
    positions = torch.randint(0, 40, (9,), generator=g)
    x64 = qk.double()
    rolled = torch.cat([x64[..., 40:], x64[..., :40]], dim=-1)
    want_rope = x64 * cos.double()[positions][:, None] + rolled * ssin.double()[positions][:, None]
    fused_ops.rotary_neox_(qk, cos, ssin, positions)
    torch.testing.assert_close(qk.double(), want_rope, rtol=tol[0], atol=tol[1] * 10)

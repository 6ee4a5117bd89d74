"""Dtype and weight-packing choices per CPU: both answers forced on any machine,
and the real packing op exercised wherever this CPU allows it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.cpu_answer import CPU_ANSWERS, answer_from, prepare_environment
from slipstream.kernels.cpu_features import (
    CpuFeatures,
    _read_cpuinfo,
    answer_as,
    choose_dtype,
    detect,
    force,
    forced,
    native,
    other_answer,
)
from slipstream.kernels.linear import Linear, WeightPackingFailed

AMX = CpuFeatures("Xeon (forced)", ("amx_bf16", "avx512f", "avx2"), "AVX512", True, True)
AVX2 = CpuFeatures("EPYC (forced)", ("avx2",), "AVX2", can_pack_bf16=False, can_pack_fp32=True)
# AVX-512 without bf16 arithmetic: oneDNN can pack, but bf16 math is emulated.
AVX512 = CpuFeatures("Skylake (forced)", ("avx512f", "avx2"), "AVX512", True, True)
# No oneDNN at all (a torch build without it): nothing is ever packed.
BARE = CpuFeatures("bare (forced)", ("avx2",), "DEFAULT", can_pack_bf16=False, can_pack_fp32=False)


def test_auto_is_bf16_packed_with_native_bf16() -> None:
    choice = choose_dtype("auto", AMX)
    assert (choice.dtype, choice.pack_weights, choice.warning) == ("bfloat16", True, None)


@pytest.mark.parametrize("cpu", [AVX2, AVX512])
def test_auto_is_fp32_packed_without_native_bf16(cpu: CpuFeatures) -> None:
    choice = choose_dtype("auto", cpu)
    assert (choice.dtype, choice.pack_weights, choice.warning) == ("float32", True, None)


def test_nothing_is_packed_where_onednn_cannot() -> None:
    for dtype in ("float32", "bfloat16"):
        assert not choose_dtype(dtype, BARE).pack_weights


def test_explicit_bf16_without_native_support_runs_unpacked_with_a_warning() -> None:
    choice = choose_dtype("bfloat16", AVX2)
    assert (choice.dtype, choice.pack_weights) == ("bfloat16", False)
    assert choice.warning is not None and "float32" in choice.warning


def test_explicit_fp32_packs_where_onednn_can() -> None:
    assert choose_dtype("float32", AMX).pack_weights


def test_unknown_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtype("float16", AMX)


def test_cpuinfo_parsing(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 amx_bf16\n\n"
        "processor\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 amx_bf16\n"
    )
    assert _read_cpuinfo(info) == ("Some CPU", frozenset({"fpu", "avx2", "amx_bf16"}))
    assert _read_cpuinfo(tmp_path / "missing") == ("", frozenset())


def test_the_machine_agrees_with_the_packing_probe() -> None:
    cpu = native()  # the probe's answers, whatever answer the run is forced to
    assert cpu.torch_capability
    assert set(cpu.describe()) >= {"model", "flags", "native_bf16", "can_pack_bf16"}
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert cpu.can_pack_fp32 == torch.backends.mkldnn.is_available()
    if cpu.can_pack_bf16:
        packed = Linear(w, pack=True)
        assert packed.is_packed
        torch.testing.assert_close(packed(x), F.linear(x, w), rtol=2e-2, atol=2e-2)
    else:
        with pytest.raises(WeightPackingFailed, match="--dtype"):
            Linear(w, pack=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpacked_linear_is_f_linear(dtype: torch.dtype) -> None:
    x = torch.randn(5, 16, dtype=dtype)
    w = torch.randn(8, 16, dtype=dtype)
    b = torch.randn(8, dtype=dtype)
    layer = Linear(w, b, pack=False)
    assert not layer.is_packed
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_packed_fp32_linear_matches_f_linear() -> None:
    if not native().can_pack_fp32:  # the real op, whatever answer is forced
        pytest.skip("oneDNN cannot pack fp32 weights here")
    x, w, b = torch.randn(5, 16), torch.randn(8, 16), torch.randn(8)
    layer = Linear(w, b, pack=True)
    assert layer.is_packed
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_int_weights_are_never_packed() -> None:
    assert not Linear(torch.ones(8, 16, dtype=torch.int32), pack=True).is_packed


# ---------------------------------------------------------------- forced answers


def test_forced_answers_drop_what_the_other_kind_lacks() -> None:
    as_avx2 = answer_as("avx2", AMX)
    assert as_avx2.flags == ("avx2",) and not as_avx2.has_native_bf16
    assert (as_avx2.can_pack_bf16, as_avx2.can_pack_fp32) == (False, True)
    assert choose_dtype("auto", as_avx2).dtype == "float32"
    as_bare = answer_as("bare", AVX2)
    assert (as_bare.can_pack_bf16, as_bare.can_pack_fp32) == (False, False)
    assert not choose_dtype("auto", as_bare).pack_weights
    assert answer_as("native", AMX) is AMX


def test_the_emulated_avx512_answer_reports_avx512_bf16_and_builds_the_emulation() -> None:
    """avx512-emulated: AVX-512 and AVX512-BF16 reported (the kernels' test
    build runs those variants on AVX2), no bf16 packing (oneDNN is capped at
    AVX2); every native library takes the emulating flag, so another key."""
    from slipstream.kernels import cpu_attention, extensions

    as_emulated = answer_as("avx512-emulated", AVX2)
    assert as_emulated.flags == ("avx512_bf16", "avx512f", "avx2")
    assert as_emulated.has_native_bf16 and not as_emulated.can_pack_bf16
    assert extensions.max_isa(as_emulated) == "avx512"
    ext, source = cpu_attention.EXTENSION, cpu_attention.SOURCE
    previous = forced()
    try:
        force("native")
        plain_key = extensions.build_key(ext, source)
        assert extensions.EMULATE_AVX512_FLAG not in extensions.cflags(ext)
        force("avx512-emulated")
        assert extensions.cflags(ext) == (*ext.cflags, extensions.EMULATE_AVX512_FLAG, "-O1")
        assert extensions.build_key(ext, source) != plain_key
    finally:
        force(previous)


def test_an_answer_the_cpu_cannot_execute_is_refused() -> None:
    no_avx2 = CpuFeatures("old (forced)", (), "DEFAULT", False, True)
    with pytest.raises(ValueError, match="no avx2"):
        answer_as("avx2", no_avx2)


@pytest.mark.parametrize(("cpu", "other"), [(AMX, "avx2"), (AVX512, "avx2"), (AVX2, "bare")])
def test_the_other_answer_covers_the_other_kind_of_machine(cpu: CpuFeatures, other: str) -> None:
    assert other_answer(cpu) == other


def test_force_changes_what_detect_says_and_back() -> None:
    previous, before = forced(), detect()
    try:
        force("bare")
        assert forced() == "bare" and detect() == answer_as("bare", native())
        with pytest.raises(ValueError, match="CPU answer must be one of"):
            force("avx9000")
    finally:
        force(previous)
    assert detect() == before


def test_the_environment_asks_torch_and_onednn_for_the_forced_isa() -> None:
    env = {"SLIPSTREAM_CPU": "avx2"}
    assert prepare_environment(env) == "avx2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert prepare_environment({}) == "native"
    assert set(CPU_ANSWERS) == {"native", "avx2", "bare", "avx512-emulated"}
    with pytest.raises(ValueError, match="SLIPSTREAM_CPU"):
        answer_from({"SLIPSTREAM_CPU": "fast"})

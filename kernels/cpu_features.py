"""What this CPU can do, asked once: the flags that decide dtype and weight packing.

Two choices depend on the CPU and are made here, never assumed:

- **which dtype ``auto`` means.** bf16 halves the bytes of weights and KV, but
  only CPUs with native bf16 arithmetic (AVX512-BF16 or AMX-BF16) run it fast;
  elsewhere it is emulated: on an AVX2-only AMD EPYC (torch 2.13, 2 threads,
  ``bench step --model small --context 300``, unpacked bf16 vs packed fp32
  side by side) a decode step took 11.6 vs 19.5 ms at batch 1 (half the
  weight bytes wins), but 49.6 vs 32.5 ms at batch 8, 344 vs 112 at 64 and
  1,212 vs 312 at 256. Serving runs batches, so ``auto`` is bf16 with native
  support, fp32 without.
- **whether weights are packed for oneDNN.** A packed weight skips the
  per-call re-layout and oneDNN's small-batch kernels beat MKL's there
  (fp32, AVX2-only AMD EPYC, 2 threads, one ``small`` layer's four
  projections: batch 1 1.33 -> 0.56 ms, batch 8 3.58 -> 1.47 ms, batch 64
  6.71 -> 4.49 ms, batch 256 17.6 -> 15.5 ms). bf16 packing needs AVX-512
  (BW/VL/DQ) or AVX-NE-CONVERT; on other CPUs torch raises. Each answer comes
  from a probe that packs a tiny weight, so it is exactly torch's own.

``detect()`` reads ``/proc/cpuinfo`` (flags, model name) and torch's reported
capability; tests build ``CpuFeatures`` by hand to force either answer, and
``force()`` makes the whole process answer as a CPU of another kind that this
one can execute (see ``cpu_answer.py``).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from slipstream.kernels.compute_thread import on_own_thread
from slipstream.kernels.cpu_answer import CPU_ANSWERS, EMULATED_AVX512

# Flags every benchmark prints; the first two decide native bf16.
REPORTED_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
_NATIVE_BF16_FLAGS = frozenset(REPORTED_FLAGS[:2])
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    """The facts about the CPU that Slipstream's choices read."""

    model_name: str
    flags: tuple[str, ...]  # those of REPORTED_FLAGS this CPU has
    torch_capability: str  # torch's kernel dispatch level: "AVX2", "AVX512", ...
    can_pack_bf16: bool  # oneDNN accepted a packed bf16 weight
    can_pack_fp32: bool = False  # oneDNN accepted a packed fp32 weight

    @property
    def has_native_bf16(self) -> bool:
        return bool(_NATIVE_BF16_FLAGS.intersection(self.flags))

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary for logs, GetModelInfo and benchmark reports."""
        return {
            "model": self.model_name,
            "flags": list(self.flags),
            # Absent flags said explicitly: "no avx512f" is what decides the dtype here.
            "has_flags": {flag: flag in self.flags for flag in REPORTED_FLAGS},
            "torch_capability": self.torch_capability,
            "native_bf16": self.has_native_bf16,
            "can_pack_bf16": self.can_pack_bf16,
            "can_pack_fp32": self.can_pack_fp32,
        }


_forced = "native"


def force(answer: str) -> None:
    """Makes ``detect()`` answer as ``answer`` (one of ``CPU_ANSWERS``) from now on."""
    global _forced
    if answer not in CPU_ANSWERS:
        raise ValueError(f"CPU answer must be one of {CPU_ANSWERS}, got {answer!r}")
    _forced = answer
    detect.cache_clear()


def forced() -> str:
    """The answer ``detect()`` gives: ``native`` unless ``force`` said otherwise."""
    return _forced


@functools.cache
def detect() -> CpuFeatures:
    """This machine's features, or the forced answer (computed once per answer)."""
    return answer_as(_forced, native())


@functools.cache
def native() -> CpuFeatures:
    """What this machine is, whatever answer is forced."""
    model_name, flags = _read_cpuinfo(Path("/proc/cpuinfo"))
    # Not on the caller's thread: where the CPU has native bf16, oneDNN's bf16
    # reorder is a parallel region, and the team it leaves on the caller (the
    # main thread, in `serve`) would put the engine's team to sleep between
    # regions (compute_thread.py).
    can_pack_bf16, can_pack_fp32 = on_own_thread(
        lambda: (probe_packing(torch.bfloat16), probe_packing(torch.float32)), "slipstream-probe"
    )
    return CpuFeatures(
        model_name=model_name or platform.processor() or platform.machine(),
        flags=tuple(f for f in REPORTED_FLAGS if f in flags),
        torch_capability=torch.backends.cpu.get_cpu_capability(),
        can_pack_bf16=can_pack_bf16,
        can_pack_fp32=can_pack_fp32,
    )


def answer_as(answer: str, cpu: CpuFeatures) -> CpuFeatures:
    """``cpu`` seen as a CPU of kind ``answer``: ``avx2`` drops AVX-512 and native
    bf16 (and bf16 packing, which needs them); ``bare`` also drops oneDNN packing;
    ``avx512-emulated`` reports AVX-512 with AVX512-BF16 (the native kernels'
    emulating test build runs them) and no bf16 packing (oneDNN is capped at
    AVX2). ValueError where ``cpu`` cannot execute that kind (no AVX2)."""
    if answer == "native":
        return cpu
    if "avx2" not in cpu.flags:
        raise ValueError(f"this CPU cannot answer as {answer!r}: it has no avx2")
    flags = ("avx512_bf16", "avx512f", "avx2") if answer == EMULATED_AVX512 else ("avx2",)
    return replace(
        cpu,
        model_name=f"{cpu.model_name} (as {answer})",
        flags=flags,
        can_pack_bf16=False,
        can_pack_fp32=cpu.can_pack_fp32 and answer != "bare",
    )


def other_answer(cpu: CpuFeatures) -> str:
    """The forced answer that covers the other kind of machine from this one:
    ``avx2`` on a CPU with AVX-512 or native bf16, ``bare`` on an AVX2-only one."""
    return "avx2" if "avx512f" in cpu.flags or cpu.has_native_bf16 else "bare"


def _read_cpuinfo(path: Path) -> tuple[str, frozenset[str]]:
    try:
        text = path.read_text()
    except OSError:
        return "", frozenset()
    model_name, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model_name:
            model_name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model_name, flags


def probe_packing(dtype: torch.dtype) -> bool:
    """True if oneDNN packs a linear weight of ``dtype`` on this CPU (tried on 8x8)."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype a model runs in and why: ``requested`` as the user said it."""

    dtype: str  # "float32" | "bfloat16"
    requested: str
    pack_weights: bool
    warning: str | None  # set when the choice is known to be slow here


def choose_dtype(requested: str, features: CpuFeatures) -> DtypeChoice:
    """Resolves ``auto`` and decides packing; raises ValueError on an unknown name."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    dtype = requested
    if requested == "auto":
        dtype = "bfloat16" if features.has_native_bf16 else "float32"
    is_bf16 = dtype == "bfloat16"
    warning = None
    if is_bf16 and not features.has_native_bf16:
        warning = (
            "bfloat16 on a CPU without native bf16 (no avx512_bf16/amx_bf16) is emulated "
            "and slower than float32 from a few sequences per batch up (several times at 64+); "
            "--dtype auto picks float32 here"
        )
    return DtypeChoice(
        dtype=dtype,
        requested=requested,
        pack_weights=features.can_pack_bf16 if is_bf16 else features.can_pack_fp32,
        warning=warning,
    )

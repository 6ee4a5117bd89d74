"""Which CPU a benchmark ran on. Figures differ by an order of magnitude
between CPUs with native bf16 (AVX-512 BF16, AMX) and AVX2-only ones, where
bf16 is emulated, so every report names the CPU and those flags."""

from __future__ import annotations

import platform
from pathlib import Path

# The flags that decide which dtype is fast on this CPU.
DTYPE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description(cpuinfo: str | None = None) -> dict[str, object]:
    """``{"model": ..., "flags": {flag: bool}}`` from ``/proc/cpuinfo`` (or the
    given text); the model falls back to ``platform.processor()`` where
    there is no such file."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    model = _first_field(cpuinfo, "model name") or platform.processor() or None
    flags = set((_first_field(cpuinfo, "flags") or "").split())
    return {"model": model, "flags": {flag: flag in flags for flag in DTYPE_FLAGS}}


def _first_field(cpuinfo: str, name: str) -> str | None:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None

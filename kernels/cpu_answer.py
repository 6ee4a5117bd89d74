"""Which CPU the process answers for: the machine's own (``native``), or a
forced answer that this machine can really execute, so that both branches of
every CPU-dependent choice run on one machine (``make test`` runs the
CPU-dependent tests once per answer).

- ``native``: what the machine is.
- ``avx2``: an AVX2-only CPU: no AVX-512, no native bf16 (so ``--dtype auto``
  is float32); torch's own kernels dispatch at AVX2 and oneDNN is capped at
  AVX2, through their environment variables, which they read when torch loads.
- ``bare``: as ``avx2``, and no oneDNN weight packing (a torch build without it).
- ``avx512-emulated``: a CPU with AVX-512 and AVX512-BF16 whose native
  kernels are a test build (``-DSLIPSTREAM_EMULATE_AVX512``) running their
  AVX-512 variants with those instructions emulated on AVX2
  (``kernels/csrc/avx512_emulation.h``): the variants' logic checked on any
  AVX2 machine. torch and oneDNN are capped at AVX2 as for ``avx2``.

The entry points (the ``slipstream`` command, the test suite) read
``$SLIPSTREAM_CPU`` and call ``prepare_environment`` before torch is imported,
then ``slipstream.kernels.cpu_features.force``. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import MutableMapping

CPU_ANSWERS = ("native", "avx2", "bare", "avx512-emulated")
EMULATED_AVX512 = "avx512-emulated"
ENV_VAR = "SLIPSTREAM_CPU"

# Read by torch (ATen's kernel dispatch) and oneDNN when torch is first imported.
_TORCH_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def answer_from(environ: MutableMapping[str, str]) -> str:
    """The answer ``$SLIPSTREAM_CPU`` asks for (``native`` when unset); ValueError if unknown."""
    answer = environ.get(ENV_VAR, "") or "native"
    if answer not in CPU_ANSWERS:
        raise ValueError(f"${ENV_VAR} must be one of {CPU_ANSWERS}, got {answer!r}")
    return answer


def prepare_environment(environ: MutableMapping[str, str]) -> str:
    """Sets torch's and oneDNN's ISA caps for a forced answer (before torch
    loads; values already set win) and returns the answer."""
    answer = answer_from(environ)
    if answer != "native":
        for key, value in _TORCH_ENV.items():
            environ.setdefault(key, value)
    return answer

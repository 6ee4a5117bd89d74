"""The marks every GPU test module takes: ``pytestmark = GPU_ONLY``.

GPU tests run the Triton kernels compiled, never under the interpreter that
tests/conftest.py turns on for the CPU (``TRITON_INTERPRET=1``, read when
triton is first imported): run them as ``make test-gpu``. Where torch sees no
CUDA device, or the interpreter is on, they are skipped."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.backend import is_interpreting

GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        torch.cuda.is_available() and is_interpreting(),
        reason="Triton interpreter on: run with TRITON_INTERPRET=0",
    ),
]

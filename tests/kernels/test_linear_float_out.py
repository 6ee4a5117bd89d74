"""A 16-bit LM head's float32 logits off the CPU (``Linear.float_mm``):
which weights take ``torch.mm(..., out_dtype=torch.float32)``, checked on
torch's meta device, where the op has its shape-and-dtype kernel as on
CUDA; the CPU, which lacks it, keeps ``F.linear``. The values themselves
are checked on a GPU (``tests/gpu``)."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.linear import Linear, mm_writes_float32

META = torch.device("meta")


def test_the_cpu_has_no_float32_mm_of_16_bit_matrices_and_meta_has() -> None:
    assert not mm_writes_float32(torch.device("cpu"))
    assert mm_writes_float32(META)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_16_bit_float_out_layer_off_the_cpu_writes_float32(dtype, bias) -> None:
    w = torch.empty(40, 8, dtype=dtype, device=META)
    b = torch.empty(40, dtype=dtype, device=META) if bias else None
    head = Linear(w, b, float_out=True)
    assert head.float_mm and not head.uses_panels
    y = head(torch.empty(3, 8, dtype=dtype, device=META))
    assert y.dtype == torch.float32 and y.shape == (3, 40)


def test_other_layers_keep_their_dtype() -> None:
    x = torch.empty(3, 8, dtype=torch.bfloat16, device=META)
    for layer in (
        Linear(torch.empty(40, 8, dtype=torch.bfloat16, device=META)),  # not the LM head
        Linear(torch.empty(40, 8, dtype=torch.float32, device=META), float_out=True),
    ):
        assert not layer.float_mm
    assert Linear(torch.empty(40, 8, dtype=torch.bfloat16, device=META))(x).dtype == torch.bfloat16
    # on the CPU no float32 mm: oneDNN's bf16 sums, re-scored (test_panel_linear.py)
    cpu_head = Linear(torch.randn(40, 8).bfloat16(), float_out=True)
    assert not cpu_head.float_mm and cpu_head.plain is not None

"""The scratch workspace serves callers inside and outside inference mode."""

from __future__ import annotations

import torch

from slipstream.kernels.workspace import Workspace


def test_a_buffer_made_under_inference_mode_is_replaced_outside_it() -> None:
    workspace = Workspace(torch.device("cpu"))
    with torch.inference_mode():
        inside = workspace.view("k", (4, 8), torch.float32)
        inside.fill_(1.0)
    outside = workspace.view("k", (4, 8), torch.float32)
    outside.fill_(2.0)  # raised "Inplace update to inference tensor" before the fix
    assert not outside.is_inference()
    with torch.inference_mode():
        again = workspace.view("k", (4, 8), torch.float32)
        again.fill_(3.0)  # a normal buffer is writable inside inference mode too
    assert again.data_ptr() == outside.data_ptr()

"""Grow-only scratch memory for gathered K/V, reused across layers and steps.

Fresh multi-megabyte allocations page-fault on every touch: gathering the
KV of 256 sequences into new tensors each layer cost 4x more than gathering
into memory that stays mapped. A workspace hands out views of one flat
buffer per role ("k", "v") that only ever grows.

Invariant: a view is valid until the next ``view`` call for the same role;
callers consume gathered K/V before gathering again (one layer at a time).
Not thread-safe: one workspace per thread that runs a model.
"""

from __future__ import annotations

import torch

# Growth headroom so a slowly rising batch does not reallocate every step.
_GROWTH = 1.25


class Workspace:
    """Per-(device, dtype) scratch buffers keyed by role."""

    __slots__ = ("_buffers", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def view(self, role: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` backed by the role's buffer; contents undefined."""
        numel = 1
        for size in shape:
            numel *= size
        key = (role, dtype)
        buffer = self._buffers.get(key)
        # A buffer made under inference mode cannot be written outside it (a
        # model run, then a plain call on the same thread): replace it then.
        stale = (
            buffer is not None and buffer.is_inference() and not torch.is_inference_mode_enabled()
        )
        if buffer is None or buffer.numel() < numel or stale:
            buffer = torch.empty(int(numel * _GROWTH) + 1, dtype=dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)


_DEFAULT: dict[torch.device, Workspace] = {}


def default_workspace(device: torch.device) -> Workspace:
    """The process-wide workspace of ``device`` (the engine thread is its only user)."""
    workspace = _DEFAULT.get(device)
    if workspace is None:
        workspace = _DEFAULT[device] = Workspace(device)
    return workspace

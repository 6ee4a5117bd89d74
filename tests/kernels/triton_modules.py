"""Imports Slipstream's Triton kernel modules with their kernels running in
triton's CPU interpreter.

Triton decides interpreter-or-compiled when a function is decorated: its own
jitted library functions (``tl.sum``, ``tl.zeros``, ...) when ``triton`` is
first imported, Slipstream's kernels when their module is. So
``TRITON_INTERPRET=1`` must be set before anything imports triton, and in a
whole-suite run torch._dynamo does so while pytest collects tests/bench
(through transformers): only the top-level ``tests/conftest.py`` runs early
enough. ``interpreted(name)`` sets the variable (enough when the Triton tests
run alone) and fails with that instruction when triton came first.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import pytest


def interpreted(name: str) -> ModuleType:
    """``slipstream.kernels.<name>``, every ``@triton.jit`` kernel in it interpreted."""
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(tl.sum, JITFunction):
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so its library is "
            "compiled-only; add os.environ.setdefault('TRITON_INTERPRET', '1') to "
            "tests/conftest.py"
        )
    module = importlib.import_module(f"slipstream.kernels.{name}")
    compiled = [k for k, v in vars(module).items() if isinstance(v, JITFunction)]
    if compiled:
        pytest.fail(f"{name} was imported before TRITON_INTERPRET=1: {compiled} are compiled")
    if not any(isinstance(v, InterpretedFunction) for v in vars(module).values()):
        pytest.fail(f"{name} defines no Triton kernel")
    return module


def count_launches(monkeypatch: pytest.MonkeyPatch, kernel: object) -> Callable[[], int]:
    """Counts ``kernel[grid](...)`` launches from now on; returns a reader."""
    launches = 0
    run = kernel.run  # type: ignore[attr-defined]

    def counting_run(*args, **kwargs):
        nonlocal launches
        launches += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counting_run)
    return lambda: launches

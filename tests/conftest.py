"""Shared fixtures: one SLIPSTREAM_HOME per test session, so default models are
created once (deterministically) and every test sees the same files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Set before anything imports the model store.
os.environ.setdefault(
    "SLIPSTREAM_HOME", str(Path(__file__).resolve().parent.parent / ".slipstream-home")
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads this when it is first imported (transformers may import it):
# Triton kernels are tested on CPU tensors through its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from slipstream.service.model_store import resolve_model

    return resolve_model("tiny")


@pytest.fixture(autouse=True)
def _fresh_logging() -> object:
    """Commands run in-process configure logging onto pytest's captured
    streams, which close after the test; start every test from defaults."""
    yield
    import structlog

    structlog.reset_defaults()

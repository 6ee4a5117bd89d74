"""The runner's KV pools: committed at start-up, it says how much and how long."""

from __future__ import annotations

import pytest
import torch

from slipstream.service.engine import runner as runner_module
from slipstream.service.engine.runner import KVPool, ModelRunner, kv_bytes_per_block
from slipstream.service.models.llama import LlamaModel


def _pool_bytes(pool: KVPool) -> int:
    """What the pool's storage holds, counted apart from how it was sized."""
    return sum(t.untyped_storage().nbytes() for pair in pool for t in pair)


class _Lines:
    """Stands in for the module's logger: structlog's loggers are cached on
    first use once configured, so capture_logs would not see them."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **fields: object) -> None:
        self.lines.append((event, fields))


def test_committing_the_pools_logs_their_size_and_time(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = LlamaModel(tiny_model_dir, torch.float32)
    log = _Lines()
    monkeypatch.setattr(runner_module, "log", log)
    runner = ModelRunner(model, 64, 32, 16, commit_kv_memory=True)
    ModelRunner(model, 64, 32, 16)  # lazy: nothing to say
    [(event, fields)] = log.lines
    total = _pool_bytes(runner.device_pool) + _pool_bytes(runner.host_pool)
    assert total == (64 + 32) * kv_bytes_per_block(model, 16)
    assert event == "kv_pools_committed"
    assert fields["gib"] == round(total / 2**30, 2)
    assert isinstance(fields["seconds"], float) and fields["seconds"] >= 0

"""The runner's KV pools: committed at start-up, it says how much and how long."""

from __future__ import annotations

import torch
from structlog.testing import capture_logs

from slipstream.service.engine.runner import ModelRunner, kv_bytes_per_block, pool_bytes
from slipstream.service.models.llama import LlamaModel


def test_committing_the_pools_logs_their_size_and_time(tiny_model_dir) -> None:
    model = LlamaModel(tiny_model_dir, torch.float32)
    with capture_logs() as logs:
        runner = ModelRunner(model, 64, 32, 16, commit_kv_memory=True)
        ModelRunner(model, 64, 32, 16)  # lazy: nothing to say
    [line] = [entry for entry in logs if entry["event"] == "kv_pools_committed"]
    total = pool_bytes(runner.device_pool) + pool_bytes(runner.host_pool)
    assert total == (64 + 32) * kv_bytes_per_block(model, 16)
    assert line["gib"] == round(total / 2**30, 2)
    assert line["seconds"] >= 0

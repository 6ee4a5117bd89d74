"""The offline workload's floor: its work counted by hand on small cases."""

from __future__ import annotations

import pytest

from slipstream.service.bench.roofline import Floor, ModelShape, Rates, Work, workload_work
from slipstream.service.bench.workload import WorkloadRequest

SHAPE = ModelShape(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10)


def test_shape_from_a_transformers_config() -> None:
    config = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
    }
    shape = ModelShape.from_config(config)
    assert shape.head_dim == 64
    # q, k, v: 576 + 2 * 192 rows; o: 576 x 576; gate + up: 3072 x 576; down: 576 x 1536
    per_layer = 960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536
    assert shape.layer_weights == 30 * per_layer
    assert ModelShape.from_config({"text_config": config}) == shape


def test_work_of_a_workload() -> None:
    # per layer: qkv (8 + 2 * 4) x 8 + o 8 x 8 + gate/up 32 x 8 + down 8 x 16 = 576 weights
    assert SHAPE.layer_weights == 2 * 576
    workload = [
        WorkloadRequest(prompt_token_ids=[5, 6, 7], max_tokens=3),
        WorkloadRequest(prompt_token_ids=[5], max_tokens=1),
    ]
    work = workload_work(SHAPE, workload, kv_bytes=4)
    # layers: 3 + 1 prompt tokens, 2 + 0 decode steps; LM head: 4 sampled tokens
    assert work.projection_flop == 2 * (6 * 1152 + 4 * 10 * 8)
    # decode steps attend over 3 + 1 and 3 + 2 positions; K and V, 2 layers, 1 head of 4 floats
    assert work.kv_read_bytes == (4 + 5) * 2 * 2 * 1 * 4 * 4
    # causal prompt attention: 1 + 2 + 3 and 1 positions, 2 heads of 4, 2 layers, 4 flop
    assert work.prefill_attention_flop == 4 * (6 + 1) * 2 * 4 * 2


def test_the_floor_adds_its_parts() -> None:
    work = Work(projection_flop=2e9, kv_read_bytes=3e9, prefill_attention_flop=1e9)
    floor = Floor.of(work, Rates(1e9, "torch", 1e9), output_tokens=12)
    assert floor.wall_s == pytest.approx(2 + 3 + 1)
    assert floor.output_tokens_per_s == pytest.approx(2)
    report = floor.as_dict()
    assert report["matmul_kernel"] == "torch" and report["wall_s"] == pytest.approx(6)
    assert "at most 2.0 output tok/s" in floor.describe()

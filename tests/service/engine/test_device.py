"""Device resolution, description and KV sizing, both branches on any machine
(torch.cuda is patched to show or hide GPUs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slipstream.service.engine import device as device_mod
from slipstream.service.engine.device import (
    DeviceUnavailable,
    cuda_dtype_name,
    default_dtype_for,
    describe_device,
    device_log_line,
    kv_blocks_for_gpu_memory,
    resolve_device,
    step_reserve_bytes,
)


@pytest.fixture
def gpus(monkeypatch):
    """Pretends torch sees ``n`` CUDA devices of compute capability ``cap``."""

    def install(n: int, cap: tuple[int, int] = (9, 0)) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap)
        props = SimpleNamespace(name="Fake H100", major=cap[0], minor=cap[1])
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (60 << 30, 80 << 30))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    return install


def test_auto_is_cpu_without_cuda(gpus):
    gpus(0)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_is_the_first_gpu(gpus):
    gpus(2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("CUDA:1") == torch.device("cuda", 1)


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_one_clear_line(gpus, name):
    gpus(0)
    with pytest.raises(DeviceUnavailable, match="sees no CUDA device") as info:
        resolve_device(name)
    assert "\n" not in str(info.value)


def test_index_past_the_last_gpu(gpus):
    gpus(2)
    with pytest.raises(DeviceUnavailable, match=r"has 2 CUDA devices \(cuda:0 .. cuda:1\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "cuda:-1", ""])
def test_unknown_names(gpus, name):
    gpus(1)
    with pytest.raises(DeviceUnavailable):
        resolve_device(name)


def test_describe_cuda(gpus):
    gpus(1)
    info = describe_device(torch.device("cuda", 0))
    assert info == {
        "type": "cuda",
        "index": 0,
        "name": "Fake H100",
        "total_memory_bytes": 80 << 30,
        "free_memory_bytes": 60 << 30,
        "capability": "9.0",
    }
    assert device_log_line(info) == "device: cuda:0 Fake H100 (compute 9.0, 60.0 of 80.0 GiB free)"


def test_describe_cpu():
    info = describe_device(torch.device("cpu"))
    assert info["type"] == "cpu"
    assert device_log_line(info).startswith("device: cpu")


@pytest.mark.parametrize(("cap", "dtype"), [((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16),
                                            ((7, 5), torch.float16)])  # fmt: skip
def test_default_dtype(gpus, cap, dtype):
    gpus(1, cap)
    assert default_dtype_for(torch.device("cuda", 0)) == dtype


def test_cuda_dtype_name_resolves_auto_and_keeps_an_explicit_dtype(gpus):
    gpus(1, (7, 5))
    assert cuda_dtype_name("auto", torch.device("cuda", 0)) == "float16"
    assert cuda_dtype_name("float32", torch.device("cuda", 0)) == "float32"


def test_default_dtype_is_for_cuda_only():
    with pytest.raises(ValueError, match="CUDA"):
        default_dtype_for(torch.device("cpu"))


def test_kv_blocks_from_free_memory():
    gib = 1 << 30
    assert kv_blocks_for_gpu_memory(10 * gib, 0.9, 1 << 20, gib) == (9 * gib - gib) // (1 << 20)
    assert kv_blocks_for_gpu_memory(gib, 0.5, 1 << 20, gib) == 0  # reserve exceeds the budget
    with pytest.raises(ValueError):
        kv_blocks_for_gpu_memory(gib, 0.0, 1 << 20, 0)
    with pytest.raises(ValueError):
        kv_blocks_for_gpu_memory(gib, 0.9, 0, 0)


def test_step_reserve_grows_with_the_step():
    small = step_reserve_bytes(576, 1536, 49152, 512, 256, 2)
    large = step_reserve_bytes(576, 1536, 49152, 8192, 256, 2)
    assert 0 < small < large


def test_module_reads_cuda_at_call_time(gpus):
    gpus(1)
    assert device_mod._cuda_count() == 1
    gpus(0)
    assert device_mod._cuda_count() == 0


def test_the_step_token_budget_follows_the_device():
    """Unset, a step may run 512 tokens on the CPU and 8192 on a GPU, where a
    step that is not a graphed decode costs ~10 ms of launches whatever its
    size (docs/gpu.md); a set budget holds on either."""
    from slipstream.service.engine.config import EngineConfig

    assert EngineConfig().step_token_budget(on_gpu=False) == 512
    assert EngineConfig().step_token_budget(on_gpu=True) == 8192
    assert EngineConfig(max_num_batched_tokens=1024).step_token_budget(on_gpu=True) == 1024
    assert EngineConfig().scheduler_config(64, 8, 256).max_num_batched_tokens == 512


def test_loading_on_the_cpu_sets_the_cpus_budget(tiny_model_dir):
    from slipstream.service.engine.config import EngineConfig
    from slipstream.service.engine.loader import load_parts

    parts = load_parts(EngineConfig(model=str(tiny_model_dir), device="cpu", policy="fcfs"))
    assert parts.scheduler_config.max_num_batched_tokens == 512


def test_device_info_on_the_wire_says_which_graphs_were_captured():
    from slipstream.service.api.wire import _device_info
    from slipstream.service.engine.cuda_graphs import GraphStats

    decode = GraphStats(True, [1, 2, 4], 1.5, 3 << 20).as_dict()
    pieces = GraphStats(True, [16, 32], 0.5, 1 << 20).as_dict()
    info = _device_info({"type": "cuda", "cuda_graphs": decode, "layer_graphs": pieces})
    assert (info.cuda_graphs, list(info.graph_batch_sizes)) == (True, [1, 2, 4])
    assert list(info.prefill_graph_token_sizes) == [16, 32]
    assert info.prefill_graph_memory_bytes == 1 << 20 and not info.prefill_graphs_disabled_reason
    failed = GraphStats(False, disabled_reason="capture failed: OutOfMemoryError").as_dict()
    info = _device_info({"type": "cuda", "cuda_graphs": decode, "layer_graphs": failed})
    assert not info.prefill_graph_token_sizes
    assert info.prefill_graphs_disabled_reason.startswith("capture failed")

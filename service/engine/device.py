"""Which device the engine runs on, what it is, and how much KV cache it holds.

``--device auto|cpu|cuda|cuda:N`` is resolved once at start-up
(``resolve_device``); a CUDA request on a machine without one, or an index
past the last GPU, is a ``DeviceUnavailable`` whose message is one log line.
``describe_device`` gives the start-up log line and ``GetModelInfo`` their
facts; ``kv_blocks_for_gpu_memory`` sizes the device KV pool from the memory
left once the weights are loaded.

Hardware is asked, never assumed: every answer comes from ``torch.cuda`` at
call time, so tests force either branch by patching it.
"""

from __future__ import annotations

import platform
from typing import Any

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DEFAULT_GPU_MEMORY_FRACTION = 0.9


class DeviceUnavailable(ValueError):
    """The requested device does not exist on this machine (one log line)."""


def resolve_device(requested: str) -> torch.device:
    """``auto`` is the first CUDA device when torch sees one, else the CPU;
    ``cuda`` is ``cuda:0``; ``cuda:N`` must name an existing GPU."""
    name = requested.strip().lower()
    if name == "auto":
        return torch.device("cuda", 0) if _cuda_count() > 0 else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda" and not name.startswith("cuda:"):
        raise DeviceUnavailable(f"unknown device {requested!r}; choose auto, cpu, cuda or cuda:N")
    index = 0
    if name.startswith("cuda:"):
        suffix = name.removeprefix("cuda:")
        if not suffix.isdigit():
            raise DeviceUnavailable(f"bad CUDA device {requested!r}; expected cuda:N, N >= 0")
        index = int(suffix)
    count = _cuda_count()
    if count == 0:
        raise DeviceUnavailable(
            f"device {requested!r} asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'})"
        )
    if index >= count:
        raise DeviceUnavailable(
            f"device {requested!r} asked for, but this machine has {count} CUDA "
            f"device{'s' if count != 1 else ''} (cuda:0 .. cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def _cuda_count() -> int:
    """Visible CUDA devices; 0 when torch has no CUDA or no driver answers."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def describe_device(device: torch.device) -> dict[str, Any]:
    """Facts for the start-up log and ``GetModelInfo``: ``type``, ``name``, and on
    CUDA ``index``, ``total_memory_bytes``, ``free_memory_bytes`` and
    ``capability`` ("9.0")."""
    if device.type != "cuda":
        return {"type": device.type, "name": platform.processor() or platform.machine()}
    index = _index(device)
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return {
        "type": "cuda",
        "index": index,
        "name": props.name,
        "total_memory_bytes": int(total),
        "free_memory_bytes": int(free),
        "capability": f"{props.major}.{props.minor}",
    }


def device_log_line(info: dict[str, Any]) -> str:
    """``describe_device``'s facts as the one start-up line."""
    if info["type"] != "cuda":
        return f"device: cpu ({info['name']})"
    gib = 1 << 30
    return (
        f"device: cuda:{info['index']} {info['name']} (compute {info['capability']}, "
        f"{info['free_memory_bytes'] / gib:.1f} of {info['total_memory_bytes'] / gib:.1f} GiB free)"
    )


def default_dtype_for(device: torch.device) -> torch.dtype:
    """The weight/KV dtype a CUDA device runs best: bfloat16 from compute
    capability 8.0 (Ampere) on, float16 before it. An explicit ``--dtype``
    wins; the CPU's choice is ``kernels.cpu_features.choose_dtype``'s, not this."""
    if device.type != "cuda":
        raise ValueError(f"default_dtype_for picks CUDA dtypes; got a {device.type!r} device")
    major, _ = torch.cuda.get_device_capability(_index(device))
    return torch.bfloat16 if major >= 8 else torch.float16


def cuda_dtype_name(requested: str, device: torch.device) -> str:
    """What ``--dtype`` (``auto`` or a torch dtype's name) runs as on a CUDA
    ``device``: ``auto`` is ``default_dtype_for``'s, a name is itself."""
    if requested != "auto":
        return requested
    return str(default_dtype_for(device)).removeprefix("torch.")


def kv_blocks_for_gpu_memory(
    free_bytes: int, fraction: float, bytes_per_block: int, reserve: int
) -> int:
    """Device KV blocks that fit in ``fraction`` of ``free_bytes`` (the GPU's free
    memory measured after the weights are loaded) once ``reserve`` bytes are set
    aside for activations, the sampler and the CUDA-graph pool
    (see ``step_reserve_bytes``). Never negative."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"gpu memory fraction must be in (0, 1], got {fraction}")
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    budget = int(free_bytes * fraction) - reserve
    return max(budget // bytes_per_block, 0)


def step_reserve_bytes(
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    max_num_tokens: int,
    max_num_seqs: int,
    element_size: int,
    graph_pool_bytes: int = 256 << 20,
) -> int:
    """A bound on what one step allocates beside the weights and the KV pool:
    the widest per-token activations live at once (residual, qkv, gate/up and
    the MLP's product, in the model's dtype) for ``max_num_tokens`` tokens,
    the sampler's float32 ``[max_num_seqs, vocab]`` work (logits, probs, noise,
    sorted copy, sort indices), and the graph pool (a measured figure beats
    the default)."""
    per_token = (4 * hidden_size + 3 * intermediate_size) * element_size
    sampler = max_num_seqs * vocab_size * (4 * 4 + 8)
    return max_num_tokens * per_token + sampler + graph_pool_bytes


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()

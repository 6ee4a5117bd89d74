"""Builds an engine from its config: the device, the model and its kernels, the
KV pools, the runner, the cost-model calibration and the scheduler.

    config ──load_parts──▶ EngineParts(model, runner, tokenizer, info,
                                       scheduler_config, cost_model)
           ──load_engine─▶ Engine(Scheduler(...), runner, tokenizer, info)

``Engine`` only runs the step loop; everything that depends on the machine is
decided here, once, and said in the start-up log lines. Benchmarks that need
the runner or their own scheduler take the parts and compose them.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from slipstream.kernels import fused_ops, linear
from slipstream.kernels.backend import resolve_backend
from slipstream.kernels.compute_thread import on_own_thread
from slipstream.kernels.cpu_features import CpuFeatures, DtypeChoice, choose_dtype, detect
from slipstream.scheduler.config import SchedulerConfig
from slipstream.scheduler.cost_model import CostCoefficients, CostModel
from slipstream.scheduler.policy_registry import DEFAULT_POLICY
from slipstream.scheduler.scheduler import Scheduler
from slipstream.service.engine.calibration import calibrate_cached
from slipstream.service.engine.chat import has_chat_template
from slipstream.service.engine.config import SPECULATIVE_ON_CUDA, EngineConfig
from slipstream.service.engine.device import (
    cuda_dtype_name,
    describe_device,
    device_log_line,
    kv_blocks_for_gpu_memory,
    resolve_device,
    step_reserve_bytes,
)
from slipstream.service.engine.engine import Engine
from slipstream.service.engine.events import ModelInfo
from slipstream.service.engine.runner import ModelRunner, kv_bytes_per_block
from slipstream.service.models.llama import LlamaModel
from slipstream.service.models.store import resolve_model, slipstream_home

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineParts:
    """What ``load_engine`` composes; a benchmark may compose them otherwise."""

    model: LlamaModel
    runner: Any  # ModelRunner on the CPU, DeviceRunner on CUDA: execute(plan) -> StepResult
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo
    scheduler_config: SchedulerConfig
    cost_model: CostModel | None  # None: the policy needs none (not "deadline")
    plan_ahead: bool = False  # plan step N+1 while the device runs step N

    def scheduler(self) -> Scheduler:
        return Scheduler(self.scheduler_config, cost_model=self.cost_model)


def load_engine(config: EngineConfig, cpu: CpuFeatures | None = None) -> Engine:
    """``cpu`` overrides the detected CPU features (tests force either answer)."""
    parts = load_parts(config, cpu)
    return Engine(
        parts.scheduler(), parts.runner, parts.tokenizer, parts.info, plan_ahead=parts.plan_ahead
    )


def load_parts(config: EngineConfig, cpu: CpuFeatures | None = None) -> EngineParts:
    config.check()
    device = resolve_device(config.device)
    log.info("device", line=device_log_line(describe_device(device)))
    budget = config.step_token_budget(on_gpu=device.type == "cuda")
    config = dataclasses.replace(config, max_num_batched_tokens=budget)
    if device.type == "cuda":
        return _load_on_cuda(config, device)
    features = cpu or detect()
    # Not on the caller's thread: see compute_thread.py.
    return on_own_thread(lambda: _load_on_cpu(config, features), "slipstream-load")


def _load_on_cpu(config: EngineConfig, cpu: CpuFeatures) -> EngineParts:
    choice = choose_dtype(config.dtype, cpu)
    log.info(
        "cpu_features",
        cpu=cpu.model_name,
        flags=",".join(cpu.flags),
        torch_capability=cpu.torch_capability,
        dtype=choice.dtype,
        requested_dtype=choice.requested,
        weights_packed=choice.pack_weights,
    )
    if choice.warning:
        log.warning("slow_dtype", dtype=choice.dtype, reason=choice.warning)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir, backend, fused, panels = _model_and_kernels(config)
    int8_kv = config.kv_cache_dtype == "int8"
    if int8_kv and backend == "triton":
        raise ValueError("--kv-cache-dtype int8 needs the cpu or torch attention backend")
    model = LlamaModel(
        model_dir,
        DTYPES[choice.dtype],
        backend,
        choice.pack_weights,
        fused=fused,
        panel_linears=panels,
        kv_dtype=torch.int8 if int8_kv else None,
    )
    max_model_len = _max_model_len(config, model)
    num_device_blocks, num_host_blocks = _pool_sizes(config, model, max_model_len)
    runner = ModelRunner(
        model, num_device_blocks, num_host_blocks, config.block_size, config.commit_kv_memory
    )
    identity = {
        **_step_cost_identity(model_dir, choice, backend, fused, panels, cpu),
        "kv_cache_dtype": config.kv_cache_dtype,
        "native_layers": model.native_layers,
    }
    return _finish(
        config,
        model,
        runner,
        model_dir,
        (num_device_blocks, num_host_blocks, max_model_len),
        identity,
        {
            "dtype": choice.dtype,
            "requested_dtype": choice.requested,
            "weights_packed": choice.pack_weights,
            "attention_backend": backend,
            "kv_cache_dtype": "int8" if int8_kv else choice.dtype,
            "cpu": cpu.describe(),
            "compiled": fused,
            "device": describe_device(torch.device("cpu")),
        },
        panel_linears=model.panel_linears
        and (choice.dtype == "float32" or linear.bf16_panels_available()),
    )


def _load_on_cuda(config: EngineConfig, device: torch.device) -> EngineParts:
    # Imported here: the CUDA runner's modules are needed on a GPU only.
    from slipstream.service.engine.cuda_runner import DeviceRunner, move_model_to
    from slipstream.service.engine.layer_graphs import layer_graph_bytes

    if config.speculative_tokens:  # --device auto found a GPU
        raise ValueError(SPECULATIVE_ON_CUDA)
    if config.kv_cache_dtype != "auto":
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype} runs on the CPU only; "
            "on CUDA the KV cache takes the model's dtype (--kv-cache-dtype auto)"
        )
    dtype_name = cuda_dtype_name(config.dtype, device)
    dtype = DTYPES[dtype_name]
    backend = resolve_backend(config.attention_backend, device, home=slipstream_home())
    model_dir = resolve_model(config.model)
    model = LlamaModel(model_dir, dtype, backend, False, fused=False, panel_linears=False)
    move_model_to(model, device)
    max_model_len = _max_model_len(config, model)
    cfg = model.config
    per_block = kv_bytes_per_block(model, config.block_size)
    free_bytes, _ = torch.cuda.mem_get_info(device)
    reserve = step_reserve_bytes(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.vocab_size,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        torch.empty((), dtype=dtype).element_size(),
    ) + layer_graph_bytes(
        model,
        min(config.prefill_graph_tokens, config.max_num_batched_tokens),
        config.max_num_seqs,
    )
    device_blocks = config.num_device_blocks or kv_blocks_for_gpu_memory(
        free_bytes, config.gpu_memory_fraction, per_block, reserve
    )
    host_blocks = (
        config.num_host_blocks
        if config.num_host_blocks is not None
        else int(config.kv_cache_memory_gb * 2**30) // per_block
    )
    runner = DeviceRunner(
        model,
        device_blocks,
        host_blocks,
        config.block_size,
        device=device,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        use_cuda_graphs=config.cuda_graphs,
        fused_elementwise=config.gpu_fused_elementwise,
        prefill_graph_tokens=config.prefill_graph_tokens,
        seed=config.seed,
    )
    log.info(
        "cuda_graphs",
        decode=runner.graph_stats.log_line("batch sizes"),
        prefill=runner.layer_graph_stats.log_line("token counts"),
    )
    identity = {
        "model": str(model_dir),
        "dtype": dtype_name,
        "attention_backend": backend,
        "device": describe_device(device)["name"],
        "torch": torch.__version__,
    }
    return _finish(
        config,
        model,
        runner,
        model_dir,
        (device_blocks, host_blocks, max_model_len),
        identity,
        {
            "dtype": dtype_name,
            "requested_dtype": config.dtype,
            "weights_packed": False,
            "attention_backend": backend,
            "kv_cache_dtype": dtype_name,
            "compiled": False,
            "device": {**describe_device(device), **runner.info()},
        },
        panel_linears=False,
    )


def _finish(
    config: EngineConfig,
    model: LlamaModel,
    runner: Any,
    model_dir: Path,
    sizes: tuple[int, int, int],
    identity: dict[str, object],
    facts: dict[str, Any],
    *,
    panel_linears: bool,
) -> EngineParts:
    """The parts every device shares: calibration, scheduler config, tokenizer, info."""
    num_device_blocks, num_host_blocks, max_model_len = sizes
    max_model_len = _held_to_the_pool(max_model_len, num_device_blocks, config.block_size)
    # The deadline policy estimates service times from measured step costs;
    # calibrate on the real runner while the pools are still empty.
    cost_model = None
    if config.policy == DEFAULT_POLICY:
        cost_model = (
            calibrate_cached(
                runner,
                config.max_num_batched_tokens,
                config.max_num_seqs,
                slipstream_home() / "cache" / "calibration",
                identity,
            )
            if config.calibrate_cost_model
            else CostModel(CostCoefficients(), max_drift=None)  # a guess, not a calibration
        )
    scheduler_config = config.scheduler_config(num_device_blocks, num_host_blocks, max_model_len)
    on_gpu = facts["device"]["type"] == "cuda"
    plan_ahead = on_gpu if config.plan_ahead is None else config.plan_ahead
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info = ModelInfo(
        name=config.model,
        path=str(model_dir),
        architecture=model.config.model_type,
        max_model_len=max_model_len,
        vocab_size=model.config.vocab_size,
        block_size=config.block_size,
        eos_token_ids=_eos_token_ids(model_dir, model.config.eos_token_ids),
        kv_bytes_per_block=kv_bytes_per_block(model, config.block_size),
        has_chat_template=has_chat_template(tokenizer),
        **facts,
    )
    log.info(
        "engine_ready",
        model=str(model_dir),
        dtype=info.dtype,
        device_blocks=num_device_blocks,
        host_blocks=num_host_blocks,
        block_size=config.block_size,
        max_model_len=max_model_len,
        attention_backend=info.attention_backend,
        kv_cache_dtype=info.kv_cache_dtype,
        compiled=info.compiled,
        panel_linears=panel_linears,
        prefix_cache=config.prefix_cache,
        kv_memory="commit" if config.commit_kv_memory else "lazy",
        plan_ahead=plan_ahead,
    )
    return EngineParts(model, runner, tokenizer, info, scheduler_config, cost_model, plan_ahead)


def _max_model_len(config: EngineConfig, model: LlamaModel) -> int:
    """``--max-model-len``, or the model's context; a longer one than the
    model's is cut to it, and the log says so."""
    limit = model.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        log.warning(
            "max_model_len_above_the_model",
            requested=config.max_model_len,
            max_model_len=limit,
            detail="the model's positions end there; requests are held to it",
        )
    return min(config.max_model_len or limit, limit)


def _held_to_the_pool(max_model_len: int, num_device_blocks: int, block_size: int) -> int:
    """A context longer than the device KV pool holds is cut to what it
    holds (a longer request could never run), so the model info clients
    size requests by says what fits; the log says so."""
    pool_tokens = num_device_blocks * block_size
    if pool_tokens >= max_model_len:
        return max_model_len
    log.warning(
        "max_model_len_above_the_pool",
        requested=max_model_len,
        max_model_len=pool_tokens,
        detail="the device KV pool holds that many tokens; requests are held to it",
    )
    return pool_tokens


def _pool_sizes(config: EngineConfig, model: LlamaModel, max_model_len: int) -> tuple[int, int]:
    blocks_per_seq = -(-max_model_len // config.block_size)
    by_memory = int(config.kv_cache_memory_gb * 2**30) // kv_bytes_per_block(
        model, config.block_size
    )
    device = config.num_device_blocks or max(
        blocks_per_seq, min(by_memory, config.max_num_seqs * blocks_per_seq)
    )
    if not config.num_device_blocks and by_memory < blocks_per_seq:
        log.warning(
            "kv_cache_raised_to_one_sequence",
            kv_cache_gb=config.kv_cache_memory_gb,
            blocks=device,
            detail="--kv-cache-gb holds less than one full-length sequence; the pool is "
            "raised to one (lower --max-model-len to keep it smaller)",
        )
    host = config.num_host_blocks if config.num_host_blocks is not None else device // 2
    return device, host


def _eos_token_ids(model_dir: Path, fallback: tuple[int, ...]) -> list[int]:
    gen_config = model_dir / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    return list(fallback)


def _model_and_kernels(config: EngineConfig) -> tuple[Path, str, bool, bool]:
    """The checkpoint directory, the attention backend and whether the fused
    step kernels and the panel projections load. On a first start all of them
    can be slow and none needs another (a GGUF conversion in Python, C++
    builds in compiler processes, each under its own lock), so they overlap.
    A model that cannot be resolved is reported once the builds end; they are
    cached either way."""
    home = slipstream_home()
    with ThreadPoolExecutor(2, thread_name_prefix="slipstream-build") as pool:
        backend = pool.submit(
            resolve_backend, config.attention_backend, torch.device("cpu"), home=home
        )
        fused = pool.submit(fused_ops.is_available, home) if config.compile else None
        panels = pool.submit(linear.panels_available, home) if config.compile else None
        model_dir = resolve_model(config.model)
        return (
            model_dir,
            backend.result(),
            fused is not None and fused.result(),
            panels is not None and panels.result(),
        )


def _step_cost_identity(
    model_dir: Path,
    choice: DtypeChoice,
    backend: str,
    fused: bool,
    panels: bool,
    cpu: CpuFeatures,
) -> dict[str, object]:
    """What a step's time depends on besides the plan: the key of a cached
    calibration. Weight files are named with their size and mtime, so a
    checkpoint rewritten in place is measured again."""
    weights = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.glob("*.safetensors")
    )
    return {
        "model": str(model_dir),
        "weights": weights,
        "dtype": choice.dtype,
        "weights_packed": choice.pack_weights,
        "attention_backend": backend,
        "compiled": fused,
        "panel_linears": panels,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": cpu.describe(),
    }

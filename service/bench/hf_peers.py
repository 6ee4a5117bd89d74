"""The peers Slipstream is measured against: Hugging Face transformers'
static batching (``model.generate`` on left-padded batches) and its own
continuous batching (``ContinuousBatchingManager``).

Both ignore EOS so every request makes exactly its ``max_tokens``; both load
the model with the same dtype and run on the process's torch thread count,
which the caller sets once. Each run starts with a short untimed warm-up.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints
from transformers.generation.streamers import BaseStreamer

from slipstream.service.bench.report import EngineRun, RequestTiming
from slipstream.service.bench.workload import WARMUP_WORKLOAD, WorkloadRequest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class CBSettings:
    """Knobs of transformers' continuous batching; ``None`` is per device
    (``for_device``). On a 2-core CPU a 64-token page and 512 tokens per step
    beat its own defaults (a 256-token page and 8,192 tokens per step build
    huge attention masks); ``sdpa`` is its fastest CPU attention; a flash
    switch does not exist there. On a GPU its own page and step sizes, and its
    CUDA graphs on (its heuristic leaves them off under ``sdpa``).
    ``num_blocks`` of ``None`` sizes the cache to hold every request of the
    workload at once (no eviction)."""

    attn_implementation: str = "sdpa"
    page_size: int | None = None
    max_batch_tokens: int | None = None
    num_blocks: int | None = None
    max_requests_per_batch: int | None = None
    use_cuda_graph: bool | None = None

    def for_device(self, device: str) -> CBSettings:
        """These settings with every ``None`` knob given its value on ``device``
        (a page size or step size left ``None`` on a GPU: transformers' own)."""
        if device.startswith("cuda"):
            graphs = True if self.use_cuda_graph is None else self.use_cuda_graph
            return dataclasses.replace(self, use_cuda_graph=graphs)
        return dataclasses.replace(
            self,
            page_size=64 if self.page_size is None else self.page_size,
            max_batch_tokens=512 if self.max_batch_tokens is None else self.max_batch_tokens,
            use_cuda_graph=False,
        )


def load_hf_model(
    model_dir: str, dtype: str, attn_implementation: str = "sdpa", device: str = "cpu"
) -> PreTrainedModel:
    """The model on ``device`` in eval mode with its EOS removed from its
    generation config, so ``generate`` never stops a row early."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=_torch_dtype(dtype), attn_implementation=attn_implementation
    ).to(device)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def run_hf_static(
    model_dir: str,
    workload: Sequence[WorkloadRequest],
    dtype: str,
    batch_size: int = 16,
    attn_implementation: str = "sdpa",
    device: str = "cpu",
) -> EngineRun:
    """Batches of ``batch_size`` in workload order, one after another; every
    batch runs until its longest member's ``max_tokens``. A request's result
    is complete when its batch returns; its first token comes with its
    batch's first decode step."""
    model = load_hf_model(model_dir, dtype, attn_implementation, device)
    pad_id = _pad_token_id(model)
    batches = [list(workload[i : i + batch_size]) for i in range(0, len(workload), batch_size)]
    _generate_static(model, WARMUP_WORKLOAD, pad_id)
    timings: list[RequestTiming] = []
    t0 = time.perf_counter()
    for batch in batches:
        first_token_time = _generate_static(model, batch, pad_id)
        done = time.perf_counter() - t0
        ttft = first_token_time - t0
        timings.extend(RequestTiming(r.max_tokens, done, ttft) for r in batch)
    wall_s = time.perf_counter() - t0
    settings = {
        "dtype": dtype,
        "num_threads": torch.get_num_threads(),
        "batch_size": batch_size,
        "device": device,
        "padding": "left",
        "batch_order": "workload order",
        "attn_implementation": attn_implementation,
        "eos": "disabled (eos_token_id=None)",
    }
    return EngineRun("hf_static", wall_s, timings, settings)


def run_hf_cb(
    model_dir: str,
    workload: Sequence[WorkloadRequest],
    dtype: str,
    settings: CBSettings | None = None,
    device: str = "cpu",
) -> EngineRun:
    """Every request submitted at ``t0`` to one manager; latency is each
    request's in-engine finish stamp, TTFT its first token's stamp."""
    settings = (settings or CBSettings()).for_device(device)
    model = load_hf_model(model_dir, dtype, settings.attn_implementation, device)
    cb_config = _cb_config(settings, workload)
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, eos_token_id=-1),
        continuous_batching_config=cb_config,
        workload_hints=_workload_hints(workload),
    )
    manager.start()
    try:
        _run_cb_requests(manager, WARMUP_WORKLOAD, "warmup")
        t0 = time.perf_counter()
        timings = _run_cb_requests(manager, workload, "req", t0)
        wall_s = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
        manager.destroy()
    resolved = manager.continuous_batching_config
    return EngineRun(
        "hf_cb",
        wall_s,
        timings,
        {
            "dtype": dtype,
            "num_threads": torch.get_num_threads(),
            "device": device,
            "attn_implementation": settings.attn_implementation,
            "page_size": getattr(resolved, _PAGE_FIELD),
            "max_batch_tokens": resolved.max_batch_tokens,
            "num_blocks": resolved.num_blocks,
            "max_requests_per_batch": resolved.max_requests_per_batch,
            "cuda_graphs": settings.use_cuda_graph,
            "eos": "disabled (eos_token_id=-1)",
        },
    )


class _FirstTokenClock(BaseStreamer):
    """Stamps the first generated token: ``generate`` hands a streamer the
    prompt first, then each step's new tokens."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_time: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


@torch.inference_mode()
def _generate_static(
    model: PreTrainedModel, batch: Sequence[WorkloadRequest], pad_id: int
) -> float:
    """Run one left-padded batch; returns the time its first token was made.
    Raises if ``generate`` stopped before the longest member's length."""
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, req in enumerate(batch):
        n = len(req.prompt_token_ids)
        input_ids[row, width - n :] = torch.tensor(req.prompt_token_ids)
        attention_mask[row, width - n :] = 1
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    max_new_tokens = max(r.max_tokens for r in batch)
    clock = _FirstTokenClock()
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        streamer=clock,
    )
    made = output.shape[1] - width
    if made != max_new_tokens or clock.first_token_time is None:
        raise RuntimeError(f"static batch made {made} tokens per row, expected {max_new_tokens}")
    return clock.first_token_time


def _run_cb_requests(
    manager: object, workload: Sequence[WorkloadRequest], prefix: str, t0: float | None = None
) -> list[RequestTiming]:
    """Submit all of ``workload`` and wait for every result. Raises if a
    request failed or made a different number of tokens than asked."""
    start = time.perf_counter() if t0 is None else t0
    ids = [f"{prefix}-{i}" for i in range(len(workload))]
    for req_id, req in zip(ids, workload, strict=True):
        manager.add_request(  # type: ignore[attr-defined]
            req.prompt_token_ids,
            request_id=req_id,
            max_new_tokens=req.max_tokens,
            record_timestamps=True,
            eos_token_id=-1,
        )
    results = _collect_cb_results(manager, set(ids))
    timings = []
    for req_id, req in zip(ids, workload, strict=True):
        out = results[req_id]
        if out.error is not None or len(out.generated_tokens) != req.max_tokens:
            raise RuntimeError(
                f"hf_cb {req_id}: {len(out.generated_tokens)} tokens for {req.max_tokens} "
                f"(error: {out.error})"
            )
        ttft = out.timestamps[0] - start if out.timestamps else None
        timings.append(RequestTiming(len(out.generated_tokens), out.lifespan[1] - start, ttft))
    return timings


def _collect_cb_results(manager: object, pending: set[str]) -> dict[str, object]:
    results: dict[str, object] = {}
    while pending:
        out = manager.get_result(timeout=1.0)  # type: ignore[attr-defined]
        if out is None:
            if not manager.is_running():  # type: ignore[attr-defined]
                raise RuntimeError(f"transformers' batching thread died; {len(pending)} pending")
            continue
        if out.is_finished() and out.request_id in pending:
            pending.discard(out.request_id)
            results[out.request_id] = out
    return results


# transformers up to 5.17 names a KV page ``block_size``, later ``page_size``.
_CB_FIELDS = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
_PAGE_FIELD = "page_size" if "page_size" in _CB_FIELDS else "block_size"


def _cb_config(
    settings: CBSettings, workload: Sequence[WorkloadRequest]
) -> ContinuousBatchingConfig:
    page_size = settings.page_size or getattr(ContinuousBatchingConfig(), _PAGE_FIELD)
    num_blocks = settings.num_blocks or _blocks_for(workload, page_size)
    options = {
        _PAGE_FIELD: page_size,
        "max_batch_tokens": settings.max_batch_tokens,
        "num_blocks": num_blocks,
        "max_requests_per_batch": settings.max_requests_per_batch,
        "auto_switch_to_flash": False,  # not in every version: dropped where absent
        "use_cuda_graph": settings.use_cuda_graph,
        "seed": 0,
    }
    return ContinuousBatchingConfig(**{k: v for k, v in options.items() if k in _CB_FIELDS})


def _blocks_for(workload: Sequence[WorkloadRequest], page_size: int) -> int:
    """Enough pages for every request (and the warm-up) at full length at once."""
    everything = [*workload, *WARMUP_WORKLOAD]
    pages = sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / page_size) for r in everything)
    return pages + len(everything)


def _workload_hints(workload: Sequence[WorkloadRequest]) -> WorkloadHints:
    return WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in workload),
        max_generated_length=max(r.max_tokens for r in workload),
        num_requests=len(workload),
    )


def _pad_token_id(model: PreTrainedModel) -> int:
    for source in (model.generation_config, model.config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]

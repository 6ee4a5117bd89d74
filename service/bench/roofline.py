"""The fastest an offline workload could run on this CPU: its unavoidable
work (matrix multiplies of the projections and the LM head, K/V reads of the
decode steps, prefill attention) at rates measured on this machine in the
same run (the best dense matmul rate on the model's own projection shapes,
and the read bandwidth of one large buffer). Everything else — elementwise
work, scheduling, the host — is counted as free, so no engine of the same
precision can run the workload faster than this floor; the ratio of an
engine's throughput to it says how much is left to win on the machine at
hand.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from slipstream.service.bench.workload import WorkloadRequest

# Rows per timed matmul: prefill chunks of this size run at the CPU's best rate.
RATE_ROWS = 512
READ_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of a Llama-family decoder that its work depends on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, object]) -> ModelShape:
        text = config.get("text_config", config)
        assert isinstance(text, dict)
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        return cls(
            hidden=hidden,
            intermediate=int(text["intermediate_size"]),
            layers=int(text["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab=int(text["vocab_size"]),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelShape:
        return cls.from_config(json.loads(Path(model_dir, "config.json").read_text("utf-8")))

    def projection_shapes(self) -> list[tuple[int, int]]:
        """``(out_features, in_features)`` of one layer's projections
        (q, k, v fused; gate and up fused)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [
            (q + 2 * kv, self.hidden),
            (self.hidden, q),
            (2 * self.intermediate, self.hidden),
            (self.hidden, self.intermediate),
        ]

    @property
    def layer_weights(self) -> int:
        """Weights every token meets in the decoder layers (all layers)."""
        return self.layers * sum(n * k for n, k in self.projection_shapes())


@dataclass(frozen=True, slots=True)
class Work:
    """What a workload costs, whatever engine runs it."""

    projection_flop: float  # decoder layers for every computed token + the LM head per sampled one
    kv_read_bytes: float  # K and V every decode step's attention must read
    prefill_attention_flop: float  # causal QK^T and PV over every prompt


def workload_work(shape: ModelShape, workload: Sequence[WorkloadRequest], kv_bytes: int) -> Work:
    """The work of running every request of ``workload`` to its ``max_tokens``
    once (no prefix reuse), K/V elements of ``kv_bytes`` each.

    A request's prompt runs through the layers once; each output token after
    the first is one decode step over a context of prompt + tokens so far;
    every output token costs one LM-head row.
    """
    prompt = sum(len(r.prompt_token_ids) for r in workload)
    output = sum(r.max_tokens for r in workload)
    decode_steps = sum(max(r.max_tokens - 1, 0) for r in workload)
    projections = 2.0 * (
        (prompt + decode_steps) * shape.layer_weights + output * shape.vocab * shape.hidden
    )
    kv_per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * kv_bytes
    contexts = 0
    attention = 0.0
    for r in workload:
        n, steps = len(r.prompt_token_ids), max(r.max_tokens - 1, 0)
        # decode step i (1-based) attends over n + i positions
        contexts += steps * n + steps * (steps + 1) // 2
        # causal: position j attends over j + 1 positions; 2 matmuls x 2 flop
        attention += 4.0 * (n * (n + 1) / 2) * shape.heads * shape.head_dim * shape.layers
    return Work(projections, float(contexts * kv_per_token), attention)


@dataclass(frozen=True, slots=True)
class Rates:
    """Measured on this machine, in this process, with its torch thread count."""

    matmul_flop_per_s: float
    matmul_kernel: str
    read_bytes_per_s: float


def measure_rates(shape: ModelShape, dtype_name: str, repeats: int = 5) -> Rates:
    """The best of torch's matmul, oneDNN's packed weights (where this CPU
    packs the dtype, as the engine then does) and (for float32, where it runs)
    the panel kernel over one layer's projections at ``RATE_ROWS`` rows; the read rate
    of summing one ``READ_BYTES`` buffer. The fastest of ``repeats`` (a floor
    is what the machine can do: on a shared machine a median drifts with
    whatever else runs, and a floor slower than the engine is no floor)."""
    import torch
    import torch.nn.functional as F

    from slipstream.kernels import linear
    from slipstream.kernels.cpu_features import choose_dtype, detect
    from slipstream.service.bench.step_timing import read_floor_ms

    dtype = getattr(torch, dtype_name)
    weights = [torch.randn(n, k).to(dtype) for n, k in shape.projection_shapes()]
    inputs = {k: torch.randn(RATE_ROWS, k).to(dtype) for _, k in shape.projection_shapes()}
    flop = 2.0 * RATE_ROWS * sum(w.numel() for w in weights)
    candidates = {"torch": [lambda x, w=w: F.linear(x, w) for w in weights]}
    if choose_dtype(dtype_name, detect()).pack_weights:  # the engine's own decision
        candidates["packed"] = [linear.Linear(w, pack=True) for w in weights]
    if dtype == torch.float32 and linear.panels_available():
        candidates["panel"] = [linear.Linear(w, panels=True) for w in weights]
    best_rate, best_name = 0.0, ""
    for name, layer in candidates.items():
        seconds = _fastest_seconds(
            lambda layer=layer: [
                f(inputs[w.shape[1]]) for f, w in zip(layer, weights, strict=True)
            ],
            repeats,
        )
        if flop / seconds > best_rate:
            best_rate, best_name = flop / seconds, name
    read_s = read_floor_ms(READ_BYTES, torch.float32, repeats, statistic=min) / 1e3
    return Rates(best_rate, best_name, READ_BYTES / read_s)


def _fastest_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass(frozen=True, slots=True)
class Floor:
    """The floor's parts, in seconds, and the output tokens/s it allows."""

    work: Work
    rates: Rates
    projections_s: float
    kv_read_s: float
    prefill_attention_s: float
    output_tokens: int

    @classmethod
    def of(cls, work: Work, rates: Rates, output_tokens: int) -> Floor:
        return cls(
            work=work,
            rates=rates,
            projections_s=work.projection_flop / rates.matmul_flop_per_s,
            kv_read_s=work.kv_read_bytes / rates.read_bytes_per_s,
            prefill_attention_s=work.prefill_attention_flop / rates.matmul_flop_per_s,
            output_tokens=output_tokens,
        )

    @property
    def wall_s(self) -> float:
        return self.projections_s + self.kv_read_s + self.prefill_attention_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self.work),
            **asdict(self.rates),
            "projections_s": self.projections_s,
            "kv_read_s": self.kv_read_s,
            "prefill_attention_s": self.prefill_attention_s,
            "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens_per_s,
        }

    def describe(self) -> str:
        """One line for the console."""
        work, rates = self.work, self.rates
        return (
            f"floor on this CPU: at most {self.output_tokens_per_s:.1f} output tok/s "
            f"({self.wall_s:.2f} s = projections {work.projection_flop / 1e12:.2f} TFLOP at "
            f"{rates.matmul_flop_per_s / 1e9:.0f} GFLOP/s ({rates.matmul_kernel}) "
            f"{self.projections_s:.2f} s + K/V reads {work.kv_read_bytes / 1e9:.1f} GB at "
            f"{rates.read_bytes_per_s / 1e9:.1f} GB/s {self.kv_read_s:.2f} s + prefill attention "
            f"{self.prefill_attention_s:.2f} s)"
        )

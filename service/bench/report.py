"""What one engine's benchmark run measured, and how runs turn into the
report's numbers and table.

Every time is in seconds from ``t0``, the moment all requests were submitted
at once. A request's latency is when its result was complete; its TTFT is
when its first output token was made.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request's outcome, in workload order."""

    num_output_tokens: int
    latency_s: float
    ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineRun:
    """One timed run of one engine over the whole workload. ``settings``
    records every knob that shaped the run (JSON-serialisable values)."""

    engine: str
    wall_s: float
    timings: list[RequestTiming]
    settings: dict[str, object] = field(default_factory=dict)


class TokenCountMismatch(RuntimeError):
    """An engine made a different number of tokens than the workload asked
    for: its throughput would not be comparable."""


def hardware(requested_dtype: str, device: str = "cpu") -> dict[str, object]:
    """The CPU a benchmark ran on, the device its engines ran on (``--device``
    as resolved: the GPU's name and memory on CUDA) and the dtype
    ``requested_dtype`` resolved to there."""
    from slipstream.kernels.cpu_features import choose_dtype, detect
    from slipstream.service.engine.device import cuda_dtype_name, describe_device, resolve_device

    cpu = detect()
    where = resolve_device(device)
    if where.type == "cuda":
        dtype = cuda_dtype_name(requested_dtype, where)
    else:
        dtype = choose_dtype(requested_dtype, cpu).dtype
    return {
        "cpu": cpu.describe(),
        "device": describe_device(where),
        "requested_dtype": requested_dtype,
        "dtype": dtype,
    }


def add_kv_memory_argument(parser: argparse._ActionsContainer) -> None:
    """``--kv-memory`` of a benchmark that runs Slipstream's engine in process."""
    from slipstream.service.engine.config import KV_MEMORY_CHOICES

    parser.add_argument(
        "--kv-memory",
        default="commit",
        choices=KV_MEMORY_CHOICES,
        help="commit (as serve does): back the KV pools with memory before the clock starts; "
        "lazy: the first write to each page of a block faults it in during the run",
    )


def resolved_dtype(requested_dtype: str, device: str = "cpu") -> str:
    """``auto`` made concrete for this CPU or GPU (what every engine of a run uses)."""
    return str(hardware(requested_dtype, device)["dtype"])


def check_token_counts(run: EngineRun, expected: Sequence[int]) -> None:
    """Raise ``TokenCountMismatch`` unless request i made exactly ``expected[i]`` tokens."""
    got = [t.num_output_tokens for t in run.timings]
    if got != list(expected):
        bad = [i for i, (g, e) in enumerate(zip(got, expected, strict=False)) if g != e]
        raise TokenCountMismatch(
            f"{run.engine}: {len(got)} results for {len(expected)} requests; "
            f"token counts differ at indices {bad[:10]}"
        )


def engine_metrics(run: EngineRun) -> dict[str, object]:
    """The report entry of one engine (key names are read by dashboards and checks)."""
    latencies = [t.latency_s for t in run.timings]
    ttfts = [t.ttft_s for t in run.timings if t.ttft_s is not None]
    num_output_tokens = sum(t.num_output_tokens for t in run.timings)
    has_ttft = bool(ttfts) and len(ttfts) == len(run.timings)
    return {
        "output_tokens_per_s": num_output_tokens / run.wall_s if run.wall_s > 0 else 0.0,
        "wall_s": run.wall_s,
        "p50_s": _percentile(latencies, 50),
        "p95_s": _percentile(latencies, 95),
        "mean_s": float(np.mean(latencies)) if latencies else None,
        "ttft_p50_s": _percentile(ttfts, 50) if has_ttft else None,
        "ttft_p95_s": _percentile(ttfts, 95) if has_ttft else None,
        "num_requests": len(run.timings),
        "num_output_tokens": num_output_tokens,
        "settings": run.settings,
    }


def throughput_ratios(engines: Mapping[str, Mapping[str, object]]) -> dict[str, float]:
    """``slipstream/<peer>`` output-throughput ratios for every peer that ran
    (an entry with an ``error`` key failed and has no figures)."""
    if "slipstream" not in engines or "error" in engines["slipstream"]:
        return {}
    ours = float(engines["slipstream"]["output_tokens_per_s"])  # type: ignore[arg-type]
    ratios = {}
    for name, metrics in engines.items():
        if "error" in metrics:
            continue
        theirs = float(metrics["output_tokens_per_s"])  # type: ignore[arg-type]
        if name != "slipstream" and theirs > 0:
            ratios[f"slipstream/{name}"] = ours / theirs
    return ratios


def format_table(engines: Mapping[str, Mapping[str, object]]) -> str:
    """A fixed-width table, one engine per row."""
    header = f"{'engine':<12} {'out tok/s':>10} {'wall s':>8} {'p50 s':>8} {'p95 s':>8}"
    header += f" {'TTFT p50':>9} {'tokens':>8}"
    rows = [header, "-" * len(header)]
    for name, m in engines.items():
        if "error" in m:
            rows.append(f"{name:<12} failed: {m['error']}")
            continue
        row = f"{name:<12} {m['output_tokens_per_s']:>10.1f} {m['wall_s']:>8.2f}"
        row += f" {m['p50_s']:>8.2f} {m['p95_s']:>8.2f} {_fmt_optional(m['ttft_p50_s']):>9}"
        row += f" {m['num_output_tokens']:>8}"
        rows.append(row)
    return "\n".join(rows)


def _fmt_optional(value: object) -> str:
    return "-" if value is None else f"{value:.2f}"


def _percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, ``None`` for no values."""
    return float(np.percentile(values, q)) if values else None


def plot_engines(report: Mapping[str, Any], path: str) -> None:
    """PNG: output tokens/s and TTFT p50 per engine, with the CPU and workload in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = {k: v for k, v in report["engines"].items() if "output_tokens_per_s" in v}
    names = list(engines)
    env = report["environment"]
    fig, (tps_ax, ttft_ax) = plt.subplots(1, 2, figsize=(10, 4))
    tps_ax.bar(names, [engines[n]["output_tokens_per_s"] for n in names], color="tab:blue")
    tps_ax.set_ylabel("output tokens/s (higher is better)")
    floor = report.get("floor")
    if floor:
        tps_ax.axhline(floor["output_tokens_per_s"], color="black", linestyle="--", linewidth=1)
        tps_ax.annotate(
            "floor on this CPU (matmuls + K/V reads only)",
            (0, floor["output_tokens_per_s"]),
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=8,
        )
    ttft_ax.bar(names, [engines[n].get("ttft_p50_s") or 0.0 for n in names], color="tab:orange")
    ttft_ax.set_ylabel("TTFT p50, s (lower is better)")
    for ax in (tps_ax, ttft_ax):
        ax.tick_params(axis="x", rotation=20)
        ax.grid(axis="y", alpha=0.3)
    cpu = env.get("cpu", {})
    fig.suptitle(
        f"{env.get('model')} · {report['workload'].get('num_requests')} requests · "
        f"{env.get('dtype')} · {env.get('num_threads')} threads · {cpu.get('model')} "
        f"({', '.join(cpu.get('flags', [])) or 'no listed flags'})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

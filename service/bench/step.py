"""``slipstream bench step``: what one decode step of the real model runner
costs, where the time goes, and how far it is from the memory it must read.

For each batch size and mode: ``batch`` sequences with ``context`` tokens in
the paged KV cache (seeded random K/V) decode one greedy token each through
``ModelRunner.execute`` (with ``--prefill N``, the first of them is a prefill
chunk of N tokens instead: a mixed step; ``--temperature`` and its top-k /
top-p make every sequence sample instead). ``step_ms`` is the median of the plain pass; the
attention / linears / other / host split comes from a second, hooked pass
(``step_timing.py``). Two floors are measured in the same run with the same
threads: reading a buffer as large as the weights a step reads, and one as
large as the K/V the batch's attention reads.

Modes name ``EngineConfig`` options. ``compiled`` needs an ``EngineConfig``
field ``compile``; while the engine has none its rows are reported skipped.

JSON: ``{"benchmark": "step", "cpu": {...}, "parameters": {...}, "passes":
{...}, "rows": [{"batch", "mode", "dtype", "status", "step_ms",
"weight_read_floor_ms", "kv_read_floor_ms", "attention_ms", "linears_ms",
"other_ms", "host_ms", "hooked_step_ms", ratios...}]}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slipstream.scheduler.request import SamplingParams
from slipstream.service.bench.report import hardware
from slipstream.service.engine.config import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, EngineConfig
from slipstream.service.engine.device import resolve_device

if TYPE_CHECKING:
    from slipstream.service.engine.loader import EngineParts

# Mode -> the EngineConfig options it sets. A mode runs only if EngineConfig
# has every one of them: a mode is one line here once the engine supports it.
MODES: dict[str, dict[str, object]] = {
    "eager": {"compile": False},
    "compiled": {"compile": True},
    # On a CUDA device: decode steps replayed from captured graphs, or launched eagerly.
    "graphs": {"cuda_graphs": True},
    "no-graphs": {"cuda_graphs": False},
    # The same with the elementwise stages as eager torch ops, not one Triton kernel each.
    "graphs-torch-ops": {"cuda_graphs": True, "gpu_fused_elementwise": False},
    "no-graphs-torch-ops": {"cuda_graphs": False, "gpu_fused_elementwise": False},
    # Decode graphs, and a step with a prefill through its one graph (or the
    # per-layer pieces past the context cap), up to the bench's step budget;
    # with --prefill, against "graphs".
    "pieces": {"cuda_graphs": True, "prefill_graph_tokens": 1 << 20},
    # The same with such a step through the per-layer pieces around eager
    # attention, as a step whose decodes' contexts are past the whole-step cap.
    "layer-pieces": {"cuda_graphs": True, "prefill_graph_tokens": 1 << 20},
    # The compiled kernels with the layer loop run from Python, op by op,
    # instead of in one native call (LlamaModel.native_layers).
    "python-loop": {"compile": True},
}
# Model attributes a mode sets once its engine is loaded.
MODEL_SWITCHES: dict[str, dict[str, object]] = {"python-loop": {"native_layers": False}}
# Runner attributes a mode sets once its engine is loaded.
RUNNER_SWITCHES: dict[str, dict[str, object]] = {"layer-pieces": {"whole_step_max_context": 0}}
CUDA_MODES = frozenset(
    {"graphs", "no-graphs", "graphs-torch-ops", "no-graphs-torch-ops", "pieces", "layer-pieces"}
)
DEFAULT_MODES = {"cpu": "eager,compiled", "cuda": "graphs,no-graphs"}
# "compiled" runs the fused native kernels between the projections (no graph
# to split), so both modes get the per-part split.
BREAKDOWN_MODES = frozenset({"eager", "compiled", "python-loop"})
PASSES = {
    "step_ms": "plain pass: median wall time of ModelRunner.execute(plan) over `steps` steps "
    "after `warmup_steps` untimed ones; step_ms_p10/p90 from the same steps",
    "modes": "eager: torch ops between the projections; compiled: fused native kernels "
    "(kernels/fused_ops.py, EngineConfig.compile), the layer loop in one native call; "
    "python-loop: compiled with the layer loop run from Python. All use the fused attention "
    "kernel and oneDNN linears where the CPU allows",
    "breakdown": "hooked pass: the same steps with perf_counter_ns hooks on paged "
    "attention, Linear.__call__, LlamaModel.forward and sampling; hooked_step_ms is its median "
    "step, each part its own median; other_ms = forward - attention - linears + sampling, "
    "host_ms = execute - forward - sampling",
    "floors": "median of 9 sums of one buffer of weight_read_bytes / kv_read_bytes "
    "in the run's dtype, same thread count, measured right after the row's steps",
    "ratios": "step_ms (plain) over floors; linears_ms and attention_ms come from the hooked pass",
}


@dataclass(frozen=True, slots=True)
class StepOptions:
    model: str
    batches: tuple[int, ...]
    context: int
    modes: tuple[str, ...]
    dtype: str  # as requested; hardware() resolves "auto"
    num_steps: int
    warmup: int
    num_threads: int
    block_size: int
    device: str = "cpu"  # as resolved: cpu, cuda:N
    kv_cache_dtype: str = "auto"
    prefill: int = 0  # tokens of sequence 0's prefill chunk; 0: decodes only
    # How every sequence draws its token: (temperature, top_k, top_p); greedy by default.
    sampling: tuple[float, int, float] = (0.0, 0, 1.0)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "step", help="decode step time vs batch size, its split and its floors"
    )
    parser.add_argument("--model", default="small", help="model name (tiny, small) or path")
    parser.add_argument("--batch", default="1,8,64,256", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=300, help="tokens cached per sequence")
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="sequence 0 of each batch is a prefill chunk of N tokens (<= context + 1) "
        "instead of a decode: a mixed step",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="every sequence samples at this temperature (default 0: greedy)",
    )  # fmt: skip
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature (1: off)")
    parser.add_argument(
        "--modes",
        default=None,
        help=f"subset of {','.join(MODES)} (default: eager,compiled on the CPU, "
        "graphs,no-graphs on CUDA)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES)
    parser.add_argument("--steps", type=int, default=20, dest="num_steps", help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2, dest="num_threads")
    parser.add_argument("--block-size", type=int, default=EngineConfig().block_size)
    parser.add_argument("--json", dest="json_path", help="write the report here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG here (needs matplotlib)")
    parser.set_defaults(func=main)


def options_from_args(args: argparse.Namespace) -> StepOptions:
    """Raises ValueError (a usage error) on a bad flag."""
    try:
        batches = tuple(sorted({int(b) for b in args.batch.split(",") if b.strip()}))
    except ValueError:
        raise ValueError(f"--batch takes comma-separated integers, got {args.batch!r}") from None
    device = resolve_device(args.device)
    names = args.modes or DEFAULT_MODES[device.type]
    modes = tuple(m.strip() for m in names.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"--modes takes a subset of {','.join(MODES)}, got {names!r}")
    if device.type != "cuda" and set(modes) & CUDA_MODES:
        raise ValueError(f"--modes {names}: graphs and no-graphs are CUDA modes")
    if not batches or batches[0] < 1:
        raise ValueError("--batch sizes must be >= 1")
    positive = {
        "--context": args.context,
        "--steps": args.num_steps,
        "--threads": args.num_threads,
        "--block-size": args.block_size,
    }
    for flag, value in positive.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if not 0 <= args.prefill <= args.context + 1:
        raise ValueError(f"--prefill takes 0 .. context + 1 tokens, got {args.prefill}")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise ValueError("--temperature and --top-k take >= 0, --top-p 0 < p <= 1")
    return StepOptions(
        model=args.model,
        batches=batches,
        context=args.context,
        modes=modes,
        dtype=args.dtype,
        num_steps=args.num_steps,
        warmup=args.warmup,
        num_threads=args.num_threads,
        block_size=args.block_size,
        device=str(device),
        kv_cache_dtype=args.kv_cache_dtype,
        prefill=args.prefill,
        sampling=(args.temperature, args.top_k, args.top_p),
    )


def main(args: argparse.Namespace) -> int:
    from slipstream.service.bench.step_report import format_table, plot_steps

    report = run_step_bench(options_from_args(args))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    if args.plot_path:
        plot_steps(report, args.plot_path)
    print(format_table(report))
    return 0


def mode_options(mode: str) -> tuple[dict[str, object] | None, str | None]:
    """The EngineConfig options of ``mode``, or None and why it cannot run here."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    missing = sorted(set(MODES[mode]) - fields)
    if missing:
        return None, (
            f"EngineConfig has no {', '.join(missing)} option: the runner has no {mode} path yet"
        )
    return MODES[mode], None


def run_step_bench(options: StepOptions) -> dict[str, object]:
    load_at_start = os.getloadavg()[0]
    hw = hardware(options.dtype, options.device)
    dtype = str(hw["dtype"])
    cpu = hw["cpu"]
    rows: list[dict[str, object]] = []
    for mode in options.modes:
        engine_options, reason = mode_options(mode)
        if engine_options is None:
            rows += [_skipped(batch, mode, dtype, str(reason)) for batch in options.batches]
            continue
        engine = _engine(options, dtype, engine_options)
        for name, value in MODEL_SWITCHES.get(mode, {}).items():
            setattr(engine.model, name, value)
        for name, value in RUNNER_SWITCHES.get(mode, {}).items():
            setattr(engine.runner, name, value)
        rows += [_measure(engine, options, batch, mode) for batch in options.batches]
        del engine
        gc.collect()  # the next mode's pools are allocated with this one's freed
    return {
        "benchmark": "step",
        "cpu": cpu,
        "parameters": {
            "model": options.model,
            "context": options.context,
            "prefill": options.prefill,
            "sampling": dict(zip(("temperature", "top_k", "top_p"), options.sampling, strict=True)),
            "requested_dtype": options.dtype,
            "dtype": dtype,
            "kv_cache_dtype": options.kv_cache_dtype,
            "threads": options.num_threads,
            "steps": options.num_steps,
            "warmup_steps": options.warmup,
            "block_size": options.block_size,
            "device": options.device,
            "batches": list(options.batches),
            "modes": list(options.modes),
        },
        # Other processes on a small machine move step times by multiples:
        # the run says how busy it was. The start value is other work; the end
        # value includes this run's own threads.
        "load": {
            "cpus": os.cpu_count(),
            "load_avg_1m_start": load_at_start,
            "load_avg_1m_end": os.getloadavg()[0],
        },
        "passes": PASSES,
        "rows": rows,
    }


def _engine(options: StepOptions, dtype: str, engine_options: dict[str, object]) -> EngineParts:
    """An engine's parts whose device pool holds the largest batch at
    ``context + 1`` tokens per sequence; no host pool, no calibration."""
    from slipstream.service.bench.step_timing import blocks_per_seq, fill_kv
    from slipstream.service.engine.loader import load_parts

    max_batch = max(options.batches)
    config = EngineConfig(
        model=options.model,
        dtype=dtype,
        kv_cache_dtype=options.kv_cache_dtype,
        block_size=options.block_size,
        num_device_blocks=max_batch * blocks_per_seq(options.context, options.block_size),
        num_host_blocks=0,
        max_model_len=options.context + 1,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(512, max_batch + options.prefill),
        policy="fcfs",
        num_threads=options.num_threads,
        device=options.device,
        **engine_options,  # type: ignore[arg-type]
    )
    engine = load_parts(config)
    if engine.info.max_model_len < options.context + 1:
        raise ValueError(
            f"--context {options.context} leaves no room for a new token: "
            f"{options.model} holds {engine.info.max_model_len} positions"
        )
    # Once per engine: the decode steps overwrite only their own new token's slot.
    fill_kv(engine.runner)
    return engine


def _measure(engine: EngineParts, options: StepOptions, batch: int, mode: str) -> dict[str, object]:
    from slipstream.service.bench import step_timing as t

    runner, model = engine.runner, engine.model
    plan = t.decode_plan(batch, options.context, options.block_size, options.prefill,
                         SamplingParams(*options.sampling))  # fmt: skip
    times = t.time_plain(runner, plan, options.num_steps, options.warmup)
    step_ms = statistics.median(times)
    deciles = statistics.quantiles(times, n=10) if len(times) > 1 else [step_ms] * 9
    weight_bytes = t.weight_read_bytes(model)
    kv_bytes = t.kv_read_bytes(model, batch, options.context + 1)
    weight_floor = t.read_floor_ms(weight_bytes, model.dtype, device=options.device)
    kv_floor = t.read_floor_ms(kv_bytes, model.dtype, device=options.device)
    row: dict[str, object] = {
        "batch": batch,
        "mode": mode,
        "dtype": engine.info.dtype,
        "status": "ok",
        "step_ms": step_ms,
        "step_ms_p10": deciles[0],
        "step_ms_p90": deciles[-1],
        "tokens_per_s": 1e3 * batch / step_ms,
        "weight_read_bytes": weight_bytes,
        "kv_read_bytes": kv_bytes,
        "weight_read_floor_ms": weight_floor,
        "kv_read_floor_ms": kv_floor,
        "step_over_weight_floor": step_ms / weight_floor,
        "layer_loop": "native" if model.native_layers else "python",
        "prefill_tokens": options.prefill,
    }
    if options.device != "cpu":
        launches, paces = t.time_launches(runner, plan, options.num_steps)
        row["host_launch_ms"] = statistics.median(launches)
        row["step_ms_planned_ahead"] = statistics.median(paces)
    if mode not in BREAKDOWN_MODES:
        row["breakdown_pass"] = None
        row["breakdown_skipped"] = "per-part hooks would split the compiled graph"
        return row
    parts = t.time_hooked(runner, plan, options.num_steps, min(1, options.warmup))
    row.update(parts)
    row["breakdown_pass"] = "hooked"
    row["step_over_linears_plus_kv_floor"] = step_ms / (parts["linears_ms"] + kv_floor)
    row["linears_over_weight_floor"] = parts["linears_ms"] / weight_floor
    row["attention_over_kv_floor"] = parts["attention_ms"] / kv_floor
    return row


def _skipped(batch: int, mode: str, dtype: str, reason: str) -> dict[str, object]:
    return {
        "batch": batch,
        "mode": mode,
        "dtype": dtype,
        "status": "skipped",
        "reason": reason,
        "step_ms": None,
        "weight_read_floor_ms": None,
        "kv_read_floor_ms": None,
    }

"""``slipstream bench slo``: deadline attainment and goodput of the scheduling
policies under overload.

For each arrival CV (1, 3) and load (0.8, 1.0, 1.5, 2.0 x measured capacity)
and each policy (fcfs, priority, deadline), one seeded workload (see
``slo_workload``) is replayed either through the simulator (``--sim``: the
real scheduler, a fake clock, the cost model instead of the model) or
through the real engine (default; model ``small``, a few hundred requests).
Capacity is measured first in the same mode: the makespan of a saturating
batch of the same length mix (fcfs, no deadlines).

Writes JSON ``{"runs": [{"policy", "load", "cv", "mode", "goodput_tokens_per_s",
"classes": {"0": {"attainment", "ttft_p99_s", "tpot_p99_s", "max_wait_s", ...},
...}, ...}], ...}`` and a PNG of attainment vs load per policy.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from slipstream.scheduler.config import SchedulerConfig
from slipstream.scheduler.cost_model import CostCoefficients, CostModel
from slipstream.scheduler.policies import POLICY_NAMES
from slipstream.scheduler.simulator import simulate
from slipstream.service.bench.slo_workload import (
    DEFAULT_SLACK_FACTORS,
    WorkloadSpec,
    make_requests,
    run_metrics,
    saturating_requests,
)

LOADS = (0.8, 1.0, 1.5, 2.0)
CVS = (1.0, 3.0)
# The small model in bfloat16: 2 * layers 8 * block 16 * kv heads 4 * head dim 64 * 2 bytes.
SIM_KV_BYTES_PER_BLOCK = 131072


@dataclass(frozen=True, slots=True)
class SloOptions:
    mode: str  # "sim" | "engine"
    num_requests: int
    loads: tuple[float, ...]
    cvs: tuple[float, ...]
    policies: tuple[str, ...]
    seed: int = 0
    slack_factors: tuple[float, float, float] = DEFAULT_SLACK_FACTORS
    num_device_blocks: int = 2048
    num_host_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_queue_len: int = 4096
    aging_s: float = 60.0
    reject_infeasible: bool = True
    coefficients: CostCoefficients = field(default_factory=CostCoefficients)
    kv_bytes_per_block: int = SIM_KV_BYTES_PER_BLOCK
    capacity_requests: int = 1000
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 256)
    model: str = "small"
    dtype: str = "float32"
    json_path: str | None = None
    plot_path: str | None = None


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "slo",
        help="deadline attainment / goodput of fcfs, priority and deadline",
        description=__doc__,
    )
    parser.add_argument("--sim", action="store_true", help="simulate (default: the real engine)")
    parser.add_argument("--requests", type=int, default=None, help="10000 sim, 200 engine")
    parser.add_argument("--load", type=float, action="append", help="x capacity (repeatable)")
    parser.add_argument("--cv", type=float, action="append", help="arrival CV (repeatable)")
    parser.add_argument("--policy", action="append", choices=POLICY_NAMES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slack", type=float, nargs=3, metavar=("S0", "S1", "S2"))
    parser.add_argument("--num-device-blocks", type=int, default=None)
    parser.add_argument("--num-host-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-queue-len", type=int, default=4096)
    parser.add_argument("--aging-s", type=float, default=None, help="0 disables aging")
    parser.add_argument("--no-reject-infeasible", action="store_true")
    parser.add_argument("--coefficients", type=Path, help="cost-model JSON (sim mode)")
    parser.add_argument("--capacity-requests", type=int, default=None)
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", dest="json_path", default="slo.json")
    parser.add_argument("--plot", dest="plot_path", default="slo.png")
    parser.set_defaults(func=main)


def options_from_args(args: argparse.Namespace) -> SloOptions:
    mode = "sim" if args.sim else "engine"
    opts = SloOptions(
        mode=mode,
        num_requests=args.requests or (10_000 if args.sim else 200),
        loads=tuple(args.load or LOADS),
        cvs=tuple(args.cv or CVS),
        policies=tuple(args.policy or POLICY_NAMES),
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_queue_len=args.max_queue_len,
        reject_infeasible=not args.no_reject_infeasible,
        model=args.model,
        dtype=args.dtype,
        json_path=args.json_path,
        plot_path=args.plot_path,
    )
    if mode == "engine":
        opts = replace(
            opts,
            num_device_blocks=256,
            num_host_blocks=128,
            prompt_len=(16, 128),
            output_len=(8, 48),
            capacity_requests=96,  # 3x max_num_seqs: saturated, not ramp-dominated
            aging_s=10.0,
        )
    if args.capacity_requests:
        opts = replace(opts, capacity_requests=args.capacity_requests)
    if args.slack:
        opts = replace(opts, slack_factors=tuple(args.slack))
    if args.aging_s is not None:
        opts = replace(opts, aging_s=args.aging_s)
    if args.num_device_blocks:
        opts = replace(opts, num_device_blocks=args.num_device_blocks)
    if args.num_host_blocks is not None:
        opts = replace(opts, num_host_blocks=args.num_host_blocks)
    if args.coefficients:
        coeffs = CostCoefficients(**json.loads(args.coefficients.read_text()))
        opts = replace(opts, coefficients=coeffs)
    return opts


def main(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    report = run_engine_bench(opts) if opts.mode == "engine" else run_sim_bench(opts)
    if opts.json_path:
        Path(opts.json_path).write_text(json.dumps(report, indent=2))
    if opts.plot_path:
        plot_attainment(report, opts.plot_path)
    print(format_summary(report))
    return 0


# -- simulation ---------------------------------------------------------------


def scheduler_config(opts: SloOptions, policy: str) -> SchedulerConfig:
    return SchedulerConfig(
        num_device_blocks=opts.num_device_blocks,
        block_size=opts.block_size,
        max_model_len=opts.prompt_len[1] + opts.output_len[1],
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        num_host_blocks=opts.num_host_blocks,
        max_queue_len=opts.max_queue_len,
        policy=policy,
        reject_infeasible=opts.reject_infeasible,
        aging_s=opts.aging_s,
    )


def workload_spec(opts: SloOptions, rate_rps: float, cv: float) -> WorkloadSpec:
    return WorkloadSpec(
        num_requests=opts.num_requests,
        rate_rps=rate_rps,
        cv=cv,
        seed=opts.seed,
        prompt_len=opts.prompt_len,
        output_len=opts.output_len,
        slack_factors=opts.slack_factors,
    )


def sim_capacity_rps(opts: SloOptions) -> float:
    """Requests per second of a saturating batch, fcfs, no deadlines."""
    spec = workload_spec(opts, 1.0, 1.0)
    batch = saturating_requests(spec, opts.capacity_requests)
    result = simulate(batch, scheduler_config(opts, "fcfs"), CostModel(opts.coefficients))
    return len(batch) / result.makespan_s


def run_sim_bench(opts: SloOptions) -> dict[str, object]:
    capacity = sim_capacity_rps(opts)
    runs = []
    for cv in opts.cvs:
        for load in opts.loads:
            for policy in opts.policies:
                runs.append(sim_run(opts, policy, load, cv, capacity))
    return {"runs": runs, "capacity_rps": capacity, "options": _options_json(opts)}


def sim_run(
    opts: SloOptions, policy: str, load: float, cv: float, capacity_rps: float
) -> dict[str, object]:
    cost = CostModel(opts.coefficients)
    spec = workload_spec(opts, load * capacity_rps, cv)
    requests = make_requests(spec, cost, opts.max_num_batched_tokens)
    started = time.perf_counter()
    result = simulate(requests, scheduler_config(opts, policy), cost)
    wall = time.perf_counter() - started
    window = requests[-1].arrival - requests[0].arrival if len(requests) > 1 else 1.0
    metrics = run_metrics(result.outcomes, window)
    return {
        "policy": policy,
        "load": load,
        "cv": cv,
        "mode": "sim",
        **metrics,
        "arrival_rate_rps": spec.rate_rps,
        "num_requests": len(requests),
        "preemptions_swap": result.num_swap_preemptions,
        "preemptions_recompute": result.num_recompute_preemptions,
        "swapped_bytes": result.num_swapped_out_blocks * opts.kv_bytes_per_block,
        "makespan_s": result.makespan_s,
        "num_steps": result.num_steps,
        "sim_wall_s": wall,
    }


def _options_json(opts: SloOptions) -> dict[str, object]:
    out = asdict(opts)
    out["coefficients"] = asdict(opts.coefficients)
    return out


# -- engine -------------------------------------------------------------------


def run_engine_bench(opts: SloOptions) -> dict[str, object]:
    from slipstream.service.bench.slo_engine import run_engine_bench as run

    return run(opts)


# -- report -------------------------------------------------------------------


def plot_attainment(report: dict[str, object], path: str) -> None:
    """Attainment (overall solid, class 0 dashed) vs load, one panel per CV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    assert isinstance(runs, list)
    cvs = sorted({r["cv"] for r in runs})
    fig, axes = plt.subplots(1, len(cvs), figsize=(5 * len(cvs), 4), squeeze=False)
    for ax, cv in zip(axes[0], cvs, strict=True):
        for policy in sorted({r["policy"] for r in runs}):
            rows = sorted(
                (r for r in runs if r["cv"] == cv and r["policy"] == policy),
                key=lambda r: r["load"],
            )
            loads = [r["load"] for r in rows]
            line = ax.plot(
                loads, [r["attainment"] for r in rows], marker="o", label=f"{policy} all"
            )
            color = line[0].get_color()
            class0 = [r["classes"]["0"]["attainment"] for r in rows]
            ax.plot(
                loads, class0, linestyle="--", marker="x", color=color, label=f"{policy} class 0"
            )
        ax.set_title(f"{rows[0]['mode'] if rows else ''} CV {cv:g}")
        ax.set_xlabel("load (x capacity)")
        ax.set_ylabel("deadline attainment")
        ax.set_ylim(0, 1.05)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_summary(report: dict[str, object]) -> str:
    runs = report["runs"]
    assert isinstance(runs, list)
    header = (
        f"{'mode':<6} {'cv':>3} {'load':>4} {'policy':<8} {'attain':>6} {'c0':>5} {'c1':>5} "
        f"{'c2':>5} {'goodput':>8} {'c2 p99 wait':>11} {'c2 max wait':>11} {'swap':>5} "
        f"{'recomp':>6} {'reject':>6} {'missed s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        c = r["classes"]
        lines.append(
            f"{r['mode']:<6} {r['cv']:>3g} {r['load']:>4g} {r['policy']:<8} "
            f"{_pct(r['attainment'])} {_pct(c['0']['attainment'])} {_pct(c['1']['attainment'])} "
            f"{_pct(c['2']['attainment'])} {r['goodput_tokens_per_s']:>8.1f} "
            f"{_num(c['2']['wait_p99_s']):>11} {_num(c['2']['max_wait_s']):>11} "
            f"{r['preemptions_swap']:>5} {r['preemptions_recompute']:>6} "
            f"{r['early_rejections']:>6} {r['missed_compute_s']:>8.1f}"
        )
    return "\n".join(lines)


def _pct(value: object) -> str:
    return "    -" if value is None else f"{100 * float(value):>5.1f}"  # type: ignore[arg-type]


def _num(value: object) -> str:
    return "-" if value is None else f"{float(value):.2f}"  # type: ignore[arg-type]

"""``slipstream bench slo``: deadline attainment and goodput of the scheduling
policies under overload.

For each arrival CV (1, 3) and load (0.8, 1.0, 1.5, 2.0 x measured capacity)
and each policy (fcfs, priority, deadline), one seeded workload (see
``slo_workload``) is replayed either through the simulator (``--sim``: the
real scheduler, a fake clock, the cost model instead of the model) or
through the real engine (default; model ``small``, a few hundred requests).
Capacity is measured first in the same mode: the makespan of a saturating
batch of the same length mix (fcfs, no deadlines).

The baselines run in two deadline modes (``deadlines`` in each run):
``enforced`` — the scheduler ends a request when its deadline passes, as a
client's gRPC deadline would — and ``unaware`` — the scheduler never sees the
deadline, as in an engine without deadlines serving clients that wait; the
deadline then only scores the result. ``deadline`` always runs enforced.
``goodput_ratios`` compares its goodput with each baseline in each mode, and
every run states its goodput as a fraction of capacity — the ceiling no
policy passes over a long run (goodput is per second of the arrival window,
so in a short run the drain after the last arrival can lift it above 1).

Writes JSON ``{"runs": [{"policy", "load", "cv", "mode", "goodput_tokens_per_s",
"classes": {"0": {"attainment", "ttft_p99_s", "tpot_p99_s", "max_wait_s", ...},
...}, ...}], ...}`` and a PNG of attainment vs load per policy.

``--capacity`` asks the better question instead (see ``slo_capacity``): per
policy, the highest load at which class-0 attainment >= 99% and overall
attainment >= 90% — top-level ``"capacity": {"<policy>": {"load",
"rate_rps"}}`` in the JSON, every evaluated load in ``capacity_runs`` (with
goodput as a fraction of capacity), and a PNG of attainment vs load per
class and policy with each capacity marked. It uses the first ``--cv``.

``--calibration F`` (a ``slipstream bench calibrate`` file) gives the
simulator the step-time model measured on this machine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from slipstream.scheduler.config import SchedulerConfig
from slipstream.scheduler.cost_model import CostCoefficients, CostModel
from slipstream.scheduler.policy_registry import POLICY_NAMES, make_policy
from slipstream.scheduler.simulator import SimRequest, SimResult, resume_policy, simulate
from slipstream.service.bench.report import hardware, resolved_dtype
from slipstream.service.bench.slo_capacity import (
    CLASS0_TARGET,
    OVERALL_TARGET,
    SWEEP_LOADS,
    CapacityResult,
    capacity_json,
    capacity_ratios,
    find_capacity,
    format_capacity,
    plot_capacity,
    save_figure,
    style_attainment_axes,
)
from slipstream.service.bench.slo_workload import (
    DEFAULT_SLACK_FACTORS,
    WorkloadSpec,
    as_scheduled,
    attainable_load,
    make_requests,
    saturating_requests,
    scored_metrics,
)
from slipstream.service.engine.config import DTYPE_CHOICES

LOADS = (0.8, 1.0, 1.5, 2.0)
CVS = (1.0, 3.0)
DEADLINE_MODES = ("enforced", "unaware")
BASELINES = ("fcfs", "priority")
# The small model in bfloat16: 2 * layers 8 * block 16 * kv heads 4 * head dim 64 * 2 bytes.
SIM_KV_BYTES_PER_BLOCK = 131072


@dataclass(frozen=True, slots=True)
class SloOptions:
    mode: str  # "sim" | "engine"
    num_requests: int
    loads: tuple[float, ...]
    cvs: tuple[float, ...]
    policies: tuple[str, ...]
    baseline_deadlines: tuple[str, ...] = DEADLINE_MODES
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
    shed_under_overload: bool = True
    coefficients: CostCoefficients = field(default_factory=CostCoefficients)
    kv_bytes_per_block: int = SIM_KV_BYTES_PER_BLOCK
    capacity_requests: int = 1000
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 256)
    model: str = "small"
    dtype: str = "float32"
    json_path: str | None = None
    plot_path: str | None = None
    capacity: bool = False
    capacity_sweep: tuple[float, ...] = SWEEP_LOADS
    capacity_bisections: int = 4
    repeats: int = 1  # engine mode: replays of every cell (the engine's own spread)


# The engine replays in real time: a shorter sweep and fewer bisections.
ENGINE_CAPACITY_SWEEP = (0.5, 1.0, 1.5, 2.0, 3.0)
ENGINE_CAPACITY_BISECTIONS = 2


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
    parser.add_argument(
        "--baseline-deadlines",
        action="append",
        choices=DEADLINE_MODES,
        help="how fcfs/priority treat deadlines (repeatable; default both)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="engine mode: replay every cell N times (the engine's run-to-run spread)",
    )
    parser.add_argument("--slack", type=float, nargs=3, metavar=("S0", "S1", "S2"))
    parser.add_argument("--num-device-blocks", type=int, default=None)
    parser.add_argument("--num-host-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-queue-len", type=int, default=4096)
    parser.add_argument("--aging-s", type=float, default=None, help="0 disables aging")
    parser.add_argument("--no-reject-infeasible", action="store_true")
    parser.add_argument(
        "--no-overload-shedding",
        action="store_true",
        help="deadline: give work up by urgency only, never refuse the heaviest at arrival",
    )
    parser.add_argument("--coefficients", type=Path, help="cost-model JSON (sim mode)")
    parser.add_argument(
        "--calibration",
        type=Path,
        help="a `slipstream bench calibrate` file: the simulator's step-time model",
    )
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="per policy, the highest load meeting class 0 >= 99%% and all >= 90%%",
    )
    parser.add_argument(
        "--capacity-loads",
        type=float,
        nargs="+",
        metavar="LOAD",
        help="ascending loads the capacity sweep tries before bisecting",
    )
    parser.add_argument("--capacity-bisections", type=int, default=None)
    parser.add_argument("--capacity-requests", type=int, default=None)
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    # Defaults under bench-results/ (ignored by git), like the Makefile's benchmarks.
    parser.add_argument("--json", dest="json_path", default="bench-results/slo.json")
    parser.add_argument("--plot", dest="plot_path", default="bench-results/slo.png")
    parser.set_defaults(func=main)


def options_from_args(args: argparse.Namespace) -> SloOptions:
    mode = "sim" if args.sim else "engine"
    opts = SloOptions(
        mode=mode,
        num_requests=args.requests or (10_000 if args.sim else 200),
        loads=tuple(args.load or LOADS),
        cvs=tuple(args.cv or CVS),
        policies=tuple(args.policy or POLICY_NAMES),
        baseline_deadlines=tuple(args.baseline_deadlines or DEADLINE_MODES),
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_queue_len=args.max_queue_len,
        reject_infeasible=not args.no_reject_infeasible,
        shed_under_overload=not args.no_overload_shedding,
        model=args.model,
        dtype=resolved_dtype(args.dtype) if mode == "engine" else args.dtype,
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
    if args.repeats < 1 or (args.repeats > 1 and (mode == "sim" or args.capacity)):
        raise SystemExit(
            "--repeats takes N >= 1, and more than 1 only in engine mode without --capacity"
        )
    opts = replace(opts, repeats=args.repeats)
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
    if args.calibration:
        from slipstream.service.bench.calibrate import load_calibration

        opts = replace(opts, coefficients=load_calibration(args.calibration))
    if args.capacity:
        engine = mode == "engine"
        opts = replace(
            opts,
            capacity=True,
            capacity_sweep=tuple(
                args.capacity_loads or (ENGINE_CAPACITY_SWEEP if engine else SWEEP_LOADS)
            ),
            capacity_bisections=(
                args.capacity_bisections
                if args.capacity_bisections is not None
                else (ENGINE_CAPACITY_BISECTIONS if engine else opts.capacity_bisections)
            ),
        )
    return opts


def main(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    if opts.capacity:
        report = run_engine_capacity(opts) if opts.mode == "engine" else run_sim_capacity(opts)
    else:
        report = run_engine_bench(opts) if opts.mode == "engine" else run_sim_bench(opts)
    if opts.mode == "engine":
        report["hardware"] = hardware(args.dtype)
    for path in (opts.json_path, opts.plot_path):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if opts.json_path:
        Path(opts.json_path).write_text(json.dumps(report, indent=2))
    if opts.plot_path:
        (plot_capacity if opts.capacity else plot_attainment)(report, opts.plot_path)
    print(format_summary(report) if report["runs"] else "")
    if opts.capacity:
        print(format_capacity(report))
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
        shed_under_overload=opts.shed_under_overload,
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


@dataclass(frozen=True, slots=True)
class Capacity:
    """Throughput of a saturating batch: the ceiling of any policy's goodput."""

    rps: float
    tokens_per_s: float

    @staticmethod
    def of(batch: Sequence[SimRequest], makespan_s: float) -> Capacity:
        tokens = sum(r.output_len for r in batch)
        return Capacity(len(batch) / makespan_s, tokens / makespan_s)


def run_grid(opts: SloOptions) -> Iterator[tuple[float, float, str, str]]:
    """(cv, load, policy, deadline mode) of every run, in report order."""
    for cv in opts.cvs:
        for load in opts.loads:
            for policy in opts.policies:
                modes = opts.baseline_deadlines if policy in BASELINES else ("enforced",)
                for deadlines in modes:
                    yield cv, load, policy, deadlines


def sim_capacity(opts: SloOptions, cost: CostModel | None = None) -> Capacity:
    """Throughput of a saturating batch, fcfs, no deadlines."""
    spec = workload_spec(opts, 1.0, 1.0)
    batch = saturating_requests(spec, opts.capacity_requests)
    cost = cost if cost is not None else CostModel(opts.coefficients)
    # The whole batch is queued at once: a queue limit must not turn it away.
    config = replace(
        scheduler_config(opts, "fcfs"), max_queue_len=max(opts.max_queue_len, len(batch))
    )
    result = simulate(batch, config, cost)
    return Capacity.of(batch, result.makespan_s)


def run_sim_bench(opts: SloOptions) -> dict[str, object]:
    capacity = sim_capacity(opts)
    runs = [
        sim_run(opts, policy, load, cv, capacity, deadlines)
        for cv, load, policy, deadlines in run_grid(opts)
    ]
    return {
        "runs": runs,
        "capacity_rps": capacity.rps,
        "capacity_tokens_per_s": capacity.tokens_per_s,
        "goodput_ratios": goodput_ratios(runs),
        "options": _options_json(opts),
    }


def run_sim_capacity(opts: SloOptions) -> dict[str, object]:
    """Each policy's SLO capacity in the simulator (see ``slo_capacity``)."""
    capacity = sim_capacity(opts)
    cv = opts.cvs[0]
    results = [
        find_capacity(
            policy,
            lambda load, policy=policy: sim_run(opts, policy, load, cv, capacity),  # type: ignore[misc]
            opts.capacity_sweep,
            opts.capacity_bisections,
        )
        for policy in opts.policies
    ]
    return capacity_report(results, capacity, opts, cv, CostModel(opts.coefficients))


def workload_bound(opts: SloOptions, cost: CostModel, cv: float) -> float:
    """``attainable_load`` of the workload's requests (their lengths and
    classes; the load only moves their arrivals)."""
    requests = make_requests(workload_spec(opts, 1.0, cv), cost, opts.max_num_batched_tokens)
    return attainable_load(requests, cost, opts.max_num_seqs, OVERALL_TARGET, CLASS0_TARGET)


def capacity_report(
    results: Sequence[CapacityResult],
    capacity: Capacity,
    opts: SloOptions,
    cv: float,
    cost: CostModel,
) -> dict[str, object]:
    """The report of a capacity search; ``cost`` is the model the workload's
    deadlines were set with (it weighs the requests for ``attainable_load``)."""
    found = capacity_json(results, capacity.rps)
    return {
        "capacity": found,
        "capacity_ratios": capacity_ratios(found),
        "attainable_load": workload_bound(opts, cost, cv),
        "capacity_cv": cv,
        "capacity_runs": [run for r in results for run in r.runs],
        "runs": [],
        "capacity_rps": capacity.rps,
        "capacity_tokens_per_s": capacity.tokens_per_s,
        "options": _options_json(opts),
    }


def simulate_workload(
    opts: SloOptions,
    policy: str,
    requests: Sequence[SimRequest],
    cost: CostModel,
    deadlines: str = "enforced",
    carried: object | None = None,
) -> tuple[SimResult, dict[str, object]]:
    """One simulated replay and its metrics, scored against the real deadlines.
    ``carried``: the policy starts from this ``carried_state`` (a twin of a
    live engine), else fresh."""
    config = scheduler_config(opts, policy)
    scheduling = make_policy(policy, config, cost)
    if carried is not None:
        resume_policy(scheduling, carried)
    result = simulate(as_scheduled(requests, deadlines), config, cost, scheduling)
    return result, scored_metrics(result.outcomes, requests)


def sim_run(
    opts: SloOptions,
    policy: str,
    load: float,
    cv: float,
    capacity: Capacity,
    deadlines: str = "enforced",
) -> dict[str, object]:
    cost = CostModel(opts.coefficients)
    spec = workload_spec(opts, load * capacity.rps, cv)
    requests = make_requests(spec, cost, opts.max_num_batched_tokens)
    started = time.perf_counter()
    result, metrics = simulate_workload(opts, policy, requests, cost, deadlines)
    wall = time.perf_counter() - started
    return {
        "policy": policy,
        "deadlines": deadlines,
        "load": load,
        "cv": cv,
        "mode": "sim",
        **metrics,
        "goodput_fraction_of_capacity": goodput_fraction(metrics, capacity),
        "arrival_rate_rps": spec.rate_rps,
        "num_requests": len(requests),
        "preemptions_swap": result.num_swap_preemptions,
        "preemptions_recompute": result.num_recompute_preemptions,
        "swapped_bytes": result.num_swapped_out_blocks * opts.kv_bytes_per_block,
        "makespan_s": result.makespan_s,
        "num_steps": result.num_steps,
        "sim_wall_s": wall,
    }


def goodput_fraction(metrics: dict[str, object], capacity: Capacity) -> float:
    """A run's goodput as a fraction of ``capacity``'s token throughput."""
    return float(metrics["goodput_tokens_per_s"]) / capacity.tokens_per_s  # type: ignore[arg-type]


def goodput_ratios(runs: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """``deadline``'s goodput over each baseline's, per (mode, cv, load) and
    baseline deadline mode; None where the baseline is absent or met nothing."""
    goodput = {
        (r["mode"], r["cv"], r["load"], r["policy"], r["deadlines"]): r["goodput_tokens_per_s"]
        for r in runs
    }
    ratios: list[dict[str, object]] = []
    for (mode, cv, load, policy, _), ours in goodput.items():
        if policy != "deadline":
            continue
        for baseline_mode in DEADLINE_MODES:
            theirs = {b: goodput.get((mode, cv, load, b, baseline_mode)) for b in BASELINES}
            if all(v is None for v in theirs.values()):
                continue
            row: dict[str, object] = {
                "mode": mode,
                "cv": cv,
                "load": load,
                "baseline_deadlines": baseline_mode,
            }
            for baseline, value in theirs.items():
                row[f"over_{baseline}"] = (
                    float(ours) / float(value) if value else None  # type: ignore[arg-type]
                )
            ratios.append(row)
    return ratios


def _options_json(opts: SloOptions) -> dict[str, object]:
    out = asdict(opts)
    out["coefficients"] = asdict(opts.coefficients)
    return out


# -- engine -------------------------------------------------------------------


def run_engine_bench(opts: SloOptions) -> dict[str, object]:
    from slipstream.service.bench.slo_engine import run_engine_bench as run

    return run(opts)


def run_engine_capacity(opts: SloOptions) -> dict[str, object]:
    from slipstream.service.bench.slo_engine import run_engine_capacity as run

    return run(opts)


# -- report -------------------------------------------------------------------


def plot_attainment(report: dict[str, object], path: str) -> None:
    """Attainment (overall solid, class 0 dashed) vs load, one panel per CV;
    the replays of ``--repeats`` as hollow markers of the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    replays = report.get("repeat_runs") or []
    assert isinstance(runs, list) and isinstance(replays, list)
    cvs = sorted({r["cv"] for r in runs})
    fig, axes = plt.subplots(1, len(cvs), figsize=(5 * len(cvs), 4), squeeze=False)
    for ax, cv in zip(axes[0], cvs, strict=True):
        for policy, deadlines in sorted({(r["policy"], r["deadlines"]) for r in runs}):
            rows = sorted(
                (
                    r
                    for r in runs
                    if r["cv"] == cv and r["policy"] == policy and r["deadlines"] == deadlines
                ),
                key=lambda r: r["load"],
            )
            loads = [r["load"] for r in rows]
            name = policy if deadlines == "enforced" else f"{policy} (unaware)"
            style = "-" if deadlines == "enforced" else ":"
            line = ax.plot(
                loads,
                [r["attainment"] for r in rows],
                marker="o",
                linestyle=style,
                label=f"{name} all",
            )
            color = line[0].get_color()
            again = [
                r
                for r in replays
                if r["cv"] == cv and r["policy"] == policy and r["deadlines"] == deadlines
            ]
            _scatter_replays(ax, again, None, "o", color, f"{name} all, replays")
            if deadlines != "enforced":
                continue
            class0 = [r["classes"]["0"]["attainment"] for r in rows]
            ax.plot(loads, class0, linestyle="--", marker="x", color=color, label=f"{name} class 0")
            _scatter_replays(ax, again, "0", "s", color, f"{name} class 0, replays")
        style_attainment_axes(ax, f"{rows[0]['mode'] if rows else ''} CV {cv:g}")
    save_figure(fig, path)


def _scatter_replays(
    ax: Any, replays: list[dict[str, Any]], cls: str | None, marker: str, color: str, label: str
) -> None:
    """``replays``' attainment (overall, or of class ``cls``) as hollow markers."""
    if replays:
        ax.scatter(
            [r["load"] for r in replays],
            [side_attainment(r, cls) for r in replays],
            marker=marker,
            facecolors="none",
            edgecolors=color,
            label=label,
        )


def format_summary(report: dict[str, object]) -> str:
    runs = report["runs"]
    assert isinstance(runs, list)
    header = (
        f"{'mode':<6} {'cv':>3} {'load':>4} {'policy':<8} {'dl':<4} {'attain':>6} {'c0':>5} "
        f"{'c1':>5} {'c2':>5} {'goodput':>8} {'of cap':>6} {'c2 p99 wait':>11} "
        f"{'c2 max wait':>11} {'swap':>5} {'recomp':>6} {'reject':>6} {'shed':>5} {'missed s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        c = r["classes"]
        lines.append(
            f"{r['mode']:<6} {r['cv']:>3g} {r['load']:>4g} {r['policy']:<8} "
            f"{str(r['deadlines'])[:4]:<4} "
            f"{_pct(r['attainment'])} {_pct(c['0']['attainment'])} {_pct(c['1']['attainment'])} "
            f"{_pct(c['2']['attainment'])} {r['goodput_tokens_per_s']:>8.1f} "
            f"{_pct(r.get('goodput_fraction_of_capacity')):>6} "
            f"{_num(c['2']['wait_p99_s']):>11} {_num(c['2']['max_wait_s']):>11} "
            f"{r['preemptions_swap']:>5} {r['preemptions_recompute']:>6} "
            f"{r['early_rejections']:>6} {r['overload_refusals']:>5} "
            f"{r['missed_compute_s']:>8.1f}"
        )
    twins = [r for r in runs if "sim_twin" in r]
    if twins:
        lines += [
            "",
            _capacity_line(report),
            "engine vs its simulated twin (attainment %: engine / twin with the model held at "
            "the run's start / twin with the run's own steps fit):",
        ]
        lines += [_twin_line(r) for r in twins]
        lines += _reproducibility_lines(report)
        lines += _disagreement_lines(twins)
        lines += _class0_miss_lines(twins)
    ratios = report.get("goodput_ratios") or []
    assert isinstance(ratios, list)
    if ratios:
        lines += ["", "goodput of deadline over the baselines (baseline deadline mode):"]
        for row in ratios:
            lines.append(
                f"  {row['mode']:<6} cv {row['cv']:g} load {row['load']:g} "
                f"{row['baseline_deadlines']:<8}  x priority {_num(row['over_priority']):>6}  "
                f"x fcfs {_num(row['over_fcfs']):>6}"
            )
    return "\n".join(lines)


def _capacity_line(report: dict[str, object]) -> str:
    return (
        f"capacity: engine {_num(report['capacity_rps'])} req/s; simulated with the start-up "
        f"calibration {_num(report['sim_capacity_rps'])}, with the online refit "
        f"{_num(report.get('sim_capacity_rps_refit'))} req/s; deadlines set with the "
        f"calibration x {_num(report.get('deadline_scale'))} (isolated requests measured)"
    )


def _twin_line(run: dict[str, object]) -> str:
    """Engine / twin with the model held at the start / twin with the run's own fit."""
    sides = [run, run["sim_twin"], run.get("sim_twin_run_fit")]

    def triple(cls: str | None) -> str:
        return "/".join(_pct(side_attainment(side, cls)) for side in sides)

    per_class = "  ".join(f"c{c} {triple(c)}" for c in ("0", "1", "2"))
    return (
        f"  cv {run['cv']:g} load {run['load']:g} {run['policy']:<8} {str(run['deadlines'])[:4]:<4}"
        f" all {triple(None)}  {per_class}"
    )


def _reproducibility_lines(report: dict[str, object]) -> list[str]:
    """Per cell replayed more than once: the engine's spread over its replays
    and how far each twin's median is from the engine's, in points."""
    rows = report.get("reproducibility") or []
    assert isinstance(rows, list)
    if not rows:
        return []
    lines = [
        "the engine replaying the same requests (points: engine spread max-min / |twin median"
        " - engine median| / same, twin fit on each run's steps):"
    ]
    for row in rows:
        parts = []
        for cls, entry in row["classes"].items():
            name = "all" if cls == "all" else f"c{cls}"
            values = (entry["engine_spread"], entry["twin_gap"], entry["twin_run_fit_gap"])
            parts.append(f"{name} " + "/".join(_points(v) for v in values))
        lines.append(
            f"  cv {row['cv']:g} load {row['load']:g} {row['policy']:<8} "
            f"{str(row['deadlines'])[:4]:<4} x{row['replays']}  " + "  ".join(parts)
        )
    return lines


def _points(value: object) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}"  # type: ignore[arg-type]


def side_attainment(side: object, cls: str | None) -> object:
    """A run's (or twin's) attainment, overall or of class ``cls``; None when absent."""
    if not isinstance(side, dict):
        return None
    return side["attainment"] if cls is None else side["classes"][cls]["attainment"]


def _disagreement_lines(runs: Sequence[dict[str, object]]) -> list[str]:
    """The requests the engine and its twin scored differently, per run."""

    def row_line(row: dict[str, object]) -> str:
        side = "met on the engine only" if row["met_on_engine"] else "met in the twin only"
        return (
            f"    {row['req_id']:<6} class {row['priority']} {side}: "
            f"engine {row['engine']}, twin {row['twin']}, deadline {_num(row['deadline_s'])}s"
        )

    return _listed_per_run(
        runs,
        "twin_disagreements",
        lambda run: (
            f"requests scored differently, cv {run['cv']:g} load {run['load']:g} "
            f"{run['policy']} ({run['num_twin_disagreements']} in all):"
        ),
        row_line,
    )


def _class0_miss_lines(runs: Sequence[dict[str, object]]) -> list[str]:
    """Class-0 requests that missed on the engine, per run."""
    return _listed_per_run(
        runs,
        "class0_misses",
        lambda run: (
            f"class-0 misses on the engine, cv {run['cv']:g} load {run['load']:g} "
            f"{run['policy']} {str(run['deadlines'])[:4]}:"
        ),
        lambda row: (
            f"    {row['req_id']:<6} at {row['arrival_s']:.2f}s: {row['fate']}, deadline "
            f"{_num(row['deadline_s'])}s, prompt {row['prompt_len']} / output "
            f"{row['output_len']}, queued {_num(row['queue_wait_s'])}s, TTFT "
            f"{_num(row['ttft_s'])}s, preempted {row['preemptions']}x"
        ),
    )


def _listed_per_run(
    runs: Sequence[dict[str, object]],
    key: str,
    header: Callable[[dict[str, object]], str],
    line: Callable[[dict[str, object]], str],
) -> list[str]:
    """For each run with rows under ``key``: its header, then a line per row."""
    lines: list[str] = []
    for run in runs:
        rows = run.get(key) or []
        assert isinstance(rows, list)
        if rows:
            lines.append("  " + header(run))
            lines += [line(row) for row in rows]
    return lines


def _pct(value: object) -> str:
    return "    -" if value is None else f"{100 * float(value):>5.1f}"  # type: ignore[arg-type]


def _num(value: object) -> str:
    return "-" if value is None else f"{float(value):.2f}"  # type: ignore[arg-type]

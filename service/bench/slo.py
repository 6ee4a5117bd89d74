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
from dataclasses import replace
from pathlib import Path

from slipstream.scheduler.cost_model import CostCoefficients
from slipstream.scheduler.policy_registry import POLICY_NAMES
from slipstream.service.bench.device_steps import DEVICE_STEPS, calibrated_on, device_steps
from slipstream.service.bench.report import hardware, resolved_dtype
from slipstream.service.bench.slo_options import (
    CVS,
    DEADLINE_MODES,
    LOADS,
    SWEEP_LOADS,
    SloOptions,
    engine_shaped,
)
from slipstream.service.bench.slo_report import (
    format_capacity,
    format_summary,
    plot_attainment,
    plot_capacity,
)
from slipstream.service.bench.slo_sim import run_sim_bench, run_sim_capacity
from slipstream.service.cli.arg_types import non_negative_int, positive_float, positive_int
from slipstream.service.engine.config import DTYPE_CHOICES, PREFILL_GRAPH_TOKENS, EngineConfig
from slipstream.service.engine.device import resolve_device

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
    parser.add_argument("--requests", type=positive_int, default=None, help="10000 sim, 200 engine")
    parser.add_argument(
        "--load", type=positive_float, action="append", help="x capacity (repeatable)"
    )
    parser.add_argument(
        "--cv", type=positive_float, action="append", help="arrival CV (repeatable)"
    )
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
        type=positive_int,
        default=1,
        help="engine mode: replay every cell N times (the engine's run-to-run spread)",
    )
    parser.add_argument("--slack", type=positive_float, nargs=3, metavar=("S0", "S1", "S2"))
    parser.add_argument("--num-device-blocks", type=int, default=None)
    parser.add_argument("--num-host-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=positive_int, default=32)
    parser.add_argument("--max-queue-len", type=positive_int, default=4096)
    parser.add_argument("--aging-s", type=float, default=None, help="0 disables aging")
    parser.add_argument("--no-reject-infeasible", action="store_true")
    parser.add_argument(
        "--no-overload-shedding",
        action="store_true",
        help="deadline: give work up by urgency only, never refuse the heaviest at arrival",
    )
    parser.add_argument("--coefficients", type=Path, help="cost-model JSON (sim mode)")
    parser.add_argument(
        "--device-steps",
        choices=sorted(DEVICE_STEPS),
        help="sim mode: steps take what they took on this device, the model calibrated on it "
        "and refit online (h100: a graphed decode against an eager step with a prefill; "
        "h100-whole-step: steps with a prefill graphed too)",
    )
    parser.add_argument(
        "--plan-ahead",
        action="store_true",
        help="sim mode: plan each step while the one before runs, as the engine does on a GPU "
        "(engine mode: as the engine does)",
    )
    parser.add_argument(
        "--yardstick",
        type=Path,
        help="sim mode: cost-model JSON the workload's deadlines are set with (default: the "
        "run's model), as the engine mode sets them from requests measured alone on an idle "
        "engine",
    )
    parser.add_argument(
        "--engine-shape",
        action="store_true",
        help="sim mode: the engine mode's pools, lengths, aging and capacity batch",
    )
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
        type=positive_float,
        nargs="+",
        metavar="LOAD",
        help="ascending loads the capacity sweep tries before bisecting",
    )
    parser.add_argument("--capacity-bisections", type=int, default=None)
    parser.add_argument("--capacity-requests", type=positive_int, default=None)
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument(
        "--device", default="cpu", help="engine mode: cpu, cuda, cuda:N or auto (a GPU plans ahead)"
    )
    parser.add_argument(
        "--prefill-graph-tokens",
        type=non_negative_int,
        default=PREFILL_GRAPH_TOKENS,
        help="engine mode on CUDA: steps with a prefill of up to N tokens replay CUDA graphs",
    )
    # Defaults under bench-results/ (ignored by git), like the Makefile's benchmarks.
    parser.add_argument("--json", dest="json_path", default="bench-results/slo.json")
    parser.add_argument("--plot", dest="plot_path", default="bench-results/slo.png")
    parser.set_defaults(func=main)


def options_from_args(args: argparse.Namespace) -> SloOptions:
    mode = "sim" if args.sim else "engine"
    try:
        device = str(resolve_device(args.device))
    except ValueError as exc:
        raise SystemExit(f"slipstream bench slo: {exc}") from exc
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
        dtype=resolved_dtype(args.dtype, device) if mode == "engine" else args.dtype,
        device=device,
        prefill_graph_tokens=args.prefill_graph_tokens,
        json_path=args.json_path,
        plot_path=args.plot_path,
    )
    if mode == "engine":
        opts = engine_shaped(opts)
        # The step budget serve runs with on this device.
        on_gpu = device.startswith("cuda")
        budget = EngineConfig().step_token_budget(on_gpu=on_gpu)
        # The engine plans ahead on a GPU (EngineConfig.plan_ahead), and so do its twins.
        opts = replace(opts, max_num_batched_tokens=budget, plan_ahead=on_gpu)
    else:
        if args.engine_shape:
            opts = engine_shaped(opts)
        if args.plan_ahead:
            opts = replace(opts, plan_ahead=True)
    if mode != "sim" and (args.yardstick or args.engine_shape):
        raise SystemExit("--yardstick and --engine-shape shape a simulation: they take --sim")
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
    if args.yardstick:
        coeffs = CostCoefficients(**json.loads(args.yardstick.read_text()))
        opts = replace(opts, yardstick=coeffs)
    if args.calibration:
        from slipstream.service.bench.calibrate import load_calibration

        opts = replace(opts, coefficients=load_calibration(args.calibration))
    if args.device_steps:
        if mode != "sim":
            raise SystemExit("--device-steps simulates a device: it takes --sim")
        steps = device_steps(args.device_steps, opts.max_num_seqs)
        coeffs = calibrated_on(
            steps, opts.max_num_batched_tokens, opts.max_num_seqs, opts.block_size
        )
        opts = replace(opts, device_steps=args.device_steps, coefficients=coeffs)
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
    report = _run(opts)
    if opts.mode == "engine":
        report["hardware"] = hardware(args.dtype, opts.device)
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


def _run(opts: SloOptions) -> dict[str, object]:
    if opts.mode == "sim":
        return run_sim_capacity(opts) if opts.capacity else run_sim_bench(opts)
    # The engine mode loads torch and the model: only when it runs.
    from slipstream.service.bench.slo_engine import run_engine_bench, run_engine_capacity

    return run_engine_capacity(opts) if opts.capacity else run_engine_bench(opts)

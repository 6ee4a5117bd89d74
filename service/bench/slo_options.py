"""What one ``slipstream bench slo`` run is, whichever mode replays it: its
options, the scheduler and workload they make, and the grid of cells it
runs (cv x load x policy x deadline mode)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

from slipstream.scheduler.config import SchedulerConfig
from slipstream.scheduler.cost_model import CostCoefficients, CostModel
from slipstream.service.bench.slo_workload import DEFAULT_SLACK_FACTORS, WorkloadSpec
from slipstream.service.engine.config import PREFILL_GRAPH_TOKENS

LOADS = (0.8, 1.0, 1.5, 2.0)
CVS = (1.0, 3.0)
DEADLINE_MODES = ("enforced", "unaware")
BASELINES = ("fcfs", "priority")
SWEEP_LOADS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)  # the capacity search's
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
    # sim mode: the model the workload's deadlines are set with (None: the
    # run's own, ``coefficients``), as the engine mode's yardstick is
    yardstick: CostCoefficients | None = None
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
    device: str = "cpu"  # engine mode: as resolved (cpu, cuda:N)
    # sim mode: the device's steps (device_steps.DEVICE_STEPS), not the cost model's
    device_steps: str | None = None
    # engine mode on CUDA: EngineConfig.prefill_graph_tokens (0: steps with a prefill run eagerly)
    prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS
    # Each step planned while the one before runs: the engine's on a GPU, and
    # so its twins'; in sim mode --plan-ahead (Simulator's plan_ahead).
    plan_ahead: bool = False


def deadline_model(opts: SloOptions) -> CostModel:
    """The model a sim run's deadlines are set with (``yardstick``, else the run's)."""
    return CostModel(opts.yardstick if opts.yardstick is not None else opts.coefficients)


def engine_shaped(opts: SloOptions) -> SloOptions:
    """``opts`` with the engine mode's pools, lengths, aging and capacity
    batch: it replays in real time, so a few hundred short requests on a
    small pool, capacity from a batch of 3x ``max_num_seqs`` (saturated, not
    ramp-dominated)."""
    return replace(
        opts,
        num_device_blocks=256,
        num_host_blocks=128,
        prompt_len=(16, 128),
        output_len=(8, 48),
        capacity_requests=96,
        aging_s=10.0,
    )


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


def run_grid(opts: SloOptions) -> Iterator[tuple[float, float, str, str]]:
    """(cv, load, policy, deadline mode) of every run, in report order."""
    for cv in opts.cvs:
        for load in opts.loads:
            for policy in opts.policies:
                modes = opts.baseline_deadlines if policy in BASELINES else ("enforced",)
                for deadlines in modes:
                    yield cv, load, policy, deadlines


def run_header(policy: str, deadlines: str, load: float, cv: float, mode: str) -> dict[str, object]:
    """The fields that name a run's cell, first in every run of the report."""
    return {"policy": policy, "deadlines": deadlines, "load": load, "cv": cv, "mode": mode}


def options_json(opts: SloOptions) -> dict[str, object]:
    out = asdict(opts)
    out["coefficients"] = asdict(opts.coefficients)
    out["yardstick"] = None if opts.yardstick is None else asdict(opts.yardstick)
    return out

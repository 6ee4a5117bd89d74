"""Simulated mode of ``slipstream bench slo`` (``--sim``): the real
scheduler and policies on a fake clock, the cost model standing in for the
model. Also the simulated twins of the engine mode's runs
(``simulate_workload``) and its capacity predictions (``sim_capacity``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from slipstream.scheduler.cost_model import CostModel
from slipstream.scheduler.plan import StepPlan
from slipstream.scheduler.policy_registry import make_policy
from slipstream.scheduler.simulator import SimRequest, SimResult, resume_policy, simulate
from slipstream.service.bench.device_steps import device_steps
from slipstream.service.bench.slo_capacity import (
    Capacity,
    capacity_report,
    goodput_fraction,
    search_capacities,
)
from slipstream.service.bench.slo_options import (
    SloOptions,
    deadline_model,
    options_json,
    run_grid,
    run_header,
    scheduler_config,
    workload_spec,
)
from slipstream.service.bench.slo_report import grid_report
from slipstream.service.bench.slo_workload import (
    as_scheduled,
    make_requests,
    saturating_requests,
    scored_metrics,
)


def sim_capacity(opts: SloOptions, cost: CostModel | None = None) -> Capacity:
    """Throughput of a saturating batch, fcfs, no deadlines."""
    spec = workload_spec(opts, 1.0, 1.0)
    batch = saturating_requests(spec, opts.capacity_requests)
    cost = cost if cost is not None else CostModel(opts.coefficients)
    # The whole batch is queued at once: a queue limit must not turn it away.
    config = replace(
        scheduler_config(opts, "fcfs"), max_queue_len=max(opts.max_queue_len, len(batch))
    )
    result = simulate(
        batch, config, cost, step_seconds=simulated_device(opts), plan_ahead=opts.plan_ahead
    )
    return Capacity.of(batch, result.makespan_s)


def simulated_device(opts: SloOptions) -> Callable[[StepPlan], float] | None:
    """The simulated device's step time (None: the cost model's prediction)."""
    if opts.device_steps is None:
        return None
    return device_steps(opts.device_steps, opts.max_num_seqs)


def run_sim_bench(opts: SloOptions) -> dict[str, object]:
    capacity = sim_capacity(opts)
    runs = [
        sim_run(opts, policy, load, cv, capacity, deadlines)
        for cv, load, policy, deadlines in run_grid(opts)
    ]
    return {**grid_report(runs, capacity), "options": options_json(opts)}


def run_sim_capacity(opts: SloOptions) -> dict[str, object]:
    """Each policy's SLO capacity in the simulator (see ``slo_capacity``)."""
    capacity = sim_capacity(opts)
    cv = opts.cvs[0]
    results = search_capacities(
        opts, lambda policy, load: sim_run(opts, policy, load, cv, capacity)
    )
    return capacity_report(results, capacity, opts, cv, deadline_model(opts))


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
    result = simulate(
        as_scheduled(requests, deadlines),
        config,
        cost,
        scheduling,
        simulated_device(opts),
        plan_ahead=opts.plan_ahead,
    )
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
    requests = make_requests(spec, deadline_model(opts), opts.max_num_batched_tokens)
    started = time.perf_counter()
    result, metrics = simulate_workload(opts, policy, requests, cost, deadlines)
    wall = time.perf_counter() - started
    return {
        **run_header(policy, deadlines, load, cv, "sim"),
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

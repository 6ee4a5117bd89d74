"""``slipstream bench slo --capacity``: the SLO capacity of each policy.

Goodput is capped by capacity, so comparing goodput says little about a
scheduler. The serving literature (DistServe) asks instead: what is the
highest arrival rate at which the SLO attainment target still holds? Here
the target is class-0 attainment >= 99% and attainment over all requests
>= 90%; the rate is stated as a load (x measured capacity, see ``slo``) and
in requests per second.

Search, per policy (baselines with enforced deadlines): a seeded sweep over
``SWEEP_LOADS`` in ascending order up to the first load that misses the
target, then ``BISECTIONS`` bisection steps between the last load that met
it and that one. Every load evaluated is kept for the plot. Attainment is
not strictly monotone in load on one seed; the sweep's first miss bounds
the search, so a lucky pass above it is not reported as capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from slipstream.scheduler.cost_model import CostModel
from slipstream.scheduler.simulator import SimRequest
from slipstream.service.bench.slo_options import (
    SWEEP_LOADS,
    SloOptions,
    options_json,
    workload_spec,
)
from slipstream.service.bench.slo_workload import attainable_load, make_requests

BISECTIONS = 4
CLASS0_TARGET = 0.99
OVERALL_TARGET = 0.90

Run = dict[str, object]


@dataclass(frozen=True, slots=True)
class Capacity:
    """Throughput of a saturating batch: the ceiling of any policy's goodput."""

    rps: float
    tokens_per_s: float

    @staticmethod
    def of(batch: Sequence[SimRequest], makespan_s: float) -> Capacity:
        tokens = sum(r.output_len for r in batch)
        return Capacity(len(batch) / makespan_s, tokens / makespan_s)

    def report_fields(self) -> dict[str, float]:
        return {"capacity_rps": self.rps, "capacity_tokens_per_s": self.tokens_per_s}


def goodput_fraction(metrics: dict[str, object], capacity: Capacity) -> float:
    """A run's goodput as a fraction of ``capacity``'s token throughput."""
    return float(metrics["goodput_tokens_per_s"]) / capacity.tokens_per_s  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """``load`` is the highest load found to meet the target (0.0 when even
    the lowest swept load misses it); ``is_lower_bound`` when every swept
    load met it (the true capacity is higher); ``runs`` every evaluation."""

    policy: str
    load: float
    is_lower_bound: bool
    runs: list[Run]


def meets_target(run: Run) -> bool:
    """Class-0 attainment >= 99% and overall attainment >= 90%."""
    classes = run["classes"]
    assert isinstance(classes, dict)
    class0 = classes["0"]["attainment"]
    overall = run["attainment"]
    if class0 is None or overall is None:
        return False
    return float(class0) >= CLASS0_TARGET and float(overall) >= OVERALL_TARGET


def find_capacity(
    policy: str,
    evaluate: Callable[[float], Run],
    sweep: Sequence[float] = SWEEP_LOADS,
    bisections: int = BISECTIONS,
) -> CapacityResult:
    """The highest load at which ``evaluate(load)`` meets the target."""
    if not sweep or any(b <= a for a, b in pairwise(sweep)):
        raise ValueError("the sweep must be a non-empty ascending list of loads")
    runs: list[Run] = []
    passed, failed = 0.0, None
    for load in sweep:
        run = evaluate(load)
        runs.append(run)
        if not meets_target(run):
            failed = load
            break
        passed = load
    if failed is None:
        return CapacityResult(policy, passed, True, runs)
    low, high = passed, failed
    for _ in range(bisections):
        mid = (low + high) / 2
        run = evaluate(mid)
        runs.append(run)
        if meets_target(run):
            low = mid
        else:
            high = mid
    return CapacityResult(policy, low, False, runs)


def search_capacities(
    opts: SloOptions, evaluate: Callable[[str, float], Run]
) -> list[CapacityResult]:
    """Every policy's capacity, ``evaluate(policy, load)`` replaying one load."""
    return [
        find_capacity(
            policy,
            lambda load, policy=policy: evaluate(policy, load),  # type: ignore[misc]
            opts.capacity_sweep,
            opts.capacity_bisections,
        )
        for policy in opts.policies
    ]


def capacity_json(results: Sequence[CapacityResult], capacity_rps: float) -> dict[str, object]:
    """``{"<policy>": {"load": L, "rate_rps": R, "is_lower_bound": b}, ...}``."""
    return {
        r.policy: {
            "load": r.load,
            "rate_rps": r.load * capacity_rps,
            "is_lower_bound": r.is_lower_bound,
        }
        for r in results
    }


def capacity_ratios(capacity: dict[str, object]) -> dict[str, float | None]:
    """``deadline``'s capacity over each other policy's (None when absent or 0)."""
    ours = capacity.get("deadline")
    if not isinstance(ours, dict):
        return {}
    ratios: dict[str, float | None] = {}
    for policy, entry in capacity.items():
        if policy == "deadline" or not isinstance(entry, dict):
            continue
        theirs = float(entry["load"])
        ratios[f"over_{policy}"] = float(ours["load"]) / theirs if theirs > 0 else None
    return ratios


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
        **capacity.report_fields(),
        "options": options_json(opts),
    }

"""The SLO benchmark's workload and metrics (standard library only).

Workload: Gamma-distributed inter-arrival times with a given coefficient of
variation (CV 1 is Poisson; CV 3 is bursty) at a given rate; three priority
classes; each request's deadline is ``arrival + s[class] * isolated``, where
``isolated`` is the cost model's service time of the request running alone.

Deadline modes: a baseline policy runs ``enforced`` (the scheduler sees the
deadline and ends the request when it passes, as when a client's gRPC
deadline cancels it) or ``unaware`` (the scheduler never sees it; it only
scores the result — an engine without deadlines serving clients that wait).

Metrics (per class and overall): deadline attainment (met / submitted; early
rejections count as misses), goodput (output tokens of requests that met
their deadline per second of the arrival window — the same denominator for
every policy), TTFT and TPOT percentiles, queue wait (arrival to first
scheduled; for a request never scheduled, arrival to its end), preemptions,
early rejections, and the compute spent on requests that missed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from slipstream.scheduler.cost_model import CostModel
from slipstream.scheduler.request import FinishReason
from slipstream.scheduler.simulator import SimOutcome, SimRequest

CLASS_SHARES = (0.1, 0.3, 0.6)  # class 0 (urgent), 1, 2 (background)
# Tight, medium, loose multiples of the isolated service time. A full batch of
# 32 decodes runs each one ~8x slower than alone (the loaded slowdown), so
# class 0 at 10x has ~2 isolated service times of slack to queue in; class 2
# at 25x (not 50x) is loose yet tight enough that at 1.5x load queueing alone
# can make it miss, so the policies differ in what they do about that.
DEFAULT_SLACK_FACTORS = (10.0, 15.0, 25.0)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_requests: int
    rate_rps: float
    cv: float
    seed: int = 0
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 256)
    slack_factors: tuple[float, float, float] = DEFAULT_SLACK_FACTORS


def gamma_arrivals(num: int, rate_rps: float, cv: float, rng: random.Random) -> list[float]:
    """``num`` arrival times; inter-arrivals ~ Gamma(shape 1/cv^2) with mean 1/rate."""
    if rate_rps <= 0 or cv <= 0:
        raise ValueError("rate and cv must be > 0")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate_rps * shape)
    t, times = 0.0, []
    for _ in range(num):
        t += rng.gammavariate(shape, scale)
        times.append(t)
    return times


def make_requests(spec: WorkloadSpec, cost: CostModel, token_budget: int) -> list[SimRequest]:
    """A pure function of its arguments: same spec, same requests."""
    rng = random.Random(spec.seed)
    arrivals = gamma_arrivals(spec.num_requests, spec.rate_rps, spec.cv, rng)
    requests = []
    for i, arrival in enumerate(arrivals):
        prompt = _log_uniform(rng, spec.prompt_len)
        output = _log_uniform(rng, spec.output_len)
        cls = _pick_class(rng.random())
        isolated = isolated_seconds(cost, prompt, output, token_budget)
        requests.append(
            SimRequest(
                req_id=f"r{i}",
                arrival=arrival,
                prompt_len=prompt,
                output_len=output,
                priority=cls,
                deadline=arrival + spec.slack_factors[cls] * isolated,
                expected_output_tokens=output,
            )
        )
    return requests


def saturating_requests(spec: WorkloadSpec, num: int) -> list[SimRequest]:
    """The same length mix, all arriving at once and without deadlines: the
    workload whose makespan measures capacity."""
    rng = random.Random(spec.seed + 1)
    return [
        SimRequest(
            req_id=f"c{i}",
            arrival=0.0,
            prompt_len=_log_uniform(rng, spec.prompt_len),
            output_len=_log_uniform(rng, spec.output_len),
        )
        for i in range(num)
    ]


def hide_deadlines(requests: Sequence[SimRequest]) -> list[SimRequest]:
    """``requests`` as a deadline-``unaware`` scheduler receives them."""
    return [replace(r, deadline=None) for r in requests]


def as_scheduled(requests: Sequence[SimRequest], deadlines: str) -> Sequence[SimRequest]:
    """``requests`` as the scheduler receives them in deadline mode ``deadlines``."""
    return requests if deadlines == "enforced" else hide_deadlines(requests)


def score_against(
    outcomes: Sequence[SimOutcome], requests: Sequence[SimRequest]
) -> list[SimOutcome]:
    """``outcomes`` (in the order of ``requests``) judged against the
    requests' deadlines, whether or not the scheduler saw them."""
    scored = []
    for outcome, request in zip(outcomes, requests, strict=True):
        if outcome.req_id != request.req_id:
            raise ValueError(f"outcome {outcome.req_id!r} is not request {request.req_id!r}")
        scored.append(replace(outcome, deadline=request.deadline))
    return scored


def arrival_window(requests: Sequence[SimRequest]) -> float:
    """Seconds from the first arrival to the last: goodput's denominator."""
    return requests[-1].arrival - requests[0].arrival if len(requests) > 1 else 1.0


def scored_metrics(
    outcomes: Sequence[SimOutcome], requests: Sequence[SimRequest]
) -> dict[str, object]:
    """``run_metrics`` of ``outcomes`` judged against ``requests``' deadlines."""
    return run_metrics(score_against(outcomes, requests), arrival_window(requests))


def isolated_seconds(cost: CostModel, prompt: int, output: int, token_budget: int) -> float:
    return cost.service_seconds(0, prompt, output, token_budget)


def _pick_class(u: float) -> int:
    edge = 0.0
    for cls, share in enumerate(CLASS_SHARES):
        edge += share
        if u < edge:
            return cls
    return len(CLASS_SHARES) - 1


def _log_uniform(rng: random.Random, bounds: tuple[int, int]) -> int:
    low, high = bounds
    value = math.exp(rng.uniform(math.log(low), math.log(high + 1)))
    return min(high, max(low, int(value)))


# -- metrics ------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def queue_wait(o: SimOutcome) -> float:
    started = o.first_scheduled_time
    return (o.finish_time if started is None else started) - o.arrival


def tpot(o: SimOutcome) -> float | None:
    if o.first_token_time is None or o.num_output_tokens < 2:
        return None
    return (o.finish_time - o.first_token_time) / (o.num_output_tokens - 1)


def class_metrics(outcomes: Sequence[SimOutcome], window_s: float) -> dict[str, object]:
    met = [o for o in outcomes if o.met_deadline]
    ttfts = [o.first_token_time - o.arrival for o in outcomes if o.first_token_time is not None]
    tpots = [t for o in outcomes if (t := tpot(o)) is not None]
    waits = [queue_wait(o) for o in outcomes]
    missed = [o for o in outcomes if not o.met_deadline]
    return {
        "num_requests": len(outcomes),
        "attainment": len(met) / len(outcomes) if outcomes else None,
        "goodput_tokens_per_s": sum(o.num_output_tokens for o in met) / window_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "wait_p50_s": percentile(waits, 50),
        "wait_p99_s": percentile(waits, 99),
        "max_wait_s": max(waits, default=None),
        "preemptions": sum(o.num_preemptions for o in outcomes),
        "early_rejections": sum(o.rejection == "DeadlineInfeasible" for o in outcomes),
        "queue_full_rejections": sum(o.rejection == "QueueFull" for o in outcomes),
        "overload_refusals": sum(o.rejection == "Overloaded" for o in outcomes),
        "deadline_exceeded": sum(
            o.finish_reason is FinishReason.DEADLINE_EXCEEDED for o in outcomes
        ),
        "missed_compute_s": sum(o.compute_s for o in missed),
        "compute_s": sum(o.compute_s for o in outcomes),
    }


def run_metrics(outcomes: Sequence[SimOutcome], window_s: float) -> dict[str, object]:
    """Overall numbers plus ``classes``: {"0": {...}, "1": {...}, "2": {...}}."""
    overall = class_metrics(outcomes, window_s)
    classes = {
        str(cls): class_metrics([o for o in outcomes if o.priority == cls], window_s)
        for cls in range(len(CLASS_SHARES))
    }
    return {
        "attainment": overall["attainment"],
        "goodput_tokens_per_s": overall["goodput_tokens_per_s"],
        "early_rejections": overall["early_rejections"],
        "overload_refusals": overall["overload_refusals"],
        "missed_compute_s": overall["missed_compute_s"],
        "compute_s": overall["compute_s"],
        "classes": classes,
    }


# -- what any policy can attain -------------------------------------------------


def attainable_load(
    requests: Sequence[SimRequest],
    cost: CostModel,
    batch: int,
    overall_target: float,
    class0_target: float,
) -> float:
    """The highest load (x capacity) at which any policy could still meet
    ``overall_target`` of the requests and ``class0_target`` of class 0, in
    a long run: at load ``L`` only ``1 / L`` of the arriving work can be
    served, so the requests given up must carry ``1 - 1 / L`` of it, and the
    most they can carry is that of the heaviest ones the targets allow to be
    given up (greedy by weight, class 0 within its own allowance: optimal,
    the allowed sets form a matroid). Capacity is measured on the same length
    mix, so its unit of work cancels out; what this leaves out (a run's drain
    after the last arrival, batches below full) only lowers what is reachable."""
    weights = sorted(
        ((cost.batched_seconds(r.prompt_len, r.output_len, batch), r.priority) for r in requests),
        reverse=True,
    )
    total = sum(w for w, _ in weights)
    num_class0 = sum(cls == 0 for _, cls in weights)
    may_drop = math.floor(len(weights) * (1.0 - overall_target) + 1e-9)
    may_drop_class0 = math.floor(num_class0 * (1.0 - class0_target) + 1e-9)
    dropped = dropped_class0 = 0
    given_up = 0.0
    for weight, cls in weights:
        if dropped == may_drop:
            break
        if cls == 0:
            if dropped_class0 == may_drop_class0:
                continue
            dropped_class0 += 1
        dropped += 1
        given_up += weight
    kept = total - given_up
    return total / kept if kept > 0 else math.inf

"""Overload shedding: past capacity, the heaviest less-urgent arrivals are
turned away at the door (``overload.py``). Fake clocks only."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from slipstream.scheduler import (
    CostCoefficients,
    CostModel,
    Overloaded,
    QueueFull,
    Request,
    Scheduler,
    SchedulerConfig,
)
from slipstream.scheduler.overload import (
    MIN_ARRIVALS,
    NO_THRESHOLD,
    TARGET_UTILIZATION,
    WINDOW,
    OverloadShedder,
)
from slipstream.scheduler.simulator import SimRequest, simulate


def feed(
    shedder: OverloadShedder, rate: float, weights: list[float], start: float = 0.0
) -> list[bool]:
    """Arrivals ``1 / rate`` apart, all sheddable (class 2); which were admitted."""
    return [shedder.admits(start + i / rate, w, 2) for i, w in enumerate(weights)]


def log_uniform_weights(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [math.exp(rng.uniform(math.log(0.1), math.log(1.6))) for _ in range(n)]


def test_below_capacity_nothing_is_refused() -> None:
    shedder = OverloadShedder()
    weights = log_uniform_weights(4 * WINDOW)
    mean = sum(weights) / len(weights)
    # Offered load 0.8 of the service rate (1.0 weight-second per second):
    # the window's estimate wanders a few percent, never up to the target.
    admitted = feed(shedder, 0.8 / mean, weights)
    assert all(admitted)
    assert shedder.threshold == NO_THRESHOLD
    assert shedder.utilization() == pytest.approx(0.8, rel=0.1)


def test_past_capacity_the_heaviest_go_and_carry_the_excess() -> None:
    shedder = OverloadShedder()
    weights = log_uniform_weights(6 * WINDOW)
    mean = sum(weights) / len(weights)
    admitted = feed(shedder, 1.5 / mean, weights)
    steady = list(zip(weights[2 * WINDOW :], admitted[2 * WINDOW :], strict=True))
    refused = [w for w, ok in steady if not ok]
    kept = [w for w, ok in steady if ok]
    # Only the heaviest are refused: every refused one outweighs nearly all kept.
    assert refused and min(refused) >= sorted(kept)[int(0.9 * len(kept))]
    # They carry what the engine cannot serve: 1 - target / 1.5 of the work.
    share = sum(refused) / sum(w for w, _ in steady)
    assert share == pytest.approx(1.0 - TARGET_UTILIZATION / 1.5, abs=0.05)
    # Far fewer requests than that share of them.
    assert len(refused) / len(steady) < 0.6 * share


def test_never_sheds_the_unsheddable_and_says_nothing_before_enough_arrivals() -> None:
    shedder = OverloadShedder()
    heavy = 100.0
    # A flood far past capacity: the first arrivals say nothing about a rate.
    early = [shedder.admits(i * 0.01, heavy, 2) for i in range(MIN_ARRIVALS - 1)]
    assert all(early) and shedder.offered_load() == 0.0
    for i in range(MIN_ARRIVALS, 4 * WINDOW):
        shedder.admits(i * 0.01, heavy, None)  # class 0: counted, never refused
    assert shedder.utilization() > 100
    assert shedder.admits(4 * WINDOW * 0.01, heavy, None)
    assert not shedder.admits(4 * WINDOW * 0.01, heavy, 2)


def test_the_least_urgent_class_goes_first_then_weight_within_it() -> None:
    shedder = OverloadShedder()
    rng = random.Random(5)
    weights = log_uniform_weights(6 * WINDOW, seed=2)
    classes = [rng.choice((1, 2, 2)) for _ in weights]
    mean = sum(weights) / len(weights)
    # 1.3x: class 2 carries ~2/3 of the work, so its heaviest cover the excess.
    admitted = [
        shedder.admits(i * mean / 1.3, w, c)
        for i, (w, c) in enumerate(zip(weights, classes, strict=True))
    ]
    steady = list(zip(weights, classes, admitted, strict=True))[2 * WINDOW :]
    assert all(ok for _, c, ok in steady if c == 1)
    refused = [w for w, c, ok in steady if not ok]
    assert refused and all(c == 2 for _, c, ok in steady if not ok)
    # Past what class 2 can give (5x: 80 % of the work must go, class 2
    # carries two thirds), class 1 is shed too, and class 2 entirely.
    flood = OverloadShedder()
    admitted = [
        flood.admits(i * mean / 5.0, w, c)
        for i, (w, c) in enumerate(zip(weights, classes, strict=True))
    ]
    late = list(zip(classes, admitted, strict=True))[2 * WINDOW :]
    assert not any(ok for c, ok in late if c == 2)
    assert not all(ok for c, ok in late if c == 1)


def test_a_threshold_does_not_outlive_the_overload_once_the_engine_idled() -> None:
    shedder = OverloadShedder()
    weights = log_uniform_weights(3 * WINDOW)
    mean = sum(weights) / len(weights)
    feed(shedder, 2.0 / mean, weights)
    heaviest = max(weights)
    assert shedder.threshold != NO_THRESHOLD
    # The overload drained and the engine idled for ten times as long as the
    # window's arrivals took: the first arrival after it is judged on the
    # window as it is now, not turned away by the threshold of the last
    # overloaded moment.
    last = (len(weights) - 1) * mean / 2.0
    later = last + 10 * WINDOW * mean / 2.0
    stale = OverloadShedder()
    feed(stale, 2.0 / mean, weights)
    assert not stale.admits(later, heaviest, 2)  # without the idle, it would be
    shedder.observe_idle()
    assert shedder.admits(later, heaviest, 2)
    assert shedder.threshold == NO_THRESHOLD


def test_a_shifted_copy_decides_as_the_original_on_its_own_clock() -> None:
    original = OverloadShedder()
    weights = log_uniform_weights(4 * WINDOW, seed=7)
    mean = sum(weights) / len(weights)
    feed(original, 1.6 / mean, weights[: 2 * WINDOW])
    twin = original.shifted(-1000.0)
    start = 2 * WINDOW * mean / 1.6
    rest = weights[2 * WINDOW :]
    assert feed(twin, 1.6 / mean, rest, start - 1000.0) == feed(original, 1.6 / mean, rest, start)
    assert twin.threshold == original.threshold


# -- in the scheduler --------------------------------------------------------

COEFFS = CostCoefficients(0.01, 0.0004, 0.0015, 0.000002, 0.00005)


def config(**kwargs: object) -> SchedulerConfig:
    fields: dict[str, object] = {
        "num_device_blocks": 4096,
        "block_size": 16,
        "max_model_len": 1024,
        "max_num_seqs": 32,
    }
    fields.update(kwargs)
    return SchedulerConfig(**fields)  # type: ignore[arg-type]


def mixed_request(i: int, now: float, rng: random.Random) -> Request:
    """Class ``i % 3``, ~0.1 weight-seconds on average, a distant deadline."""
    return Request(
        req_id=f"r{i}",
        prompt_token_ids=[1] * rng.randint(32, 512),
        max_new_tokens=rng.randint(16, 256),
        priority=i % 3,
        arrival_time=now,
        deadline=now + 1000.0,
    )


def test_a_refused_arrival_is_overloaded_with_a_retry_hint_and_counted_by_class() -> None:
    sched = Scheduler(config(), cost_model=CostModel(COEFFS))
    rng = random.Random(3)
    refused: list[tuple[Request, Overloaded]] = []
    now = 0.0
    for i in range(3 * WINDOW):
        now += 0.01  # ~100 arrivals/s of ~0.1 weight-seconds each: ~10x capacity
        req = mixed_request(i, now, rng)
        try:
            sched.add_request(req, now)
        except Overloaded as exc:
            refused.append((req, exc))
    assert refused
    assert all(isinstance(exc, QueueFull) and exc.retry_after_s for _, exc in refused)
    assert all(req.priority > 0 for req, _ in refused)  # class 0 is never shed
    # ~10x capacity: all of class 2 cannot cover it, so class 1 goes too.
    assert {req.priority for req, _ in refused} == {1, 2}
    assert all(sched.get_request(req.req_id) is None for req, _ in refused)
    by_class = sched.num_overload_refused
    assert sum(by_class.values()) == len(refused) and 0 not in by_class
    assert "overloaded" in str(refused[0][1])


def test_requests_without_a_deadline_are_never_refused() -> None:
    sched = Scheduler(config(), cost_model=CostModel(COEFFS))
    for i in range(3 * WINDOW):
        now = i * 0.001
        req = Request(
            req_id=f"r{i}",
            prompt_token_ids=[1] * 512,
            max_new_tokens=256,
            priority=2,
            arrival_time=now,
        )
        sched.add_request(req, now)
    assert sched.num_waiting == 3 * WINDOW


def overload_workload(load_rps: float, num: int) -> list[SimRequest]:
    """Log-uniform lengths, three classes, deadlines 10 / 15 / 25x the isolated time."""
    rng = random.Random(11)
    cost = CostModel(COEFFS)
    requests, now = [], 0.0
    for i in range(num):
        now += rng.expovariate(load_rps)
        prompt = round(math.exp(rng.uniform(math.log(32), math.log(512))))
        output = round(math.exp(rng.uniform(math.log(16), math.log(256))))
        cls = rng.choices((0, 1, 2), (0.1, 0.3, 0.6))[0]
        isolated = cost.service_seconds(0, prompt, output, 512)
        requests.append(
            SimRequest(
                req_id=f"r{i}",
                arrival=now,
                prompt_len=prompt,
                output_len=output,
                priority=cls,
                deadline=now + (10.0, 15.0, 25.0)[cls] * isolated,
                expected_output_tokens=output,
            )
        )
    return requests


def met(outcome: object, request: SimRequest) -> bool:
    finish = outcome.finish_time  # type: ignore[attr-defined]
    reason = outcome.finish_reason.name  # type: ignore[attr-defined]
    return reason == "MAX_TOKENS" and request.deadline is not None and finish <= request.deadline


def test_shedding_the_heaviest_meets_more_deadlines_past_capacity() -> None:
    """1.25x the rate a saturated batch of this mix sustains (~3.7 req/s)."""
    requests = overload_workload(4.6, 1000)
    cost = CostModel(COEFFS)
    shedding = simulate(requests, config(), cost)
    urgency_only = simulate(requests, replace(config(), shed_under_overload=False), cost)
    attained = [
        sum(met(o, r) for o, r in zip(result.outcomes, requests, strict=True)) / len(requests)
        for result in (shedding, urgency_only)
    ]
    assert attained[0] > attained[1] + 0.05
    refused = [
        r for o, r in zip(shedding.outcomes, requests, strict=True) if o.rejection == "Overloaded"
    ]
    # 1.25x: the heaviest of class 2 cover the excess; nothing else is refused.
    assert refused and all(r.priority == 2 for r in refused)
    weight = [cost.batched_seconds(r.prompt_len, r.output_len, 32) for r in requests]
    median = sorted(weight)[len(weight) // 2]
    heavy = sum(cost.batched_seconds(r.prompt_len, r.output_len, 32) > median for r in refused)
    assert heavy == len(refused)
    # Class 0 is untouched by the shedding.
    class0 = [
        met(o, r) for o, r in zip(shedding.outcomes, requests, strict=True) if r.priority == 0
    ]
    assert sum(class0) / len(class0) >= 0.99


def _overload_arrivals(sched: Scheduler, first: int, count: int, shift: float) -> list[bool]:
    """``count`` arrivals at ~3x capacity (times shifted by ``shift``); which came in."""
    rng = random.Random(first)
    admitted = []
    for i in range(first, first + count):
        now = i * 0.03 + shift
        try:
            sched.add_request(mixed_request(i, now, rng), now)
            admitted.append(True)
        except Overloaded:
            admitted.append(False)
    return admitted


def test_a_twin_resumed_from_the_carried_state_refuses_what_the_original_does() -> None:
    """A simulated twin of a live engine starts where the engine's policy
    stood; a fresh one would admit everything until its window filled."""
    original = Scheduler(config(), cost_model=CostModel(COEFFS))
    assert not all(_overload_arrivals(original, 0, 2 * WINDOW, 0.0))
    carried = original.policy.carried_state(-500.0)  # the twin's clock starts 500 s later
    twin = Scheduler(config(), cost_model=CostModel(COEFFS))
    twin.policy.resume(carried)
    fresh = Scheduler(config(), cost_model=CostModel(COEFFS))
    expected = _overload_arrivals(original, 2 * WINDOW, MIN_ARRIVALS - 1, 0.0)
    assert not all(expected)
    assert _overload_arrivals(twin, 2 * WINDOW, MIN_ARRIVALS - 1, -500.0) == expected
    assert all(_overload_arrivals(fresh, 2 * WINDOW, MIN_ARRIVALS - 1, -500.0))
    with pytest.raises(TypeError):
        twin.policy.resume(None)

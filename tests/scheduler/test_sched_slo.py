"""Holding deadlines: first-token deadlines, priority-aware shedding, queued
work rejected once infeasible, and SLO-aware batch shaping. Fake clocks only:
the simulator's clock is the cost model."""

from __future__ import annotations

import random

import pytest
from sched_fakes import Driver, check_pools, make_request

from slipstream.scheduler import (
    BatchShaper,
    CostCoefficients,
    CostModel,
    DeadlineInfeasible,
    DeadlinePolicy,
    ExpiredLimit,
    FinishReason,
    QueueFull,
    RejectCause,
    Request,
    Scheduler,
    SchedulerConfig,
    StepPlan,
)
from slipstream.scheduler.simulator import SimRequest, Simulator

# One step costs 1 s plus 0.01 s per prefill token (as in test_sched_deadline).
COEFFS = CostCoefficients(1.0, 0.01, 0.0, 0.0, 0.001)


def make_sched(policy: str = "deadline", **kwargs: object) -> Scheduler:
    fields: dict[str, object] = {
        "num_device_blocks": 64,
        "block_size": 4,
        "max_model_len": 64,
        "num_host_blocks": 64,
        "policy": policy,
        "min_residency_s": 0.0,
    }
    fields.update(kwargs)
    return Scheduler(SchedulerConfig(**fields), cost_model=CostModel(COEFFS))  # type: ignore[arg-type]


def ended(driver: Driver, req_id: str) -> list[object]:
    return [f for plan in driver.plans for f in plan.finished if f.req_id == req_id]


# -- first-token deadline -------------------------------------------------------


def test_first_token_deadline_infeasible_at_arrival_is_rejected_with_its_limit() -> None:
    sched = make_sched(max_num_batched_tokens=4)
    req = make_request("r", 12, 2)  # 3 prefill chunks alone: 3 s to the first token
    req.first_token_deadline = 2.5
    with pytest.raises(DeadlineInfeasible) as info:
        sched.add_request(req)
    assert info.value.expired_limit is ExpiredLimit.FIRST_TOKEN
    assert "first-token" in str(info.value)
    ok = make_request("ok", 12, 2)
    ok.first_token_deadline = 3.5
    sched.add_request(ok)
    assert sched.num_waiting == 1


def test_whole_deadline_infeasible_says_deadline() -> None:
    sched = make_sched()
    with pytest.raises(DeadlineInfeasible) as info:
        sched.add_request(make_request("r", 4, 10, deadline=5.0))
    assert info.value.expired_limit is ExpiredLimit.DEADLINE


def test_a_tight_first_token_deadline_runs_ahead_of_earlier_work() -> None:
    sched = make_sched(max_num_seqs=1)
    driver = Driver(sched)
    sched.add_request(make_request("early", 4, 3, priority=1, arrival=0.0))
    late = make_request("late", 4, 20, priority=1, arrival=0.0)
    late.first_token_deadline = 2.5  # the first step is planned at t = 1
    sched.add_request(late)
    driver.step()
    assert [s.req_id for s in driver.plans[-1].seqs] == ["late"]
    driver.run_until_idle()
    assert driver.finishes["late"] == [FinishReason.MAX_TOKENS]


def test_queued_work_that_cannot_make_its_first_token_is_rejected_at_once() -> None:
    sched = make_sched(max_num_seqs=1)
    driver = Driver(sched)
    sched.add_request(make_request("long", 4, 30, priority=1, arrival=0.0))
    driver.step()
    doomed = make_request("doomed", 4, 2, priority=2, arrival=driver.now)
    doomed.first_token_deadline = 5.0  # feasible alone, but "long" holds the slot
    sched.add_request(doomed)
    while "doomed" not in driver.finishes:
        driver.step()
    (end,) = ended(driver, "doomed")
    assert end.reason is FinishReason.REJECTED
    assert end.reject_cause is RejectCause.DEADLINE_INFEASIBLE
    assert end.expired_limit is ExpiredLimit.FIRST_TOKEN
    assert driver.now < 5.0 and sched.num_waiting == 0
    check_pools(sched)


def test_first_token_expiry_carries_its_limit() -> None:
    sched = make_sched(policy="fcfs", max_num_seqs=1)
    driver = Driver(sched)
    sched.add_request(make_request("long", 4, 30, arrival=0.0))
    late = make_request("late", 4, 2, arrival=0.0)
    late.first_token_deadline = 3.0
    sched.add_request(late)
    while "late" not in driver.finishes:
        driver.step()
    (end,) = ended(driver, "late")
    assert end.reason is FinishReason.DEADLINE_EXCEEDED
    assert end.expired_limit is ExpiredLimit.FIRST_TOKEN


def test_work_without_a_time_limit_is_never_rejected_as_infeasible() -> None:
    sched = make_sched(max_num_seqs=2, max_queue_len=1000)
    driver = Driver(sched)
    for i in range(40):
        sched.add_request(make_request(f"r{i}", 4, 6, priority=i % 3))
    driver.run_until_idle()
    assert all(v == [FinishReason.MAX_TOKENS] for v in driver.finishes.values())
    assert sched.num_abandoned == 0


# -- shedding ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["deadline", "priority"])
def test_full_queue_sheds_the_least_urgent_class_for_a_more_urgent_newcomer(policy: str) -> None:
    sched = make_sched(policy, max_queue_len=3)
    for i, cls in enumerate((1, 2, 2)):
        sched.add_request(make_request(f"q{i}", 4, 2, priority=cls))
    sched.add_request(make_request("urgent", 4, 2, priority=0))
    # The least urgent class, latest arrival, gave its place up ...
    assert sched.get_request("q2") is None and sched.num_waiting == 3
    plan = sched.schedule(0.1)
    (shed,) = [f for f in plan.finished if f.req_id == "q2"]
    assert shed.reason is FinishReason.REJECTED and shed.reject_cause is RejectCause.SHED
    assert shed.retry_after_s is not None and shed.retry_after_s > 0
    assert "retry after" in shed.message
    assert sched.num_shed_by_priority() == {2: 1}
    # ... and the next plan does not report it again.
    sched.update(plan, {s.req_id: 1 for s in plan.seqs if s.sample}, 0.2)
    assert not [f for f in sched.schedule(0.3).finished if f.req_id == "q2"]


def test_equal_class_newcomer_is_refused_with_a_retry_hint() -> None:
    sched = make_sched("deadline", max_queue_len=2)
    for i in range(2):
        sched.add_request(make_request(f"q{i}", 4, 2, priority=1))
    with pytest.raises(QueueFull) as info:
        sched.add_request(make_request("same", 4, 2, priority=1))
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    assert "retry after" in str(info.value)
    assert sched.num_waiting == 2 and sched.get_request("same") is None


def test_fcfs_never_sheds() -> None:
    sched = make_sched("fcfs", max_queue_len=1)
    sched.add_request(make_request("bg", 4, 2, priority=2))
    with pytest.raises(QueueFull):
        sched.add_request(make_request("urgent", 4, 2, priority=0))


@pytest.mark.parametrize("policy", ["deadline", "priority"])
def test_at_twice_capacity_class0_is_never_refused_while_class2_waits(policy: str) -> None:
    cost = CostModel(CostCoefficients(0.01, 0.0004, 0.0015, 0.000002, 0.00005))
    config = SchedulerConfig(
        num_device_blocks=512,
        block_size=16,
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_host_blocks=256,
        max_queue_len=64,
        policy=policy,
    )
    # Capacity of this mix is ~20 req/s (16 decodes of ~100 steps, ~40 ms a step): 2x is 40.
    rng = random.Random(3)
    requests, now = [], 0.0
    for i in range(1500):
        now += rng.expovariate(40.0)
        cls = rng.choice((0, 1, 2, 2))
        requests.append(
            SimRequest(f"r{i}", now, rng.randint(16, 128), rng.randint(40, 160), priority=cls)
        )
    sim = Simulator(config, cost)
    sched = sim.scheduler
    refusals: list[dict[int, dict[str, int]]] = []
    add = sched.add_request

    def add_request(req: Request, now: float | None = None) -> None:
        try:
            add(req, now)
        except QueueFull:
            if req.priority == 0:
                refusals.append(sched.counts_by_priority())
            raise

    sched.add_request = add_request  # type: ignore[method-assign]
    result = sim.run(requests)
    queue_full = [o for o in result.outcomes if o.rejection == "QueueFull"]
    shed = [o for o in result.outcomes if o.rejection == "Shed"]
    assert queue_full and shed  # the queue did overflow, and shedding happened
    assert {o.priority for o in shed} <= {1, 2}
    assert all(counts.get(2, {}).get("waiting", 0) == 0 for counts in refusals)
    assert sum(sched.num_shed_by_priority().values()) == len(shed)


# -- batch shaping ----------------------------------------------------------------

# Every decode in a batch costs as much as the step's fixed part: a full
# batch is many times slower per step than a small one.
SHAPING_COEFFS = CostCoefficients(0.01, 0.0001, 0.01, 0.0, 0.0001)


class NoShapingPolicy(DeadlinePolicy):
    name = "deadline-unshaped"

    def batch_shaper(self, now: float) -> None:  # type: ignore[override]
        return None


def run_clocked(
    sched: Scheduler, cost: CostModel, arrivals: list[tuple[float, Request]], until: float
) -> tuple[list[tuple[float, StepPlan]], dict[str, tuple[FinishReason, float]]]:
    """schedule -> clock += predicted step -> update, submitting on arrival."""
    now, plans, finishes = 0.0, [], {}
    pending = sorted(arrivals, key=lambda a: a[0])
    while now < until and (pending or sched.has_unfinished()):
        while pending and pending[0][0] <= now:
            sched.add_request(pending.pop(0)[1], now)
        plan = sched.schedule(now)
        for f in plan.finished:
            finishes[f.req_id] = (f.reason, now)
        now += cost.plan_seconds(plan) if plan.seqs else cost.idle_seconds()
        plans.append((now, plan))
        for out in sched.update(plan, {s.req_id: 1 for s in plan.seqs if s.sample}, now):
            if out.finish_reason is not None:
                finishes[out.req_id] = (out.finish_reason, now)
    return plans, finishes


def shaping_workload() -> list[tuple[float, Request]]:
    arrivals = [(0.0, make_request(f"bg{i}", 8, 200, priority=2, arrival=0.0)) for i in range(30)]
    # Alone: ~50 steps of 20 ms = 1 s. In the full batch: 50 x 0.32 s = 16 s.
    urgent = make_request("urgent", 8, 50, priority=0, arrival=1.0, deadline=3.5)
    arrivals.append((1.0, urgent))
    return arrivals


def shaping_sched(policy: DeadlinePolicy | None, cost: CostModel) -> Scheduler:
    config = SchedulerConfig(
        num_device_blocks=2048,
        block_size=16,
        max_model_len=512,
        max_num_seqs=32,
        max_num_batched_tokens=512,
    )
    return Scheduler(config, policy, cost)


def test_batch_shaping_holds_back_background_decodes_so_urgent_work_meets_its_deadline() -> None:
    cost = CostModel(SHAPING_COEFFS)
    sched = shaping_sched(None, cost)
    arrivals = shaping_workload()
    plans, finishes = run_clocked(sched, cost, arrivals, until=200.0)
    reason, finish_time = finishes["urgent"]
    assert reason is FinishReason.MAX_TOKENS and finish_time <= 3.5
    assert sched.num_held_back > 0
    # Each request counts the steps it was held back in: for the background
    # (admitted at once, never preempted) every step it sat out before it finished.
    requests = {req.req_id: req for _, req in arrivals}
    assert requests["urgent"].num_held_back == 0
    for i in range(30):
        req_id = f"bg{i}"
        sat_out = sum(
            1
            for t, plan in plans
            if t <= finishes[req_id][1] and all(s.req_id != req_id for s in plan.seqs)
        )
        assert requests[req_id].num_held_back == sat_out
    assert sum(req.num_held_back for req in requests.values()) == sched.num_held_back
    # Capacity comes back once the urgency has passed: the next step runs every background decode.
    after = [plan for t, plan in plans if t > finish_time]
    assert len(after[1].seqs) == 30
    # Nothing was preempted: held-back work keeps its blocks and resumes.
    assert sched.num_recompute_preemptions == sched.num_swap_preemptions == 0
    assert all(finishes[f"bg{i}"][0] is FinishReason.MAX_TOKENS for i in range(30))


def test_without_shaping_the_same_urgent_request_misses() -> None:
    cost = CostModel(SHAPING_COEFFS)
    config = shaping_sched(None, cost).config
    sched = shaping_sched(NoShapingPolicy(config, cost), cost)
    _, finishes = run_clocked(sched, cost, shaping_workload(), until=200.0)
    assert finishes["urgent"][0] is FinishReason.DEADLINE_EXCEEDED


def test_shaping_changes_nothing_while_every_ceiling_holds() -> None:
    cost = CostModel(SHAPING_COEFFS)
    arrivals = shaping_workload()
    arrivals[-1][1].deadline = 60.0  # loose: a full batch is fast enough
    sched = shaping_sched(None, cost)
    run_clocked(sched, cost, arrivals, until=100.0)
    assert sched.num_held_back == 0
    assert all(req.num_held_back == 0 for _, req in arrivals)


def test_shaper_shortens_a_prefill_chunk_before_holding_it_back() -> None:
    cost = CostModel(CostCoefficients(0.01, 0.001, 0.01, 0.0, 0.0))
    ceilings = {"urgent": 0.1}
    shaper = BatchShaper(cost, 0.0, lambda r, now: ceilings.get(r.req_id, float("inf")))
    urgent = make_request("urgent", 1, 4)
    urgent.output_token_ids.append(1)
    urgent.num_computed_tokens = 1  # a decode: 1 uncomputed token, one output so far
    assert shaper.fit(urgent, 1) == 1
    shaper.commit(urgent, 1)  # step: 0.01 + 0.01 = 0.02 s, ceiling 0.1 s
    prefill = make_request("bg", 200, 4, priority=2)
    assert shaper.fit(prefill, 200) == 80  # 0.08 s of room at 1 ms a token
    shaper.commit(prefill, 80)
    assert shaper.fit(make_request("more", 50, 4, priority=1), 50) == 0
    assert shaper.predicted_step_s == pytest.approx(0.1)
    # Class 0 holds back class 0 too; other classes never hold back their own.
    assert shaper.fit(make_request("peer", 50, 4, priority=0), 50) == 0
    assert shaper.ceiling_s == pytest.approx(0.1)
    other = BatchShaper(cost, 0.0, lambda r, now: ceilings.get(r.req_id, float("inf")))
    ceilings["c1"] = 0.05
    other.commit(make_request("c1", 1, 4, priority=1), 1)
    assert other.fit(make_request("c1-peer", 200, 4, priority=1), 200) == 200
    assert other.fit(make_request("c2", 200, 4, priority=2), 200) < 200


def test_the_reserve_keeps_steps_short_for_class_0_arrivals_not_yet_here() -> None:
    """With no class-0 work in the step, recent class-0 arrivals' ceilings
    still bound less urgent work — but never the first candidate of a step,
    never class-0 work itself, and not once class-0 arrivals have stopped."""
    from slipstream.scheduler.batch_shaping import ArrivalReserve

    cost = CostModel(CostCoefficients(0.01, 0.001, 0.01, 0.0, 0.0))
    reserve = ArrivalReserve()
    assert reserve.ceiling_s(0.0) == float("inf")
    for i in range(10):
        reserve.observe(i * 0.1, 0.05 + 0.01 * i)  # ceilings 0.05 .. 0.14 s
    assert reserve.ceiling_s(1.0) == pytest.approx(0.05)  # a low quantile
    assert reserve.ceiling_s(100.0) == float("inf")  # arrivals stopped

    shaper = BatchShaper(cost, 1.0, lambda r, now: float("inf"), reserve.ceiling_s(1.0))
    first = make_request("first", 200, 4, priority=2)
    assert shaper.fit(first, 200) == 200  # never an empty step
    shaper.commit(first, 10)  # 0.01 + 0.01 s
    assert shaper.fit(make_request("bg", 200, 4, priority=1), 200) == 30  # 0.03 s left
    assert shaper.fit(make_request("c0", 200, 4, priority=0), 200) == 200
    unreserved = BatchShaper(cost, 1.0, lambda r, now: float("inf"))
    unreserved.commit(first, 10)
    assert unreserved.fit(make_request("bg", 200, 4, priority=1), 200) == 200
    # A reserve no step can meet (below one decode step) is ignored.
    hopeless = BatchShaper(cost, 1.0, lambda r, now: float("inf"), 0.015)
    hopeless.commit(first, 10)
    assert hopeless.fit(make_request("bg", 200, 4, priority=1), 200) == 200


# -- the cost model's own error -------------------------------------------------


def test_overrun_tracks_steps_that_run_past_their_prediction() -> None:
    from slipstream.scheduler.cost_model import MAX_OVERRUN, StepShape

    shape = StepShape(num_prefill_tokens=0, num_decode_seqs=4, num_context_tokens=400)
    # forgetting 1 and a heavy prior: the coefficients barely move, the error stays
    model = CostModel(CostCoefficients(0.1, 0.0, 0.0, 0.0), forgetting=1.0, prior_weight=1e9)
    assert model.overrun == 0.0
    for _ in range(200):
        model.observe(shape, 0.12)  # 20 % slower than predicted, every step
    assert model.overrun == pytest.approx(0.2, abs=0.01)
    for _ in range(200):
        model.observe(shape, 0.05)  # faster than predicted: no overrun
    assert model.overrun < 0.001
    for _ in range(200):
        model.observe(shape, 10.0)  # a stall: capped
    assert model.overrun == pytest.approx(MAX_OVERRUN, abs=0.01)


def test_step_ceilings_keep_the_models_overrun_in_hand() -> None:
    from slipstream.scheduler.cost_model import StepShape

    cost = CostModel(CostCoefficients(0.1, 0.0, 0.0, 0.0), forgetting=1.0, prior_weight=1e9)
    config = SchedulerConfig(
        num_device_blocks=64, block_size=4, max_model_len=64, policy="deadline"
    )
    policy = DeadlinePolicy(config, cost)
    req = make_request("r", 8, 10)
    req.deadline = 5.0
    exact = policy.step_ceiling(req, 0.0)
    shape = StepShape(num_prefill_tokens=0, num_decode_seqs=1, num_context_tokens=10)
    for _ in range(300):
        cost.observe(shape, 0.125)  # 25 % over
    assert policy.step_ceiling(req, 0.0) == pytest.approx(exact / (1 + cost.overrun))
    assert policy.step_ceiling(req, 0.0) < exact / 1.2


def test_a_model_can_start_with_a_margin_measured_elsewhere() -> None:
    from slipstream.scheduler.cost_model import MAX_OVERRUN, StepShape

    coeffs = CostCoefficients(0.1, 0.0, 0.0, 0.0)
    assert CostModel(coeffs, overrun=0.15).overrun == 0.15
    assert CostModel(coeffs, overrun=3.0).overrun == MAX_OVERRUN
    assert CostModel(coeffs, overrun=-1.0).overrun == 0.0
    seeded = CostModel(coeffs, forgetting=1.0, prior_weight=1e9, overrun=0.3)
    shape = StepShape(num_prefill_tokens=0, num_decode_seqs=1, num_context_tokens=10)
    for _ in range(200):
        seeded.observe(shape, 0.1)  # exactly as predicted: the margin wears off
    assert seeded.overrun < 0.001

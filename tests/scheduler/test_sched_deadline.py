"""The deadline policy and the cost model: fake clock, tiny pools, the paged
fake runner."""

from __future__ import annotations

import random

import pytest
from sched_fakes import Driver, check_pools, make_request, reference_outputs

from slipstream.scheduler import (
    CostCoefficients,
    CostModel,
    DeadlineInfeasible,
    DeadlinePolicy,
    ExpiredLimit,
    FinishReason,
    PreemptionMode,
    RejectCause,
    Scheduler,
    SchedulerConfig,
    StepShape,
)
from slipstream.scheduler.deadline_policy import duration

# One step costs 1 s plus 0.01 s per prefill token: easy to reason about.
COEFFS = CostCoefficients(1.0, 0.01, 0.0, 0.0, 0.001)


def make_sched(**kwargs: object) -> Scheduler:
    fields: dict[str, object] = {
        "num_device_blocks": 64,
        "block_size": 4,
        "max_model_len": 64,
        "num_host_blocks": 64,
        "policy": "deadline",
        "min_residency_s": 0.0,
    }
    fields.update(kwargs)
    return Scheduler(SchedulerConfig(**fields), cost_model=CostModel(COEFFS))  # type: ignore[arg-type]


def test_urgent_request_preempts_less_urgent_running_work_for_a_seq_slot() -> None:
    sched = make_sched(max_num_seqs=2)
    driver = Driver(sched)
    for i in range(2):
        sched.add_request(make_request(f"low{i}", 4, 8, priority=2, arrival=0.0))
    driver.step()
    # 6 s of deadline: too tight to wait ~7 s for a running request to finish.
    sched.add_request(
        make_request("urgent", 4, 2, priority=0, arrival=driver.now, deadline=driver.now + 6.0)
    )
    driver.step()
    plan = driver.plans[-1]
    assert plan.preempted_req_ids == ["low1"]  # same class and slack: the later arrival
    assert "urgent" in {s.req_id for s in plan.seqs}
    driver.run_until_idle()
    for req_id in ("low0", "low1"):
        assert driver.finishes[req_id] == [FinishReason.MAX_TOKENS]
    check_pools(sched)


def test_fcfs_and_priority_never_preempt_for_admission() -> None:
    for policy in ("fcfs", "priority"):
        sched = make_sched(max_num_seqs=2, policy=policy)
        driver = Driver(sched)
        for i in range(2):
            sched.add_request(make_request(f"low{i}", 4, 8, priority=2))
        driver.step()
        sched.add_request(make_request("urgent", 4, 2, priority=0, arrival=driver.now))
        driver.step()
        assert not driver.plans[-1].preempted_req_ids


def test_victim_is_least_urgent_class_then_most_slack() -> None:
    sched = make_sched(max_num_seqs=3)
    driver = Driver(sched)
    sched.add_request(make_request("c1", 4, 20, priority=1, deadline=500.0))
    sched.add_request(make_request("c2-tight", 4, 20, priority=2, deadline=200.0))
    sched.add_request(make_request("c2-loose", 4, 20, priority=2, deadline=400.0))
    driver.step()
    sched.add_request(
        make_request("urgent", 4, 2, priority=0, arrival=driver.now, deadline=driver.now + 6.0)
    )
    driver.step()
    assert driver.plans[-1].preempted_req_ids == ["c2-loose"]


def test_urgent_work_pushes_out_just_enough_prefill_for_its_share_of_the_budget() -> None:
    # Budget 8 tokens, blocks of 8: a running prefill needs 8 tokens to make
    # progress, a decode 1 — 9 together, no room for the urgent 4-token prompt.
    sched = make_sched(max_num_seqs=4, max_num_batched_tokens=8, block_size=8)
    driver = Driver(sched)
    sched.add_request(make_request("decode", 4, 20, priority=2))
    sched.add_request(make_request("prefill", 40, 4, priority=2))
    driver.step()
    assert {s.req_id for s in driver.plans[-1].seqs} == {"decode", "prefill"}
    sched.add_request(
        make_request("urgent", 4, 2, priority=0, arrival=driver.now, deadline=driver.now + 6.0)
    )
    driver.step()
    plan = driver.plans[-1]
    assert plan.preempted_req_ids == ["prefill"]  # the decode alone leaves room
    assert [(s.req_id, len(s.token_ids)) for s in plan.seqs] == [("decode", 1), ("urgent", 4)]


def test_urgent_work_with_slack_to_spare_waits_instead_of_preempting() -> None:
    sched = make_sched(max_num_seqs=2)
    driver = Driver(sched)
    for i in range(2):
        sched.add_request(make_request(f"low{i}", 4, 8, priority=2, arrival=0.0))
    driver.step()
    # The running requests finish in ~7 s; 40 s of deadline can wait for that.
    sched.add_request(
        make_request("urgent", 4, 2, priority=0, arrival=driver.now, deadline=driver.now + 40.0)
    )
    driver.run_until_idle()
    assert sched.num_swap_preemptions + sched.num_recompute_preemptions == 0
    assert driver.finishes["urgent"] == [FinishReason.MAX_TOKENS]


def test_waiting_work_that_cannot_make_its_deadline_is_abandoned_early() -> None:
    sched = make_sched(max_num_seqs=1)
    driver = Driver(sched)
    sched.add_request(make_request("long", 4, 30, priority=1, arrival=0.0))
    driver.step()
    # Feasible alone at arrival (2 steps), but "long" holds the only slot for
    # ~29 s: once less than 2 steps' time is left it is ended, before t = 8.
    sched.add_request(make_request("doomed", 4, 2, priority=2, arrival=driver.now, deadline=8.0))
    while "doomed" not in driver.finishes:
        driver.step()
    # It never ran: rejected as infeasible, its queue slot freed at once.
    assert driver.finishes["doomed"] == [FinishReason.REJECTED]
    (ended,) = [f for plan in driver.plans for f in plan.finished if f.req_id == "doomed"]
    assert ended.reject_cause is RejectCause.DEADLINE_INFEASIBLE
    assert ended.expired_limit is ExpiredLimit.DEADLINE
    assert driver.now < 8.0 and sched.num_abandoned == 1 and sched.num_expired == 0
    assert sched.num_waiting == 0
    check_pools(sched)


def test_same_class_waiting_work_does_not_preempt() -> None:
    sched = make_sched(max_num_seqs=1)
    driver = Driver(sched)
    sched.add_request(make_request("a", 4, 10, priority=1, deadline=900.0))
    driver.step()
    sched.add_request(make_request("b", 4, 2, priority=1, arrival=driver.now, deadline=30.0))
    driver.step()
    assert not driver.plans[-1].preempted_req_ids


def test_infeasible_deadline_is_rejected_early_unless_switched_off() -> None:
    # Alone, 8 prompt tokens + 4 outputs take 4 steps of >= 1 s.
    sched = make_sched()
    with pytest.raises(DeadlineInfeasible, match="needs an estimated") as refused:
        sched.add_request(make_request("x", 8, 4, arrival=10.0, deadline=12.0))
    assert str(refused.value).startswith("deadline in 2 s, but running alone it needs")
    assert sched.get_request("x") is None and sched.num_waiting == 0
    sched.add_request(make_request("ok", 8, 4, arrival=10.0, deadline=15.0))
    permissive = make_sched(reject_infeasible=False)
    permissive.add_request(make_request("x", 8, 4, arrival=10.0, deadline=12.0))
    assert permissive.num_waiting == 1


def test_a_deadline_already_passed_is_refused_saying_how_long_ago() -> None:
    """Not "deadline in -1795903788 s" (an absolute deadline decades old)."""
    sched = make_sched()
    with pytest.raises(DeadlineInfeasible) as refused:
        sched.add_request(make_request("old", 8, 4, arrival=10.0, deadline=10.0 - 1_795_903_788))
    assert str(refused.value) == "deadline passed 1795903788 s ago"
    late = make_request("late", 8, 4, arrival=10.0)
    late.first_token_deadline = 9.5
    with pytest.raises(DeadlineInfeasible) as refused:
        sched.add_request(late)
    assert str(refused.value) == "first-token deadline passed 500 ms ago"


def test_past_deadline_finishes_deadline_exceeded_and_is_not_preempted() -> None:
    sched = make_sched(max_num_seqs=1, reject_infeasible=False)
    driver = Driver(sched)
    sched.add_request(make_request("late", 4, 20, priority=2, deadline=3.5))
    driver.step()
    sched.add_request(make_request("urgent", 4, 2, priority=0, arrival=driver.now))
    while "late" not in driver.finishes:
        driver.step()
    # Hopeless from its arrival and never run: rejected as infeasible, not left to expire.
    assert driver.finishes["late"] == [FinishReason.REJECTED]
    # Hopeless work is preempted first (no time to waste on it) but never swapped.
    assert sched.num_swap_preemptions == 0


def test_aging_bounds_the_wait_of_the_least_urgent_class() -> None:
    def first_start(aging_s: float) -> float | None:
        sched = make_sched(max_num_seqs=1, aging_s=aging_s)
        driver = Driver(sched)
        background = make_request("bg", 2, 2, priority=2, arrival=0.0)
        sched.add_request(background)
        for i in range(60):  # a class-0 request always waiting: without aging, bg starves
            sched.add_request(make_request(f"u{i}", 2, 2, priority=0, arrival=driver.now))
            driver.step()
            driver.step()
        return background.first_scheduled_time

    started = first_start(aging_s=20.0)
    assert started is not None and started <= 2 * 20.0 + 3.0
    assert first_start(aging_s=0.0) is None


def test_resumed_request_is_protected_for_min_residency() -> None:
    sched = make_sched(max_num_seqs=1, min_residency_s=5.0)
    driver = Driver(sched)
    sched.add_request(make_request("low", 4, 20, priority=2))
    driver.step()  # admitted at t=1
    sched.add_request(
        make_request("urgent", 2, 2, priority=0, arrival=driver.now, deadline=driver.now + 12.0)
    )
    preempted_at = None
    while preempted_at is None:
        driver.step()
        if driver.plans[-1].preempted_req_ids:
            preempted_at = driver.now
    assert preempted_at >= 1.0 + 5.0


def test_swap_or_recompute_by_cost() -> None:
    config = SchedulerConfig(num_device_blocks=8, block_size=4, max_model_len=32)
    victim = make_request("v", 16, 4)
    victim.block_ids = [0, 1, 2, 3]
    victim.num_computed_tokens = 16
    cheap_swap = DeadlinePolicy(config, CostModel(CostCoefficients(1.0, 0.01, 0, 0, 0.001)))
    dear_swap = DeadlinePolicy(config, CostModel(CostCoefficients(0.001, 0.0, 0, 0, 1.0)))
    assert cheap_swap.preemption_mode(victim, True, 0.0) is PreemptionMode.SWAP
    assert dear_swap.preemption_mode(victim, True, 0.0) is PreemptionMode.RECOMPUTE
    assert cheap_swap.preemption_mode(victim, False, 0.0) is PreemptionMode.RECOMPUTE


def test_deadline_policy_runs_mixed_work_exactly_with_swaps() -> None:
    sched = make_sched(num_device_blocks=10, block_size=2, max_model_len=20, num_host_blocks=6)
    driver = Driver(sched)
    reqs = [
        make_request(f"r{i}", 4 + i % 3, 6, priority=i % 3, arrival=float(i), deadline=400.0 + i)
        for i in range(8)
    ]
    for req in reqs:
        sched.add_request(req)
    driver.run_until_idle()
    assert sched.num_swap_preemptions + sched.num_recompute_preemptions > 0
    for req in reqs:
        assert driver.outputs[req.req_id] == reference_outputs(req)
    check_pools(sched)
    assert sched.num_used_device_blocks == sched.num_used_host_blocks == 0


def test_cost_model_online_fit_recovers_the_true_coefficients() -> None:
    truth = CostModel(CostCoefficients(0.02, 0.0005, 0.003, 0.00001, 0.0))
    model = CostModel()  # starts from the default guess
    shapes = [StepShape(p, d, c) for p in (0, 64, 512) for d in (0, 4, 32) for c in (100, 5000)]
    for _ in range(40):  # five unknowns: 20 rounds left a 3 % error, 40 under 1 %
        for shape in shapes:
            if shape.num_prefill_tokens or shape.num_decode_seqs:
                model.observe(shape, truth.step_seconds(shape))
    for shape in shapes:
        assert model.step_seconds(shape) == pytest.approx(truth.step_seconds(shape), rel=0.02)


def _steady_steps(model: CostModel, truth: CostModel, num: int, seed: int = 0) -> None:
    """Mostly full decode batches (prefill rare): the shape mix of a loaded engine."""
    rng = random.Random(seed)
    for i in range(num):
        decodes = 32 if i % 400 < 350 else rng.randint(1, 4)
        prefill = 0 if rng.random() < 0.9 else rng.randint(16, 512)
        shape = StepShape(prefill, decodes, decodes * rng.randint(60, 160) + prefill)
        model.observe(shape, truth.step_seconds(shape) * rng.uniform(0.95, 1.1))


TRUTH = CostCoefficients(0.015, 0.0007, 0.0007, 2.4e-6, 0.0)
START = CostCoefficients(0.0042, 0.00066, 0.00044, 4.1e-6, 0.0)  # a start-up calibration


def test_one_stall_does_not_poison_the_online_fit() -> None:
    """A single step 200x its prediction (a page-fault storm, a recompile)
    once moved the model tenfold; the scheduler then judged every request
    infeasible and no step ran again to correct it."""
    truth = CostModel(TRUTH)
    model = CostModel(START)
    _steady_steps(model, truth, 3000)
    lone = StepShape(0, 1, 100)
    before = model.step_seconds(lone)
    model.observe(lone, 3.0)
    _steady_steps(model, truth, 50, seed=1)
    assert model.step_seconds(lone) < 1.2 * before
    assert model.step_seconds(lone) == pytest.approx(truth.step_seconds(lone), rel=0.15)


def test_a_lasting_slowdown_is_still_followed() -> None:
    truth = CostModel(TRUTH)
    slower = CostModel(CostCoefficients(0.045, 0.0021, 0.0021, 7.2e-6, 0.0))  # 3x throughout
    model = CostModel(START)
    _steady_steps(model, truth, 1000)
    _steady_steps(model, slower, 1600, seed=1)  # eight memories of the forgetting factor
    for shape in (StepShape(0, 32, 3000), StepShape(512, 0, 512), StepShape(0, 1, 100)):
        assert model.step_seconds(shape) == pytest.approx(slower.step_seconds(shape), rel=0.05)


def test_covariance_never_winds_up_past_its_prior() -> None:
    model = CostModel(START, prior_weight=10.0)
    shape = StepShape(0, 32, 3000)  # one shape for a long time: three directions unexcited
    for _ in range(2000):
        model.observe(shape, 0.05)
    assert max(model._p[i][i] for i in range(len(model._p))) <= 0.1 + 1e-12


def test_service_time_counts_chunks_and_decode_steps() -> None:
    model = CostModel(CostCoefficients(1.0, 0.0, 0.0, 0.0, 0.0))
    # 10 prompt tokens in chunks of 4: 3 steps; then 4 more outputs: 4 steps.
    assert model.service_seconds(0, 10, 5, token_budget=4) == pytest.approx(7.0)


def test_urgency_is_recomputed_when_the_load_or_the_request_changes_within_a_step() -> None:
    config = SchedulerConfig(
        num_device_blocks=64, block_size=4, max_model_len=64, policy="deadline", aging_s=10.0
    )
    policy = DeadlinePolicy(config, CostModel(COEFFS))
    req = make_request("r", 8, 4, priority=2, arrival=0.0, deadline=12.0)

    def fresh_key(now: float) -> tuple[float, ...]:
        reference = DeadlinePolicy(config, CostModel(COEFFS))
        reference.loaded_step_s = policy.loaded_step_s
        return reference.urgency_key(req, now)

    now = 1.0
    first = policy.urgency_key(req, now)
    assert first == fresh_key(now)
    policy.loaded_step_s *= 3.0  # heavier load at the same instant: less slack, hopeless
    loaded = policy.urgency_key(req, now)
    assert loaded == fresh_key(now) and loaded[2] < first[2] and loaded[0] == 1.0
    req.num_computed_tokens = 8  # progress at the same (now, load): one step less left
    req.output_token_ids.append(5)
    assert policy.urgency_key(req, now) == fresh_key(now)
    assert policy.urgency_key(req, now)[2] > loaded[2]
    req.priority = 0  # a request's class is read live, never from a stale entry
    assert policy.urgency_key(req, now) == fresh_key(now)
    assert policy.urgency_key(req, 25.0) == fresh_key(25.0)  # aged


def test_cost_model_predictions_follow_every_refit() -> None:
    model = CostModel(COEFFS)
    shape = StepShape(num_prefill_tokens=10, num_decode_seqs=2, num_context_tokens=300)
    before = model.step_seconds(shape)
    assert before == pytest.approx(1.0 + 0.01 * 10)
    for _ in range(50):
        model.observe(shape, 5.0)
    c = model.coefficients
    expected = (
        c.base_s
        + c.per_prefill_token_s * 10
        + c.per_decode_seq_s * 2
        + c.per_context_token_s * 300
        + c.per_prefill_step_s  # the step holds a prefill
    )
    assert model.step_seconds(shape) == pytest.approx(expected)
    assert model.step_seconds(shape) > before + 2.0  # moved towards the 5 s it saw
    assert model.prefill_seconds(10, 512) == pytest.approx(
        c.base_s + c.per_prefill_token_s * 10 + c.per_context_token_s * 10 + c.per_prefill_step_s
    )
    decode = StepShape(num_decode_seqs=2, num_context_tokens=300)  # no prefill: no step cost
    assert model.step_seconds(decode) == pytest.approx(
        c.base_s + c.per_decode_seq_s * 2 + c.per_context_token_s * 300
    )
    model.set_swap_cost(0.5)
    assert model.coefficients.swap_s_per_block == 0.5
    assert model.swap_seconds(2) == 1.0


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.001, "1 ms"), (0.00128, "1.28 ms"), (0.045, "45 ms"), (0.9996, "1 s"), (12.3456, "12.3 s"),
     (1234.4, "1234 s")],
)  # fmt: skip
def test_times_in_messages_keep_three_significant_digits(seconds: float, text: str) -> None:
    """A 1 ms deadline against a 1.3 ms estimate read "0.001s" twice."""
    assert duration(seconds) == text


@pytest.mark.parametrize("policy", ["deadline", "fcfs"])
def test_requests_that_ended_are_not_held_until_their_deadline(policy: str) -> None:
    """A finished request's deadline entry used to stay in the expiry heap
    (holding its prompt and output) until the deadline came: with deadlines
    an hour away, memory grew with every request served."""
    sched = make_sched(policy=policy, max_queue_len=10_000)
    for i in range(5_000):
        sched.add_request(make_request(f"r{i}", 4, 2, arrival=0.0, deadline=3_600.0))
        sched.abort_request(f"r{i}")
    assert len(sched._deadlines) <= 4 * len(sched._requests) + 256 + 2
    sched.add_request(make_request("live", 4, 2, arrival=0.0, deadline=3_600.0))
    assert [entry[2].req_id for entry in sched._deadlines if entry[2].req_id == "live"] == ["live"]

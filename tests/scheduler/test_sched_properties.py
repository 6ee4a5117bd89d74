"""Property test: random interleavings of add / step / abort / deadline expiry
on tiny pools. After every operation the pools balance and every used block
has exactly one live holder; every request finishes exactly once; requests
that ran to completion produced exactly their unpreempted tokens; at the end
both pools are all free."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_fakes import (
    Driver,
    SelfFirstPolicy,
    SwapPolicy,
    check_pools,
    make_request,
    reference_outputs,
)

from slipstream.scheduler import (
    CostCoefficients,
    CostModel,
    DeadlinePolicy,
    FinishReason,
    PriorityPolicy,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    StepPlan,
)
from slipstream.scheduler.policy_base import FcfsPolicy

# Step costs on the fake clock's scale (1 s per step): deadlines of a few
# steps are feasible, infeasible or hopeless depending on the draw.
CHEAP_SWAP = CostCoefficients(1.0, 0.05, 0.0, 0.0, 0.001)
DEAR_SWAP = CostCoefficients(1.0, 0.0, 0.0, 0.0, 10.0)

POLICIES: dict[str, Callable[[SchedulerConfig], SchedulingPolicy]] = {
    "fcfs": lambda _: FcfsPolicy(),
    "priority": lambda _: PriorityPolicy(),
    "swap": lambda _: SwapPolicy(),
    "self-first": lambda _: SelfFirstPolicy(),
    "deadline-swap": lambda config: DeadlinePolicy(config, CostModel(CHEAP_SWAP)),
    "deadline-recompute": lambda config: DeadlinePolicy(config, CostModel(DEAR_SWAP)),
}

MAX_REQUEST_TOKENS = 16  # prompt (<= 10) + max_new_tokens (<= 6)


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    """Device pools from exactly one maximal request to a few blocks more, so
    every request fits alone but several together run out: preemption is common."""
    block_size = draw(st.integers(1, 4))
    min_blocks = -(-MAX_REQUEST_TOKENS // block_size)
    return SchedulerConfig(
        num_device_blocks=draw(st.integers(min_blocks, min_blocks + 4)),
        block_size=block_size,
        max_model_len=24,
        max_num_seqs=draw(st.integers(2, 4)),
        max_num_batched_tokens=draw(st.integers(1, 16)),
        num_host_blocks=draw(st.sampled_from([0, 1, 2, 3, 4, 6, 12])),  # small: exhaustion
        max_queue_len=draw(st.integers(2, 8)),
        aging_s=draw(st.sampled_from([0.0, 3.0, 60.0])),
        min_residency_s=draw(st.sampled_from([0.0, 2.0])),
        reject_infeasible=draw(st.booleans()),
    )


add_op = st.tuples(
    st.just("add"),
    st.integers(1, 10),  # prompt length
    st.integers(1, 6),  # max_new_tokens
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.none(), st.floats(0.5, 30.0)),  # deadline offset from now
    st.booleans(),  # ignore_eos
)
step_op = st.tuples(st.just("step"))
# Repeated branches weight the mix towards adds and steps.
ops = st.lists(
    st.one_of(
        add_op,
        add_op,
        add_op,
        step_op,
        step_op,
        step_op,
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("abort_in_flight"), st.integers(0, 50)),
    ),
    min_size=20,
    max_size=80,
)


# The deadline policies are drawn more often: they have the most paths.
POLICY_DRAWS = [*sorted(POLICIES), "deadline-swap", "deadline-swap", "deadline-recompute"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), policy_name=st.sampled_from(POLICY_DRAWS), script=ops)
def test_random_interleavings_keep_every_invariant(
    config: SchedulerConfig, policy_name: str, script: list[tuple[object, ...]]
) -> None:
    _check_interleaving(config, policy_name, script, ahead=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), policy_name=st.sampled_from(POLICY_DRAWS), script=ops)
def test_planning_ahead_keeps_every_invariant_and_token(
    config: SchedulerConfig, policy_name: str, script: list[tuple[object, ...]]
) -> None:
    """The same, with every step planned before the previous one's results
    came back: EOS and stop land a step late, the tokens do not change."""
    _check_interleaving(config, policy_name, script, ahead=True)


def _check_interleaving(
    config: SchedulerConfig, policy_name: str, script: list[tuple[object, ...]], ahead: bool
) -> None:
    sched = Scheduler(config, POLICIES[policy_name](config))
    driver = Driver(sched, ahead=ahead)
    submitted: dict[str, Request] = {}
    host_was_full = False
    for op in script:
        _apply(op, sched, driver, submitted)
        check_pools(sched)
        host_was_full |= config.num_host_blocks > 0 and sched.num_free_host_blocks == 0
    driver.run_until_idle(max_steps=5_000)
    _record_coverage(sched, submitted, host_was_full)
    check_pools(sched)
    assert sched.num_used_device_blocks == sched.num_used_host_blocks == 0
    assert sched.num_waiting == sched.num_running == sched.num_swapped == 0
    assert set(driver.finishes) == set(submitted)
    for req_id, req in submitted.items():
        assert len(driver.finishes[req_id]) == 1, (req_id, driver.finishes[req_id])
        assert req.finish_reason is driver.finishes[req_id][0]
        produced = driver.outputs.get(req_id, [])
        expected = reference_outputs(req)
        if req.finish_reason in (FinishReason.EOS, FinishReason.MAX_TOKENS):
            assert produced == expected
        else:
            assert produced == expected[: len(produced)]


def _record_coverage(sched: Scheduler, submitted: dict[str, Request], host_was_full: bool) -> None:
    """Shown by ``pytest --hypothesis-show-statistics``: proof the random
    scripts reach preemption, swaps and expiry, not just the easy path."""
    event(f"submitted>=5: {len(submitted) >= 5}")
    event(f"recompute preemption: {sched.num_recompute_preemptions > 0}")
    event(f"swap preemption: {sched.num_swap_preemptions > 0}")
    event(f"deadline expiry: {sched.num_expired > 0}")
    event(f"host pool exhausted: {host_was_full}")


def _apply(
    op: tuple[object, ...], sched: Scheduler, driver: Driver, submitted: dict[str, Request]
) -> None:
    kind = op[0]
    if kind == "add":
        _, prompt_len, max_new, priority, deadline, ignore_eos = op
        assert isinstance(prompt_len, int) and isinstance(max_new, int)
        assert isinstance(priority, int) and isinstance(ignore_eos, bool)
        req = make_request(
            f"r{len(submitted)}-{prompt_len}",
            prompt_len,
            max_new,
            arrival=driver.now,
            priority=priority,
            deadline=None if deadline is None else driver.now + float(deadline),  # type: ignore[arg-type]
            ignore_eos=ignore_eos,
        )
        try:
            sched.add_request(req)
        except Exception as exc:  # rejected: must leave no trace
            assert sched.get_request(req.req_id) is None, exc
            return
        submitted[req.req_id] = req
    elif kind == "step":
        driver.step()
    elif kind == "abort":
        assert isinstance(op[1], int)
        driver.abort(_pick_id(op[1], sched.live_req_ids(), submitted))
    elif kind == "abort_in_flight":
        _step_with_abort_in_flight(sched, driver, op[1], submitted)


def _pick_id(pick: int, preferred: list[str], submitted: dict[str, Request]) -> str:
    """Half the time one of ``preferred``; otherwise any id ever submitted
    (often finished already) or one never seen: aborting those is a no-op."""
    if preferred and pick % 2 == 0:
        return preferred[pick // 2 % len(preferred)]
    ids = [*submitted, "never-submitted"]
    return ids[pick % len(ids)]


def _step_with_abort_in_flight(
    sched: Scheduler, driver: Driver, pick: object, submitted: dict[str, Request]
) -> None:
    """schedule -> run -> abort one scheduled request -> update."""
    assert isinstance(pick, int)

    def abort(plan: StepPlan) -> None:
        driver.abort(_pick_id(pick, [seq.req_id for seq in plan.seqs], submitted))
        check_pools(sched)

    driver.step(between=abort)

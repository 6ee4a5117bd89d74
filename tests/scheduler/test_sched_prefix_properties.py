"""Property test of the prefix cache: random interleavings of submit / step /
cancel / cancel-in-flight / deadline expiry /
forced preemption (swap or recompute) on tiny pools, with prompts
drawn from a few shared prefixes so that blocks are shared, evicted and
re-found, and preemption by swap and recompute is common. After every
operation each used block's reference count equals its number of live
holders and nobody writes a shared block; requests that ran to completion
produced exactly their unshared tokens; at the end nothing is used."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_fakes import Driver, check_pools, reference_outputs
from test_sched_properties import POLICIES, POLICY_DRAWS

from slipstream.scheduler import (
    FinishReason,
    PreemptionMode,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    StepPlan,
)
from slipstream.scheduler.scheduler import _StepState

PREFIXES = ([3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 8, 8, 8, 8], [2, 7, 1, 8, 2, 8, 1, 8])
MAX_REQUEST_TOKENS = 22  # prefix (<= 8) + tail (<= 6) + max_new_tokens (<= 8)


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    block_size = draw(st.integers(1, 4))
    min_blocks = -(-MAX_REQUEST_TOKENS // block_size)
    return SchedulerConfig(
        num_device_blocks=draw(st.integers(min_blocks, min_blocks + 3)),
        block_size=block_size,
        max_model_len=24,
        max_num_seqs=draw(st.integers(3, 5)),
        max_num_batched_tokens=draw(st.integers(4, 16)),
        num_host_blocks=draw(st.sampled_from([0, 1, 2, 4, 12])),
        max_queue_len=draw(st.integers(4, 12)),
        aging_s=draw(st.sampled_from([0.0, 3.0])),
        min_residency_s=draw(st.sampled_from([0.0, 2.0])),
        reject_infeasible=draw(st.booleans()),
        enable_prefix_cache=True,
    )


add_op = st.tuples(
    st.just("add"),
    st.integers(0, len(PREFIXES) - 1),  # which shared prefix
    st.integers(0, 8),  # how much of it
    st.lists(st.integers(1, 96), max_size=6),  # the request's own tail
    st.integers(1, 8),  # max_new_tokens
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.floats(0.5, 30.0)),  # deadline offset from now
)
ops = st.lists(
    st.one_of(
        add_op,
        add_op,
        add_op,
        add_op,
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("preempt"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("cancel_in_flight"), st.integers(0, 50)),
    ),
    min_size=20,
    max_size=80,
)


# Bursts of whole shared prefixes with short tails, several to a step:
# requests that wait for a prefix another one is computing (prefix_sharing.py).
burst_add_op = st.tuples(
    st.just("add"),
    st.integers(0, len(PREFIXES) - 1),
    st.just(8),
    st.lists(st.integers(1, 96), max_size=2),
    st.integers(1, 8),
    st.integers(0, 2),
    st.one_of(st.none(), st.floats(0.5, 30.0)),
)
burst_ops = st.lists(
    st.one_of(
        burst_add_op,
        burst_add_op,
        burst_add_op,
        st.tuples(st.just("step")),
        st.tuples(st.just("preempt"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("cancel_in_flight"), st.integers(0, 50)),
    ),
    min_size=20,
    max_size=60,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), policy_name=st.sampled_from(POLICY_DRAWS), script=ops)
def test_shared_prefixes_keep_reference_counts_exact_and_end_with_nothing_used(
    config: SchedulerConfig, policy_name: str, script: list[tuple[object, ...]]
) -> None:
    _check_prefix_script(config, policy_name, script, ahead=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), policy_name=st.sampled_from(POLICY_DRAWS), script=ops)
def test_shared_prefixes_hold_when_planning_ahead(
    config: SchedulerConfig, policy_name: str, script: list[tuple[object, ...]]
) -> None:
    """Blocks are committed to the cache when a plan is taken as done, before
    its results: the same counts and tokens as planning after them."""
    _check_prefix_script(config, policy_name, script, ahead=True)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs(),
    policy_name=st.sampled_from(POLICY_DRAWS),
    script=burst_ops,
    ahead=st.booleans(),
)
def test_requests_waiting_for_a_prefix_being_computed_keep_the_same_invariants(
    config: SchedulerConfig, policy_name: str, script: list[tuple[object, ...]], ahead: bool
) -> None:
    """Waiters whose prefix is cancelled in flight or preempted still end,
    with their exact tokens, and nothing leaks."""
    _check_prefix_script(config, policy_name, script, ahead=ahead)


def _check_prefix_script(
    config: SchedulerConfig, policy_name: str, script: list[tuple[object, ...]], ahead: bool
) -> None:
    sched = Scheduler(config, POLICIES[policy_name](config))
    driver = Driver(sched, ahead=ahead)
    submitted: dict[str, Request] = {}
    for op in script:
        _apply(op, sched, driver, submitted)
        check_pools(sched)
    driver.run_until_idle(max_steps=5_000)
    check_pools(sched)
    assert sched.num_used_device_blocks == sched.num_used_host_blocks == 0
    assert sched.num_waiting == sched.num_running == sched.num_swapped == 0
    for req_id, req in submitted.items():
        assert len(driver.finishes[req_id]) == 1, (req_id, driver.finishes[req_id])
        produced = driver.outputs.get(req_id, [])
        expected = reference_outputs(req)
        if req.finish_reason in (FinishReason.EOS, FinishReason.MAX_TOKENS):
            assert produced == expected
        else:
            assert produced == expected[: len(produced)]
        assert 0 <= req.num_cached_tokens < req.num_prompt_tokens
    assert 0 <= sched.num_prefix_hit_tokens <= sched.num_prefix_queried_tokens
    # The hit rate is the requests' own figure: cached over prompt tokens of
    # every request admitted, each once however often it was recomputed.
    admitted = [r for r in submitted.values() if r.first_scheduled_time is not None]
    assert sched.num_prefix_hit_tokens == sum(r.num_cached_tokens for r in admitted)
    assert sched.num_prefix_queried_tokens == sum(r.num_prompt_tokens for r in admitted)
    event(f"prefix hits: {sched.num_prefix_hit_tokens > 0}")
    event(f"evictions: {sched.device_pool.num_evictions > 0}")
    event(f"swap preemption: {sched.num_swap_preemptions > 0}")
    event(f"recompute preemption: {sched.num_recompute_preemptions > 0}")
    event(f"lost swap: {sched.num_lost_swaps > 0}")
    event(f"prefix wait: {sched.num_prefix_waits > 0}")
    event(f"expiry: {sched.num_expired > 0}")


def _apply(
    op: tuple[object, ...], sched: Scheduler, driver: Driver, submitted: dict[str, Request]
) -> None:
    kind = op[0]
    if kind == "add":
        _, which, length, tail, max_new, priority, deadline = op
        assert isinstance(which, int) and isinstance(length, int) and isinstance(tail, list)
        assert isinstance(max_new, int) and isinstance(priority, int)
        prompt = PREFIXES[which][:length] + tail
        if not prompt:
            prompt = [5]
        req = Request(
            req_id=f"r{len(submitted)}",
            prompt_token_ids=prompt,
            max_new_tokens=max_new,
            eos_token_ids=(0,),
            priority=priority,
            arrival_time=driver.now,
            deadline=None if deadline is None else driver.now + float(deadline),  # type: ignore[arg-type]
        )
        try:
            sched.add_request(req)
        except Exception as exc:  # rejected: must leave no trace
            assert sched.get_request(req.req_id) is None, exc
            return
        submitted[req.req_id] = req
    elif kind == "step":
        driver.step()
    elif kind == "preempt":
        assert isinstance(op[1], int) and isinstance(op[2], bool)
        _force_preemption(sched, driver, op[1], swap=op[2])
    elif kind == "cancel":
        assert isinstance(op[1], int)
        driver.abort(_pick(op[1], sched.live_req_ids(), submitted))
    elif kind == "cancel_in_flight":
        pick = op[1]
        assert isinstance(pick, int)

        def cancel(plan: StepPlan) -> None:
            driver.abort(_pick(pick, [seq.req_id for seq in plan.seqs], submitted))
            check_pools(sched)

        driver.step(between=cancel)


def _force_preemption(sched: Scheduler, driver: Driver, pick: int, *, swap: bool) -> None:
    """Preempts a running request between steps, by swap (when the host
    pool has room) or recompute, through the scheduler's own preemption."""
    running = [
        r
        for r in map(sched.get_request, sched.live_req_ids())
        if r and r.status is RequestStatus.RUNNING
    ]
    if not running:
        return
    victim = running[pick % len(running)]
    mode = PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE
    state = _StepState(step=sched.step, token_budget=0)
    sched.policy.preemption_mode = lambda *_: mode  # type: ignore[method-assign]
    try:
        sched._preempt(state, victim, driver.now)
    finally:
        del sched.policy.preemption_mode
    driver.runner.execute(StepPlan(step=sched.step, swap_out=state.swap_out))


def _pick(pick: int, preferred: list[str], submitted: dict[str, Request]) -> str:
    if preferred and pick % 2 == 0:
        return preferred[pick // 2 % len(preferred)]
    ids = [*submitted, "never-submitted"]
    return ids[pick % len(ids)]

"""A prefix still being computed is shared: a waiting request whose next
uncached blocks another request's chunk completes this step waits the step
out and is admitted with them as cache hits (prefix_sharing.py), instead of
computing them a second time beside it."""

from __future__ import annotations

import pytest
from sched_fakes import Driver, check_pools, reference_outputs

from slipstream.scheduler import (
    CostModel,
    DeadlinePolicy,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    StepPlan,
)
from slipstream.scheduler.policy_base import FcfsPolicy, PriorityPolicy

BLOCK = 4
PROMPT = [(7 * i) % 90 + 1 for i in range(40)]  # ten blocks
NUM_SHARED = 36  # nine: the last token's block is never shared


def _config(**kwargs: object) -> SchedulerConfig:
    values: dict[str, object] = {
        "num_device_blocks": 64,
        "block_size": BLOCK,
        "max_model_len": 64,
        "max_num_batched_tokens": 256,
        "enable_prefix_cache": True,
    }
    values.update(kwargs)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def _scheduler(policy: str = "fcfs", **kwargs: object) -> Scheduler:
    config = _config(**kwargs)
    policies: dict[str, SchedulingPolicy] = {
        "fcfs": FcfsPolicy(),
        "priority": PriorityPolicy(),
        "deadline": DeadlinePolicy(config, CostModel()),
    }
    return Scheduler(config, policies[policy])


def _request(req_id: str, prompt: list[int], max_new: int = 4, **kwargs: object) -> Request:
    return Request(req_id=req_id, prompt_token_ids=list(prompt), max_new_tokens=max_new, **kwargs)  # type: ignore[arg-type]


def _prompt_tokens_computed(plans: list[StepPlan], reqs: list[Request]) -> int:
    """Prompt positions the plans computed, over ``reqs`` (outputs excluded)."""
    prompt_len = {req.req_id: req.num_prompt_tokens for req in reqs}
    total = 0
    for plan in plans:
        for seq in plan.seqs:
            end = min(seq.start_pos + len(seq.token_ids), prompt_len[seq.req_id])
            total += max(0, end - seq.start_pos)
    return total


def _run_to_the_end(driver: Driver, reqs: list[Request]) -> None:
    driver.run_until_idle()
    for req in reqs:
        assert driver.outputs[req.req_id] == reference_outputs(req), req.req_id
    assert driver.scheduler.num_used_device_blocks == 0
    check_pools(driver.scheduler)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority", "deadline"])
def test_requests_arriving_together_with_one_prompt_compute_it_once(
    policy: str, ahead: bool
) -> None:
    sched = _scheduler(policy)
    driver = Driver(sched, ahead=ahead)
    reqs = [_request(f"choice{i}", PROMPT) for i in range(4)]  # an n=4 completion
    for req in reqs:
        sched.add_request(req, 0.0)
    driver.step()
    [first] = driver.plans[0].seqs  # the budget had room for all four
    assert first.req_id == "choice0" and len(first.token_ids) == len(PROMPT)
    assert sched.num_waiting == 3 and sched.num_prefix_waits == 3
    _run_to_the_end(driver, reqs)
    # The prefix once, then each other choice's last block only.
    assert _prompt_tokens_computed(driver.plans, reqs) == len(PROMPT) + 3 * BLOCK
    assert [req.num_cached_tokens for req in reqs] == [0, NUM_SHARED, NUM_SHARED, NUM_SHARED]
    assert sched.num_prefix_hit_tokens == 3 * NUM_SHARED
    assert sched.num_prefix_waits == 3  # one step each


def test_a_burst_with_one_system_prompt_shares_it_while_it_is_computed() -> None:
    """Prompts that share a head and differ after it: each computes its own
    tail, the head once; the budget-starved case (what is left after the
    first prompt's chunk) waits too."""
    sched = _scheduler(max_num_batched_tokens=64)
    driver = Driver(sched)
    reqs = [_request(f"r{i}", [*PROMPT[:32], 90 - i, 80 - i, 70 - i]) for i in range(4)]
    for req in reqs:
        sched.add_request(req, 0.0)
    _run_to_the_end(driver, reqs)
    assert _prompt_tokens_computed(driver.plans, reqs) == 35 + 3 * 3
    assert sched.num_prefix_hit_tokens == 3 * 32


def test_a_waiter_of_a_chunked_prefill_is_admitted_past_the_chunk() -> None:
    """The computing request's prefill spans steps; the waiter waits only on
    the step whose chunk completes its next blocks, and starts after them."""
    sched = _scheduler(max_num_batched_tokens=24)
    driver = Driver(sched)
    a, b = _request("a", PROMPT), _request("b", PROMPT)
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    driver.step()  # a: tokens 0..23, nothing left for b
    driver.step()  # a: tokens 24..39, b would take 8 of its blocks 6 and 7: it waits
    assert b.status is RequestStatus.WAITING and sched.num_prefix_waits == 1
    driver.step()
    [seq] = [s for s in driver.plans[-1].seqs if s.req_id == "b"]
    assert seq.start_pos == NUM_SHARED
    _run_to_the_end(driver, [a, b])
    assert _prompt_tokens_computed(driver.plans, [a, b]) == len(PROMPT) + BLOCK


def test_an_abort_of_the_computing_request_in_flight_lets_the_waiter_compute_at_once() -> None:
    sched = _scheduler(max_num_batched_tokens=24)
    driver = Driver(sched)
    a, b = _request("a", PROMPT), _request("b", PROMPT)
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    driver.step()
    # Step 2 plans a's last chunk (blocks 6..9) and b waits for it; a is
    # cancelled while the step runs, so none of those blocks is committed.
    driver.step(between=lambda plan: driver.abort("a"))
    assert sched.num_prefix_waits == 1 and b.status is RequestStatus.WAITING
    driver.step()  # nobody computes b's next blocks now: b does, at once
    [seq] = driver.plans[-1].seqs
    assert seq.req_id == "b" and seq.start_pos == 24 and seq.sample
    assert b.num_cached_tokens == 24
    _run_to_the_end(driver, [b])
    assert sched.num_prefix_waits == 1


def test_a_preempted_computing_request_leaves_no_one_waiting_and_roles_can_swap() -> None:
    """The request computing a prefix is pushed out for recompute before the
    step that would have gone on with it: nobody waits on it, the more
    urgent newcomer computes the next blocks at once, and the pushed-out
    request, waiting again, waits a step on the newcomer in turn. A wait is
    on a sequence of the current step only, so two requests never wait on
    each other, nor anyone on a request that is not running."""
    sched = _scheduler("priority", max_num_batched_tokens=24)
    driver = Driver(sched)
    a = _request("a", PROMPT, priority=1)
    sched.add_request(a, 0.0)
    driver.step()  # a: tokens 0..23
    b = _request("b", PROMPT, priority=0)
    sched.add_request(b, driver.now)
    _preempt_for_recompute(sched, a, driver.now)
    driver.step()
    [seq] = driver.plans[-1].seqs  # b first: it is more urgent; a waits for b's blocks
    assert seq.req_id == "b" and seq.start_pos == 24 and b.num_cached_tokens == 24
    assert a.status is RequestStatus.WAITING and sched.num_prefix_waits == 1
    driver.step()
    [seq] = [s for s in driver.plans[-1].seqs if s.req_id == "a"]
    assert seq.start_pos == NUM_SHARED
    _run_to_the_end(driver, [a, b])
    assert _prompt_tokens_computed(driver.plans, [a, b]) == len(PROMPT) + BLOCK


def _preempt_for_recompute(sched: Scheduler, victim: Request, now: float) -> None:
    from slipstream.scheduler.scheduler_state import _StepState

    assert victim.status is RequestStatus.RUNNING
    sched._preempt(_StepState(step=sched.step, token_budget=0), victim, now)
    assert victim.status is RequestStatus.WAITING


def test_a_paused_request_computes_nothing_for_anyone() -> None:
    sched = _scheduler(max_num_batched_tokens=24)
    driver = Driver(sched)
    a, b = _request("a", PROMPT), _request("b", PROMPT)
    sched.add_request(a, 0.0)
    driver.step()  # a: tokens 0..23
    sched.pause("a")
    sched.add_request(b, driver.now)
    driver.step()
    [seq] = driver.plans[-1].seqs
    assert seq.req_id == "b" and seq.start_pos == 24 and sched.num_prefix_waits == 0
    sched.resume("a")
    _run_to_the_end(driver, [a, b])


def test_a_request_whose_chunk_reaches_past_the_computed_blocks_does_not_wait() -> None:
    """Waiting may not cost a waiter progress: ``short`` completes only four
    of ``long``'s blocks this step, and ``long`` would complete nine itself."""
    sched = _scheduler()
    driver = Driver(sched)
    short, long = _request("short", PROMPT[:17]), _request("long", PROMPT)
    sched.add_request(short, 0.0)
    sched.add_request(long, 0.0)
    driver.step()
    assert [len(s.token_ids) for s in driver.plans[0].seqs] == [17, 40]
    assert sched.num_prefix_waits == 0
    _run_to_the_end(driver, [short, long])


def test_a_request_with_a_time_limit_waits_only_when_it_could_not_sample_this_step() -> None:
    # Room for every prompt at once: a waiter could sample now, so with a
    # deadline it computes the prompt beside the first, as before.
    sched = _scheduler()
    driver = Driver(sched)
    timed = [_request(f"t{i}", PROMPT, deadline=1e6) for i in range(2)]
    for req in timed:
        sched.add_request(req, 0.0)
    driver.step()
    assert len(driver.plans[0].seqs) == 2 and sched.num_prefix_waits == 0
    _run_to_the_end(driver, timed)
    # Room for 24 tokens after the first prompt: the second could not
    # sample this step anyway, and waits, deadline or not.
    sched = _scheduler(max_num_batched_tokens=64)
    driver = Driver(sched)
    timed = [_request(f"t{i}", PROMPT, deadline=1e6) for i in range(2)]
    for req in timed:
        sched.add_request(req, 0.0)
    driver.step()
    assert len(driver.plans[0].seqs) == 1 and sched.num_prefix_waits == 1
    _run_to_the_end(driver, timed)
    assert timed[1].num_cached_tokens == NUM_SHARED


def test_a_waiter_keeps_its_sequence_slot_and_blocks_from_those_behind_it() -> None:
    sched = _scheduler(max_num_seqs=2)
    driver = Driver(sched)
    a, b = _request("a", PROMPT), _request("b", PROMPT)
    other = _request("other", [50, 51, 52, 53, 54])
    for req in (a, b, other):
        sched.add_request(req, 0.0)
    driver.step()
    # b waits a step for a's blocks; "other", behind it, does not take its slot.
    assert [s.req_id for s in driver.plans[0].seqs] == ["a"]
    driver.step()
    assert {s.req_id for s in driver.plans[1].seqs} == {"a", "b"}
    assert other.status is RequestStatus.WAITING
    _run_to_the_end(driver, [a, b, other])
    # The blocks: b would have taken 6 (a 24-token chunk), 6 are free after
    # a's 10, so "other" (2 blocks) cannot come in behind it this step.
    sched = _scheduler(num_device_blocks=16, max_num_batched_tokens=64)
    driver = Driver(sched)
    a, b = _request("a", PROMPT), _request("b", PROMPT)
    other = _request("other", [50, 51, 52, 53, 54, 55, 56, 57])
    for req in (a, b, other):
        sched.add_request(req, 0.0)
    driver.step()
    assert [s.req_id for s in driver.plans[0].seqs] == ["a"] and sched.num_prefix_waits == 1
    _run_to_the_end(driver, [a, b, other])


def test_without_the_prefix_cache_nobody_waits() -> None:
    sched = _scheduler(enable_prefix_cache=False)
    driver = Driver(sched)
    reqs = [_request(f"r{i}", PROMPT) for i in range(3)]
    for req in reqs:
        sched.add_request(req, 0.0)
    driver.step()
    assert len(driver.plans[0].seqs) == 3 and sched.num_prefix_waits == 0
    _run_to_the_end(driver, reqs)

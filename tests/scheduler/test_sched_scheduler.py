"""Scheduler unit tests: fake clock, tiny pools, the paged fake runner."""

from __future__ import annotations

import dataclasses
import math

import pytest
from sched_fakes import (
    EOS,
    Driver,
    SwapPolicy,
    check_pools,
    make_request,
    next_token,
    reference_outputs,
)

from slipstream.scheduler import (
    DuplicateRequest,
    FcfsPolicy,
    FinishReason,
    InvalidRequest,
    PriorityPolicy,
    PromptTooLong,
    QueueFull,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
)
from slipstream.scheduler.request import MAX_STOP_TOKEN_IDS


def make_scheduler(
    num_device_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    *,
    policy: SchedulingPolicy | None = None,
    **kwargs: int | str,
) -> Scheduler:
    config = SchedulerConfig(
        num_device_blocks=num_device_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        **kwargs,  # type: ignore[arg-type]
    )
    return Scheduler(config, policy)


# -- chunked prefill, budgets, limits ---------------------------------------


def test_long_prompt_is_chunked_across_steps_and_shares_steps_with_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    driver = Driver(sched)
    sched.add_request(make_request("short", prompt_len=3, max_new_tokens=10))
    driver.step()  # "short" prefills whole and samples its first token
    sched.add_request(make_request("long", prompt_len=20, max_new_tokens=2))

    chunks = []
    while "long" not in driver.outputs:
        driver.step()
        plan = driver.plans[-1]
        by_id = {s.req_id: s for s in plan.seqs}
        assert len(by_id["short"].token_ids) == 1  # the decode runs every step
        long_seq = by_id["long"]
        chunks.append((long_seq.start_pos, len(long_seq.token_ids), long_seq.sample))
        assert plan.num_tokens <= 8
    # 20 prompt tokens at 7 per step (8 minus the decode): 7 + 7 + 6
    assert chunks == [(0, 7, False), (7, 7, False), (14, 6, True)]
    driver.run_until_idle()
    for req_id, prompt_len, n in (("short", 3, 10), ("long", 20, 2)):
        assert driver.outputs[req_id] == reference_outputs(make_request(req_id, prompt_len, n))
    check_pools(sched)
    assert sched.num_used_device_blocks == 0


def test_token_budget_and_max_num_seqs_are_respected_every_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=3)
    driver = Driver(sched)
    for i in range(8):
        sched.add_request(make_request(f"r{i}", prompt_len=2 + i, max_new_tokens=4))
    driver.run_until_idle()
    assert max(p.num_tokens for p in driver.plans) == 10
    assert max(len(p.seqs) for p in driver.plans) == 3
    assert all(p.num_tokens <= 10 and len(p.seqs) <= 3 for p in driver.plans)
    assert all(driver.finishes[f"r{i}"] == [FinishReason.MAX_TOKENS] for i in range(8))


def test_scheduled_seq_fields_follow_the_plan_contract() -> None:
    sched = make_scheduler(max_num_batched_tokens=5)
    req = make_request("a", prompt_len=7, max_new_tokens=3)
    sched.add_request(req)
    plan = sched.schedule(1.0)
    assert plan.step == 1 and sched.step == 1
    [seq] = plan.seqs
    assert (seq.start_pos, seq.token_ids, seq.sample) == (0, req.prompt_token_ids[:5], False)
    assert seq.block_ids == req.block_ids and len(seq.block_ids) == 2  # covers 5 tokens
    assert seq.output_index == 0 and seq.sampling == req.sampling
    assert sched.update(plan, {}, 1.0) == []  # no sample, no output
    plan = sched.schedule(2.0)
    [seq] = plan.seqs
    assert (seq.start_pos, len(seq.token_ids), seq.sample) == (5, 2, True)
    assert plan.step == 2


# -- preemption -------------------------------------------------------------


def test_recompute_preemption_keeps_outputs_and_completes_exactly() -> None:
    # 6 blocks of 2 tokens: two requests of 6 + 5 tokens cannot both finish.
    sched = make_scheduler(num_device_blocks=6, block_size=2, max_model_len=12)
    driver = Driver(sched)
    first = make_request("first", prompt_len=4, max_new_tokens=5, arrival=0.0)
    second = make_request("second", prompt_len=4, max_new_tokens=5, arrival=1.0)
    sched.add_request(first)
    sched.add_request(second)
    driver.run_until_idle()

    preempted = [p for p in driver.plans if p.preempted_req_ids]
    assert preempted, "the pool is too small for both; someone must be preempted"
    assert all(p.preempted_req_ids == ["second"] for p in preempted)  # latest arrival
    assert sched.num_recompute_preemptions == len(preempted)
    assert second.num_preemptions >= 1
    # The re-prefill recomputes prompt + kept outputs and samples only at its end.
    reprefills = [
        s
        for p in driver.plans
        for s in p.seqs
        if s.req_id == "second" and s.start_pos == 0 and s.output_index > 0
    ]
    assert reprefills
    for seq in reprefills:
        assert len(seq.token_ids) == second.num_prompt_tokens + seq.output_index
        assert seq.sample
    for req in (first, second):
        assert driver.outputs[req.req_id] == reference_outputs(req)
        assert driver.finishes[req.req_id] == [FinishReason.MAX_TOKENS]
    check_pools(sched)
    assert sched.num_used_device_blocks == 0


def test_preempted_request_is_not_readmitted_in_the_same_step() -> None:
    sched = make_scheduler(num_device_blocks=4, block_size=2, max_model_len=8)
    driver = Driver(sched)
    sched.add_request(make_request("a", prompt_len=3, max_new_tokens=5, arrival=0.0))
    sched.add_request(make_request("b", prompt_len=3, max_new_tokens=5, arrival=1.0))
    driver.run_until_idle()
    for plan in driver.plans:
        scheduled = {s.req_id for s in plan.seqs}
        assert not scheduled & set(plan.preempted_req_ids)


def test_no_new_admission_in_a_step_where_running_work_ran_out_of_blocks() -> None:
    # 5 blocks of 2. "a" (arrival 0) and "b" (arrival 1) grow until "a" needs
    # a block and preempts "b"; the blocks "b" frees could take the small "c",
    # but "a" and "b" will need them next: "c" must not be admitted then.
    sched = make_scheduler(num_device_blocks=5, block_size=2, max_model_len=10)
    driver = Driver(sched)
    sched.add_request(make_request("a", 4, 6, arrival=0.0))
    sched.add_request(make_request("b", 4, 6, arrival=1.0))
    driver.step()
    sched.add_request(make_request("c", 1, 1, arrival=2.0))
    while not driver.plans[-1].preempted_req_ids:
        assert sched.has_unfinished()
        driver.step()
    plan = driver.plans[-1]
    assert plan.preempted_req_ids == ["b"]
    assert [s.req_id for s in plan.seqs] == ["a"]
    assert sched.num_free_device_blocks >= 1  # "c" would have fitted
    # "b" went back to the front of the queue: it is readmitted before "c".
    while not any(s.req_id in ("b", "c") for s in driver.plans[-1].seqs):
        driver.step()
    assert "b" in {s.req_id for s in driver.plans[-1].seqs}
    driver.run_until_idle()
    assert driver.finishes["c"] == [FinishReason.MAX_TOKENS]


def test_a_request_dropped_for_recompute_waits_for_room_for_all_of_it() -> None:
    # 8 blocks of 2, 4 tokens a step. "a" grows to 7 blocks; "b" (4 blocks)
    # is pushed out when "a" needs one. Taken back on its first chunk's
    # blocks, "b" was pushed out again at each block "a" grew into, its
    # re-prefill lost each time; it now waits until all of it fits.
    sched = make_scheduler(
        num_device_blocks=8, block_size=2, max_model_len=16, max_num_batched_tokens=4
    )
    driver = Driver(sched)
    a = make_request("a", prompt_len=4, max_new_tokens=10, arrival=0.0)
    b = make_request("b", prompt_len=4, max_new_tokens=4, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    driver.run_until_idle()
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    for req in (a, b):  # and it is not starved: it runs once "a" is done
        assert driver.outputs[req.req_id] == reference_outputs(req)
        assert driver.finishes[req.req_id] == [FinishReason.MAX_TOKENS]
    check_pools(sched)


def test_swap_preemption_moves_blocks_to_host_and_back_exactly() -> None:
    sched = make_scheduler(
        num_device_blocks=6, block_size=2, max_model_len=12, num_host_blocks=6, policy=SwapPolicy()
    )
    driver = Driver(sched)
    reqs = [make_request(f"r{i}", prompt_len=4, max_new_tokens=5, arrival=i) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    saw_swapped = False
    while sched.has_unfinished():
        driver.step()
        check_pools(sched)
        saw_swapped |= sched.num_swapped > 0
        plan = driver.plans[-1]
        assert not (plan.swap_out and plan.swap_in)
    assert saw_swapped and sched.num_swap_preemptions > 0
    assert any(p.swap_out for p in driver.plans) and any(p.swap_in for p in driver.plans)
    for req in reqs:
        assert driver.outputs[req.req_id] == reference_outputs(req)
    assert sched.num_used_host_blocks == 0 and sched.num_used_device_blocks == 0


def test_no_swap_in_during_a_step_that_preempts() -> None:
    # A scenario where, without the rule, a request is swapped in while
    # another is pushed out in the same step (found by a randomized search).
    sched = make_scheduler(
        num_device_blocks=6,
        block_size=2,
        max_model_len=12,
        num_host_blocks=8,
        max_num_batched_tokens=8,
        policy=SwapPolicy(),
    )
    driver = Driver(sched)
    arrivals = {0: [("r0", 1, 7), ("r3", 3, 8)], 1: [("r1", 1, 3)], 3: [("r2", 2, 6)]}
    for step in range(40):
        for req_id, prompt_len, max_new in arrivals.get(step, []):
            sched.add_request(make_request(req_id, prompt_len, max_new, arrival=step))
        driver.step()  # checks the rule on every plan
    assert not sched.has_unfinished()
    assert any(p.swap_in for p in driver.plans) and any(p.swap_out for p in driver.plans)


def test_fcfs_head_of_line_is_never_overtaken() -> None:
    sched = make_scheduler(num_device_blocks=6, block_size=2, max_model_len=12)
    driver = Driver(sched)
    sched.add_request(make_request("running", 6, 4, arrival=0.0))
    driver.step()  # holds 3 of 6 blocks (2 more as it decodes)
    sched.add_request(make_request("big", 8, 2, arrival=1.0))  # needs 4 blocks
    sched.add_request(make_request("small", 1, 1, arrival=2.0))  # would fit now
    driver.step()
    assert [s.req_id for s in driver.plans[-1].seqs] == ["running"]
    driver.run_until_idle()
    first_step = {
        req_id: next(p.step for p in driver.plans if req_id in {s.req_id for s in p.seqs})
        for req_id in ("big", "small")
    }
    assert first_step["big"] <= first_step["small"]


def test_policy_hook_lets_urgent_waiting_work_push_running_work_out() -> None:
    class Urgent(PriorityPolicy):
        def admission_victim(
            self, candidate: Request, running: list[Request], now: float, num_ahead: int = 0
        ) -> Request | None:
            victim = self.choose_victim(running, candidate, now)
            if victim is None or victim.priority <= candidate.priority:
                return None
            return victim

    sched = make_scheduler(max_num_seqs=2, policy=Urgent())
    driver = Driver(sched)
    low = [make_request(f"low{i}", 2, 8, priority=2, arrival=i) for i in range(2)]
    for req in low:
        sched.add_request(req)
    driver.step()
    assert sched.num_running == 2
    sched.add_request(make_request("urgent", 2, 2, priority=0, arrival=5.0))
    driver.step()
    plan = driver.plans[-1]
    assert plan.preempted_req_ids == ["low1"]  # least urgent, latest
    assert {s.req_id for s in plan.seqs} == {"low0", "urgent"}
    driver.run_until_idle()
    for req in low:
        assert driver.outputs[req.req_id] == reference_outputs(req)


# -- deadlines, aborts -------------------------------------------------------


def test_deadline_expiry_finishes_and_frees_waiting_running_and_swapped() -> None:
    sched = make_scheduler(
        num_device_blocks=6, block_size=2, max_model_len=12, num_host_blocks=6, policy=SwapPolicy()
    )
    driver = Driver(sched)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, 5, arrival=i, deadline=6.5))
    statuses = set()
    while driver.now < 6.0:
        driver.step()
        for req_id in sched.live_req_ids():
            req = sched.get_request(req_id)
            assert req is not None
            statuses.add(req.status)
    assert RequestStatus.SWAPPED in statuses
    expiring = sched.live_req_ids()
    assert expiring
    plan = sched.schedule(7.0)
    assert [f.req_id for f in plan.finished] == expiring
    assert all(f.reason is FinishReason.DEADLINE_EXCEEDED for f in plan.finished)
    assert plan.seqs == [] and not sched.has_unfinished()
    assert sched.num_used_device_blocks == 0 and sched.num_used_host_blocks == 0
    assert sched.num_expired == len(expiring)
    check_pools(sched)


def test_first_token_deadline_expires_only_before_the_first_token() -> None:
    # Arrival order (the deadline policy would run "slow" first: it needs more).
    sched = make_scheduler(max_num_batched_tokens=4, policy=FcfsPolicy())
    slow = make_request("slow", prompt_len=12, max_new_tokens=2)
    slow.first_token_deadline = 2.0
    fast = make_request("fast", prompt_len=1, max_new_tokens=5)
    fast.first_token_deadline = 2.0
    sched.add_request(fast)
    sched.add_request(slow)
    driver = Driver(sched)
    driver.step()  # t=1: fast samples, slow prefills 3 of 12
    driver.step()  # t=2: expiry of slow, fast already has a token
    assert driver.finishes["slow"] == [FinishReason.DEADLINE_EXCEEDED]
    driver.run_until_idle()
    assert driver.finishes["fast"] == [FinishReason.MAX_TOKENS]


def test_abort_frees_blocks_and_returns_the_final_output_once() -> None:
    sched = make_scheduler()
    driver = Driver(sched)
    sched.add_request(make_request("a", 9, 5))
    sched.add_request(make_request("b", 3, 5))
    driver.step()
    assert sched.num_used_device_blocks == 3 + 1
    out = sched.abort_request("a", FinishReason.STOP_SEQUENCE, "stop string")
    assert out is not None
    assert (out.req_id, out.new_token_ids) == ("a", [])
    assert (out.finish_reason, out.message) == (FinishReason.STOP_SEQUENCE, "stop string")
    assert sched.num_used_device_blocks == 1 and sched.get_request("a") is None
    assert sched.abort_request("a") is None
    assert sched.abort_request("never-seen") is None
    check_pools(sched)


def test_abort_between_schedule_and_update_is_ignored_by_update() -> None:
    sched = make_scheduler()
    driver = Driver(sched)
    sched.add_request(make_request("a", 3, 5))
    sched.add_request(make_request("b", 3, 5))
    plan = sched.schedule(1.0)
    sampled = driver.runner.execute(plan)
    sched.abort_request("a")
    sched.add_request(make_request("a", 3, 5))  # same id, fresh request
    outputs = sched.update(plan, sampled, 1.0)
    assert [o.req_id for o in outputs] == ["b"]
    fresh = sched.get_request("a")
    assert fresh is not None and fresh.num_computed_tokens == 0 and fresh.block_ids == []
    check_pools(sched)


def test_update_rejects_stale_plans_and_missing_samples_without_changes() -> None:
    sched = make_scheduler()
    req = make_request("a", 3, 5)
    sched.add_request(req)
    plan = sched.schedule(1.0)
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(plan, {}, 1.0)
    assert req.num_computed_tokens == 0
    sched.update(plan, {"a": 5}, 1.0)
    with pytest.raises(ValueError, match="not the plan in flight"):
        sched.update(plan, {"a": 5}, 1.0)
    assert req.num_computed_tokens == 3 and req.output_token_ids == [5]


# -- finishing ---------------------------------------------------------------


def test_eos_finishes_unless_ignored_and_first_token_time_is_recorded() -> None:
    sched = make_scheduler()
    stops = make_request("stops", 2, 10, ignore_eos=False)
    ignores = make_request("ignores", 2, 3, ignore_eos=True)
    sched.add_request(stops)
    sched.add_request(ignores)
    plan = sched.schedule(1.0)
    outputs = sched.update(plan, {"stops": EOS, "ignores": EOS}, 1.5)
    reasons = {o.req_id: o.finish_reason for o in outputs}
    assert reasons == {"stops": FinishReason.EOS, "ignores": None}
    assert stops.first_token_time == 1.5 and stops.status is RequestStatus.FINISHED
    assert ignores.first_token_time == 1.5 and ignores.first_scheduled_time == 1.0
    assert sched.num_used_device_blocks == 1  # only "ignores" holds a block


def test_a_stop_sequence_on_the_last_allowed_token_finishes_as_the_stop() -> None:
    # The output was cut at the stop, so the caller is told the stop, not the
    # length limit that the same token also reached.
    sched = make_scheduler()
    last = make_request("last", 2, 1, ignore_eos=True)
    sched.add_request(last)
    plan = sched.schedule(1.0)
    outputs = sched.update(plan, {"last": 7}, 1.5, is_stopped=lambda req_id, token: True)
    assert [o.finish_reason for o in outputs] == [FinishReason.STOP_SEQUENCE]
    assert last.status is RequestStatus.FINISHED and sched.num_used_device_blocks == 0


def test_reference_model_depends_on_context() -> None:
    # Guards the fake: exactness checks are meaningless if the "model" ignores context.
    assert next_token([1, 2, 3]) != next_token([1, 2, 4])
    assert next_token([1, 2, 3]) != next_token([2, 1, 3])


# -- admission ---------------------------------------------------------------


def _snapshot(sched: Scheduler) -> tuple[object, ...]:
    return (sched.num_waiting, sched.live_req_ids(), sched.num_used_device_blocks)


@pytest.mark.parametrize(
    ("req", "error"),
    [
        (make_request("x", 0, 4), ValueError),
        (make_request("x", 4, 0), ValueError),
        (make_request("dup", 4, 4), DuplicateRequest),
        (make_request("x", 30, 3), PromptTooLong),  # 33 > max_model_len 32
        (make_request("x", 4, 4), QueueFull),
    ],
)
def test_validation_errors_have_no_side_effects(req: Request, error: type[Exception]) -> None:
    sched = make_scheduler(num_device_blocks=16, max_model_len=32, max_queue_len=2)
    sched.add_request(make_request("dup", 4, 4))
    if error is QueueFull:
        sched.add_request(make_request("filler", 4, 4))
    before = _snapshot(sched)
    with pytest.raises(error):
        sched.add_request(req)
    assert _snapshot(sched) == before
    assert req.arrival_index == 0 and req.status is RequestStatus.WAITING


def test_prompt_plus_output_larger_than_the_device_pool_is_too_long() -> None:
    sched = make_scheduler(num_device_blocks=4, block_size=4, max_model_len=64)
    sched.add_request(make_request("fits", 12, 4))  # 16 tokens = 4 blocks
    with pytest.raises(PromptTooLong, match="KV blocks"):
        sched.add_request(make_request("too-big", 12, 5))


def test_a_request_object_cannot_be_submitted_twice() -> None:
    sched = make_scheduler()
    req = make_request("a", 3, 1)
    sched.add_request(req)
    plan = sched.schedule(1.0)
    sched.update(plan, {"a": 1}, 1.0)
    assert req.is_finished
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_request(req)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sampling": SamplingParams(temperature=-0.5)}, "temperature"),
        ({"sampling": SamplingParams(temperature=math.nan)}, "temperature"),
        ({"sampling": SamplingParams(temperature=math.inf)}, "temperature"),
        ({"sampling": SamplingParams(top_p=0.0)}, "top_p"),
        ({"sampling": SamplingParams(top_p=1.5)}, "top_p"),
        ({"sampling": SamplingParams(top_k=-1)}, "top_k"),
        ({"sampling": SamplingParams(logprobs=-1)}, "logprobs"),
        ({"sampling": SamplingParams(logprobs=21)}, "logprobs"),
        ({"priority": -1}, "priority"),
        ({"prompt_token_ids": []}, "prompt is empty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_admission_refuses_parameters_no_policy_could_serve(
    change: dict[str, object], message: str
) -> None:
    sched = make_scheduler()
    req = dataclasses.replace(make_request("bad", 3, 2), **change)
    with pytest.raises(InvalidRequest, match=message) as refused:
        sched.add_request(req)
    assert str(refused.value) == f"request 'bad': {refused.value.detail}"
    assert (
        not sched.has_unfinished()
        and sched.num_free_device_blocks == sched.config.num_device_blocks
    )


@pytest.mark.parametrize(
    ("sampling", "field", "detail"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty", "must be in [-2, 2], got 2.5"),
        (SamplingParams(frequency_penalty=-3.0), "frequency_penalty", "in [-2, 2], got -3"),
        (SamplingParams(frequency_penalty=math.nan), "frequency_penalty", "in [-2, 2], got nan"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty", "[0.01, 100] (1 is off)"),
        (SamplingParams(repetition_penalty=-1.0), "repetition_penalty", "in [0.01, 100]"),
        (SamplingParams(repetition_penalty=1e38), "repetition_penalty", "got 1e+38"),
        (SamplingParams(repetition_penalty=1e-38), "repetition_penalty", "got 1e-38"),
        (SamplingParams(repetition_penalty=math.inf), "repetition_penalty", "got inf"),
        (SamplingParams(repetition_penalty=math.nan), "repetition_penalty", "got nan"),
        (SamplingParams(logit_bias=((5, 100.5),)), "logit_bias", "token 5 must be in [-100, 100]"),
        (SamplingParams(logit_bias=((5, -math.inf),)), "logit_bias", "got -inf"),
        (SamplingParams(logit_bias=((5, math.nan),)), "logit_bias", "got nan"),
        (
            SamplingParams(logit_bias=tuple((t, 1.0) for t in range(1025))),
            "logit_bias",
            "logit_bias has 1025 tokens, more than the 1024 allowed",
        ),
        (SamplingParams(logit_bias=((5, 60.0), (5, 60.0))), "logit_bias", "may appear once"),
        (SamplingParams(min_p=1.5), "min_p", "min_p must be in [0, 1] (0 is off), got 1.5"),
        (SamplingParams(min_p=-0.1), "min_p", "got -0.1"),
        (SamplingParams(min_p=math.nan), "min_p", "got nan"),
        (SamplingParams(min_tokens=-1), "min_tokens", "min_tokens must be >= 0, got -1"),
        (SamplingParams(min_tokens=3), "min_tokens", "min_tokens (3) must be at most"),
        (
            SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))),
            "stop_token_ids",
            f"stop_token_ids has 65 ids, more than the {MAX_STOP_TOKEN_IDS} allowed",
        ),
        (SamplingParams(stop_token_ids=(5, -1)), "stop_token_ids", "must be token ids, got -1"),
    ],
)
def test_admission_holds_every_caller_to_the_adjustments_bounds(
    sampling: SamplingParams, field: str, detail: str
) -> None:
    """The fronts refuse these first; an in-process caller's request meets
    the same bounds here, named by its field as the fronts name theirs."""
    sched = make_scheduler()
    req = dataclasses.replace(make_request("bad", 3, 2), sampling=sampling)
    with pytest.raises(InvalidRequest) as refused:
        sched.add_request(req)
    assert refused.value.field == field and detail in refused.value.detail, refused.value
    assert not sched.has_unfinished()


def test_admission_takes_adjustments_at_their_bounds() -> None:
    sched = make_scheduler()
    bounds = [
        SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01),
        SamplingParams(repetition_penalty=100.0),
        SamplingParams(logit_bias=tuple((t, -100.0 if t % 2 else 100.0) for t in range(1024))),
        SamplingParams(min_p=1.0, min_tokens=2),
        SamplingParams(min_p=0.0, stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS))),
    ]
    for i, sampling in enumerate(bounds):
        sched.add_request(dataclasses.replace(make_request(f"ok{i}", 3, 2), sampling=sampling))
    assert sched.num_waiting == len(bounds)


def test_priority_policy_admits_the_most_urgent_class_first() -> None:
    sched = make_scheduler(max_num_seqs=1, policy=PriorityPolicy())
    for i, priority in enumerate((2, 1, 0, 1)):
        sched.add_request(make_request(f"p{priority}-{i}", 2, 1, priority=priority, arrival=i))
    assert sched.counts_by_priority() == {
        0: {"waiting": 1, "running": 0, "swapped": 0},
        1: {"waiting": 2, "running": 0, "swapped": 0},
        2: {"waiting": 1, "running": 0, "swapped": 0},
    }
    driver = Driver(sched)
    order = []
    while sched.has_unfinished():
        driver.step()
        order += [s.req_id for s in driver.plans[-1].seqs]
    assert order == ["p0-2", "p1-1", "p1-3", "p2-0"]


def test_unknown_policy_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        Scheduler(
            SchedulerConfig(num_device_blocks=4, block_size=4, max_model_len=16, policy="nope")
        )


@pytest.mark.parametrize("field", ["aging_s", "min_residency_s"])
@pytest.mark.parametrize("value", [-1.0, float("nan")])
def test_a_negative_or_nan_time_is_rejected(field: str, value: float) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        SchedulerConfig(num_device_blocks=4, block_size=4, max_model_len=16, **{field: value})


# -- pause / resume (a stream whose client stopped reading) --------------------


def test_paused_request_keeps_its_blocks_and_is_not_scheduled_until_resumed() -> None:
    sched = make_scheduler()
    driver = Driver(sched)
    for req_id in ("held", "other"):
        sched.add_request(make_request(req_id, prompt_len=5, max_new_tokens=12))
    driver.step()
    driver.step()
    held = sched.get_request("held")
    assert held is not None
    blocks, num_outputs = list(held.block_ids), held.num_output_tokens
    sched.pause("held")
    for _ in range(4):
        driver.step()
        assert "held" not in {seq.req_id for seq in driver.plans[-1].seqs}
        check_pools(sched)
    assert (held.block_ids, held.num_output_tokens) == (blocks, num_outputs)
    assert len(driver.outputs["other"]) == num_outputs + 4  # the neighbour went on
    sched.resume("held")
    while "held" not in driver.finishes:
        driver.step()
    # Paused and resumed, it produced exactly what it would have alone.
    assert driver.outputs["held"] == reference_outputs(held)
    assert sched.num_paused == 0


def test_paused_waiting_request_is_not_admitted_and_abort_forgets_the_pause() -> None:
    sched = make_scheduler()
    driver = Driver(sched)
    sched.add_request(make_request("queued", prompt_len=5, max_new_tokens=4))
    sched.pause("queued")
    sched.pause("unknown")  # ignored
    assert sched.num_paused == 1
    driver.step()
    assert not driver.plans[-1].seqs and sched.num_used_device_blocks == 0
    driver.abort("queued")
    assert sched.num_paused == 0 and not sched.has_unfinished()


@pytest.mark.parametrize("policy", [SwapPolicy(), None], ids=["swap", "recompute"])
def test_time_preempted_runs_from_each_preemption_to_its_resume(
    policy: SchedulingPolicy | None,
) -> None:
    sched = make_scheduler(
        num_device_blocks=6, block_size=2, max_model_len=12, num_host_blocks=6, policy=policy
    )
    driver = Driver(sched)
    reqs = [make_request(f"r{i}", prompt_len=4, max_new_tokens=5, arrival=i) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    out_since: dict[str, float] = {}
    expected = dict.fromkeys((r.req_id for r in reqs), 0.0)
    while sched.has_unfinished():
        driver.step()
        plan = driver.plans[-1]
        for seq in plan.seqs:
            if seq.req_id in out_since:
                expected[seq.req_id] += driver.now - out_since.pop(seq.req_id)
        out_since.update(dict.fromkeys(plan.preempted_req_ids, driver.now))
    assert sum(r.num_preemptions for r in reqs) > 0
    assert {r.req_id: r.preempted_s for r in reqs} == expected
    assert any(expected.values())
    assert all(r.preempted_time(driver.now) == r.preempted_s for r in reqs)

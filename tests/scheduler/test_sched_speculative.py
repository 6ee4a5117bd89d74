"""Speculative decoding by prompt lookup in the scheduler: the draft search,
drafts in the plan (budget, blocks, limits, who may draft), and update()
taking verified tokens one by one. Fake clock, the paged fake runner."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from sched_fakes import EOS, Driver, check_pools, make_request, next_token, reference_outputs

from slipstream.scheduler import (
    FinishReason,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from slipstream.scheduler.block_manager import hash_block
from slipstream.scheduler.speculative import Drafter, DraftOverhead, DraftPrice, NgramIndex

PERIOD = 5


def echo_model(context: Sequence[int]) -> int:
    """A "model" that mostly repeats the token ``PERIOD`` back (so drafts
    from earlier in the sequence are often right) and now and then says a
    token of its own (so some are rejected)."""
    own = next_token(context)
    if len(context) >= PERIOD and own % 4:
        return context[-PERIOD]
    return own


def make_scheduler(num_device_blocks: int = 64, block_size: int = 4, **kwargs: object) -> Scheduler:
    options: dict[str, object] = {"max_model_len": 256, "num_speculative_tokens": 4}
    options.update(kwargs)
    config = SchedulerConfig(
        num_device_blocks=num_device_blocks,
        block_size=block_size,
        **options,  # type: ignore[arg-type]
    )
    return Scheduler(config)


def decoding_looped(sched: Scheduler, **request: object) -> tuple[Driver, Request]:
    """A request ``r`` whose prompt repeats itself (drafts to find), decoding
    on ``sched`` under a driver whose model echoes; ``request``: ``make_request``'s."""
    driver = Driver(sched, model=echo_model)
    req = make_request("r", prompt_len=0, **request)
    req.prompt_token_ids = [3, 4, 5, 6, 7, 3, 4, 5]
    decoding(sched, req, driver)
    return driver, req


def decoding(sched: Scheduler, req: Request, driver: Driver) -> None:
    """Adds ``req`` and steps until it has its first output (a decode next)."""
    sched.add_request(req)
    while not req.output_token_ids:
        driver.step()


# -- the draft search -------------------------------------------------------


def test_ngram_index_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    index = NgramIndex()
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert index.propose(tokens, 3) == [7, 8, 5]  # the later "1 2 3", not the first
    assert index.propose([*tokens, 7], 2) == [8, 5]  # grown by one token: "2 3 7"
    assert index.propose([4, 5, 6], 3) == []


def test_ngram_index_prefers_the_longest_suffix_and_never_matches_itself() -> None:
    # "3" alone last follows at 6 ("3 6"); "2 3" last followed by 4.
    tokens = [2, 3, 4, 0, 3, 6, 2, 3]
    assert NgramIndex().propose(tokens, 1) == [4]
    assert NgramIndex().propose([5, 5], 4) == []  # single tokens are not looked up
    assert NgramIndex().propose([5, 5, 5], 4) == [5]  # "5 5" ended at 2: one token follows
    assert NgramIndex().propose([1, 2], 4) == []
    assert NgramIndex().propose([1, 2, 1, 2], 0) == []


def price(break_even: float, step_s: float = 0.0) -> DraftPrice:
    """A step where a token is worth 10 ms and a draft costs ``break_even`` of that."""
    return DraftPrice(0.010, 0.010 * break_even, step_s)


def test_drafts_are_made_while_they_are_likely_enough_to_pay() -> None:
    drafter = Drafter()
    assert drafter.acceptance == 1.0  # no evidence: every draft is tried
    assert drafter.num_worth(4, price(0.6), False) == 4
    assert drafter.num_worth(4, None, False) == 4  # not priced: all
    drafter.observe(4, 1)  # one accepted, the second rejected: 1 of 2 examined
    assert drafter.acceptance == pytest.approx(2 / 3)
    assert drafter.num_worth(4, price(0.02), False) == 4  # batch 1: a draft costs a few percent
    assert drafter.num_worth(4, price(0.6), False) == 1  # (2/3)**1 above 0.6, (2/3)**2 below
    assert drafter.num_worth(4, price(0.4), False) == 2
    drafter.observe(4, 3)  # p = (1 * 0.9 + 3 + 1) / (2 * 0.9 + 4 + 1) = 0.72
    assert drafter.acceptance == pytest.approx(4.9 / 6.8)
    assert drafter.num_worth(4, price(0.5), False) == 2  # 0.72**2 = 0.52 > 0.5 > 0.72**3


def test_the_first_drafts_of_a_step_pay_for_holding_any() -> None:
    """p = 0.72, break-even 0.5: two drafts, 0.72 + 0.52 = 1.24 tokens of
    10 ms expected for 10 ms of drafts: they cover a once-only cost of 2 ms
    for the step, not one of 3 ms (unless the step already paid it)."""
    drafter = Drafter()
    drafter.observe(4, 1)
    drafter.observe(4, 3)
    assert drafter.num_worth(4, price(0.5, step_s=0.002), True) == 2
    assert drafter.num_worth(4, price(0.5, step_s=0.003), True) == 0
    assert drafter.num_worth(4, price(0.5, step_s=0.003), False) == 2


def test_a_request_that_stopped_drafting_is_tried_again() -> None:
    drafter = Drafter()
    for _ in range(3):
        drafter.observe(4, 0)
    assert drafter.num_worth(4, price(0.5), False) == 0
    skipped = 1
    while drafter.num_worth(4, price(0.5), False) == 0:
        skipped += 1
        assert skipped < 20
    assert drafter.acceptance > 0.5


def test_the_step_break_even_follows_the_cost_model() -> None:
    """Batch 8 on two cores: a draft token costs most of a decode's share of
    the step, so only requests whose drafts keep being accepted draft."""
    from slipstream.scheduler.cost_model import CostCoefficients, CostModel

    # A step of 8 decodes 8.8 ms, a draft token 0.67 ms (smollm2, bf16, Zen 5).
    cost = CostModel(CostCoefficients(0.0056, 0.00067, 0.0004, 0.0, 0.0))
    config = SchedulerConfig(
        num_device_blocks=256, block_size=4, max_model_len=256, num_speculative_tokens=4
    )
    sched = Scheduler(config, cost_model=cost)
    driver = Driver(sched, model=echo_model)
    for i in range(8):
        req = make_request(f"r{i}", prompt_len=0, max_new_tokens=60)
        req.prompt_token_ids = [3 + i, 4, 5, 6, 7, 3 + i, 4, 5]
        sched.add_request(req)
    driver.step()
    draft_price = sched._draft_price()
    assert draft_price is not None
    assert draft_price.break_even == pytest.approx(0.67 * 8 / 8.8, rel=0.01)
    plan = sched.schedule(driver.now + 1)
    # No evidence yet: every request with a match tries all four.
    assert {seq.num_drafts for seq in plan.seqs} == {0, 4}
    sched.update(plan, driver.runner.execute(plan), driver.now + 1, verified=driver.runner.verified)
    # A request whose first draft was rejected (p = 1/2, below 0.61) stops.
    doubtful = set()
    for req_id in sched.live_req_ids():
        req = sched.get_request(req_id)
        assert req is not None
        if req.drafter is not None and req.drafter.acceptance < 0.61:
            doubtful.add(req_id)
    assert doubtful
    plan = sched.schedule(driver.now + 2)
    assert all(seq.num_drafts == 0 for seq in plan.seqs if seq.req_id in doubtful)


# -- drafts in the plan -----------------------------------------------------


def test_a_decode_carries_drafts_counted_in_the_budget_and_blocks() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64)
    driver = Driver(sched, model=echo_model)
    req = make_request("r", prompt_len=12, max_new_tokens=40)
    req.prompt_token_ids = [7, 8, 9, 10, 11] * 2 + [7, 8]
    decoding(sched, req, driver)
    plan = sched.schedule(driver.now + 1)
    [seq] = plan.seqs
    assert seq.num_drafts == 4 and seq.sample
    tokens = req.prompt_token_ids + req.output_token_ids
    assert seq.token_ids[0] == tokens[-1] and seq.start_pos == len(tokens) - 1
    assert plan.num_tokens == 5
    assert len(req.block_ids) * 4 >= len(tokens) + 4  # the drafts' positions have slots
    sampled = driver.runner.execute(plan)
    verified = driver.runner.verified["r"]
    outputs = sched.update(plan, sampled, driver.now + 1, verified=driver.runner.verified)
    assert outputs[0].new_token_ids == verified
    assert req.num_computed_tokens == len(tokens) + len(verified) - 1  # one token behind
    assert sched.num_draft_tokens == 4 and sched.num_accepted_tokens == len(verified) - 1


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "planned-ahead"])
@pytest.mark.parametrize("num_device_blocks", [200, 30], ids=["roomy", "tight"])
def test_tokens_equal_one_decode_at_a_time(ahead: bool, num_device_blocks: int) -> None:
    """Drafts change how many steps a request takes, never its tokens: with
    EOS, token limits, the prefix cache, preemption under a tight pool and
    planning ahead, each request's output is the reference's."""
    sched = make_scheduler(
        num_device_blocks, block_size=4, max_num_batched_tokens=16, enable_prefix_cache=True
    )
    driver = Driver(sched, ahead=ahead, model=echo_model)
    requests = []
    for i in range(10):
        req = make_request(f"r{i}", prompt_len=6 + 3 * i, max_new_tokens=10 + 7 * i)
        req.ignore_eos = i % 3 == 0
        requests.append(req)
        sched.add_request(req)
    steps = 0
    while sched.has_unfinished() or driver._pending is not None:
        driver.step()
        check_pools(sched)
        steps += 1
        if not sched.has_unfinished():
            driver.flush()
    for req in requests:
        expected = reference_outputs(req, echo_model)
        assert driver.outputs[req.req_id] == expected, req.req_id
    # Planned ahead, a decode's last token is still in flight: nothing to
    # look up (the engine plans after a drafting step's results instead).
    assert sched.num_accepted_tokens > 20 or ahead
    assert sched.device_pool.num_used == 0


def test_nothing_is_planned_ahead_of_a_drafting_step_for_its_request() -> None:
    sched = make_scheduler()
    driver, _ = decoding_looped(sched, max_new_tokens=30)
    other = make_request("other", prompt_len=5, max_new_tokens=30)
    sched.add_request(other)
    drafting = sched.schedule(driver.now + 1)
    assert drafting.seqs[0].num_drafts > 0
    sampled = driver.runner.execute(drafting)
    verified = driver.runner.verified
    ahead = sched.schedule(driver.now + 2, ahead=True)
    assert [seq.req_id for seq in ahead.seqs] == ["other"]
    outputs = sched.update(drafting, sampled, driver.now + 2, verified=verified)
    assert outputs[0].new_token_ids == verified["r"]
    sched.update(ahead, driver.runner.execute(ahead), driver.now + 3)
    assert "r" in [seq.req_id for seq in sched.schedule(driver.now + 4).seqs]


def test_eos_among_accepted_tokens_ends_the_request_there() -> None:
    sched = make_scheduler()
    driver, req = decoding_looped(sched, max_new_tokens=30, ignore_eos=False)
    plan = sched.schedule(driver.now + 1)
    [seq] = plan.seqs
    assert seq.num_drafts >= 3
    drafts = seq.token_ids[1:]
    # The model agrees with the first draft, then says EOS; a token after it is dropped.
    verified = {"r": [drafts[0], EOS]}
    [out] = sched.update(plan, {"r": drafts[0]}, driver.now + 1, verified=verified)
    assert out.new_token_ids == [drafts[0], EOS] and out.finish_reason is FinishReason.EOS
    assert req.is_finished and sched.device_pool.num_used == 0


def test_a_stop_in_the_middle_drops_the_rest_and_each_token_is_asked() -> None:
    sched = make_scheduler()
    driver, req = decoding_looped(sched, max_new_tokens=30)
    plan = sched.schedule(driver.now + 1)
    [seq] = plan.seqs
    tokens = [*seq.token_ids[1:], 1]  # every draft accepted, then the model's own
    asked: list[int] = []

    def is_stopped(req_id: str, token_id: int) -> bool:
        asked.append(token_id)
        return len(asked) == 2

    verified = {"r": tokens}
    [out] = sched.update(plan, {"r": tokens[0]}, driver.now + 1, None, is_stopped, verified)
    assert asked == tokens[:2]
    assert out.new_token_ids == tokens[:2] and out.finish_reason is FinishReason.STOP_SEQUENCE
    assert req.output_token_ids[-2:] == tokens[:2]


def test_drafts_stop_short_of_the_token_limit() -> None:
    sched = make_scheduler()
    driver, _ = decoding_looped(sched, max_new_tokens=3)
    [seq] = sched.schedule(driver.now + 1).seqs
    assert seq.num_drafts == 1  # output 1 verifies one draft: outputs 1 and 2 at most


def test_cached_blocks_hold_accepted_tokens_only() -> None:
    """A rejected draft's K/V fill a block's slots, but the block is hashed
    and cached only once accepted tokens fill it, by those tokens."""
    sched = make_scheduler(block_size=4, enable_prefix_cache=True)
    driver = Driver(sched, model=echo_model)
    req = make_request("r", prompt_len=0, max_new_tokens=30)
    req.prompt_token_ids = [3, 4, 5, 6, 7, 3, 4, 5, 6]  # 9 tokens: block 2 holds one
    decoding(sched, req, driver)
    plan = sched.schedule(driver.now + 1)
    [seq] = plan.seqs
    assert seq.start_pos == 9 and seq.num_drafts == 4  # positions 9..13 cross into block 3
    # The model rejects the first draft: one token, no block filled by drafts.
    own = (seq.token_ids[1] + 1) % 97
    sched.update(plan, {"r": own}, driver.now + 1, verified={"r": [own]})
    assert req.num_computed_tokens == 10
    assert req.num_committed_blocks == 2 and len(req.block_hashes) == 2
    tokens = req.prompt_token_ids + req.output_token_ids
    parent = None
    for index, block_hash in enumerate(req.block_hashes):
        parent = hash_block(parent, tokens[index * 4 : (index + 1) * 4])
        assert block_hash == parent
    check_pools(sched)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(logprobs=0),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(logit_bias=((5, 1.0),)),
    ],
    ids=["logprobs", "penalty", "logit-bias"],
)
def test_requests_a_draft_would_break_decode_one_token_at_a_time(
    sampling: SamplingParams,
) -> None:
    sched = make_scheduler()
    driver = Driver(sched, model=echo_model)
    req = make_request("r", prompt_len=0, max_new_tokens=30)
    req.prompt_token_ids = [3, 4, 5, 6, 7, 3, 4, 5]
    req.sampling = sampling
    decoding(sched, req, driver)
    assert sched.schedule(driver.now + 1).seqs[0].num_drafts == 0


def test_sampling_requests_draft_too() -> None:
    sched = make_scheduler()
    driver = Driver(sched, model=echo_model)
    req = make_request("r", prompt_len=0, max_new_tokens=30)
    req.prompt_token_ids = [3, 4, 5, 6, 7, 3, 4, 5]
    req.sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    decoding(sched, req, driver)
    assert sched.schedule(driver.now + 1).seqs[0].num_drafts > 0


def test_a_constrained_request_decodes_one_token_at_a_time() -> None:
    sched = make_scheduler()
    driver = Driver(sched, model=echo_model)
    req = make_request("r", prompt_len=0, max_new_tokens=30)
    req.prompt_token_ids = [3, 4, 5, 6, 7, 3, 4, 5]
    req.is_draftable = False  # Request.from_spec: a spec with a constraint
    decoding(sched, req, driver)
    assert sched.schedule(driver.now + 1).seqs[0].num_drafts == 0


def test_off_by_default() -> None:
    sched = make_scheduler(num_speculative_tokens=0)
    driver, _ = decoding_looped(sched, max_new_tokens=30)
    assert sched.schedule(driver.now + 1).seqs[0].num_drafts == 0
    config = SchedulerConfig(num_device_blocks=1, block_size=1, max_model_len=1)
    assert config.num_speculative_tokens == 0


def test_drafts_fit_the_budget_left_and_the_free_blocks_never_preempting() -> None:
    # Budget: 3 tokens a step; the decode takes one, drafts the other two.
    sched = make_scheduler(max_num_batched_tokens=3)
    driver, req = decoding_looped(sched, max_new_tokens=30)
    assert sched.schedule(driver.now + 1).seqs[0].num_drafts == 2

    # Blocks: "r" at 10 tokens in 3 blocks of 4 (2 slots left past its
    # decode's), none free: it drafts into its own slots and preempts nobody.
    sched = make_scheduler(num_device_blocks=8, block_size=4)
    driver = Driver(sched, model=echo_model)
    req = make_request("r", prompt_len=0, max_new_tokens=20)
    req.prompt_token_ids = [3, 4, 5, 6, 7, 3, 4, 5, 6]
    decoding(sched, req, driver)
    assert len(req.block_ids) == 3 and req.num_tokens == 10
    taken = sched.device_pool.allocate(sched.device_pool.num_free)  # held elsewhere
    plan = sched.schedule(driver.now + 1)
    assert plan.seqs[0].num_drafts == 2 and not plan.preempted_req_ids
    sched.device_pool.free(taken)


def test_update_refuses_verified_tokens_that_do_not_follow_the_drafts() -> None:
    sched = make_scheduler()
    driver, req = decoding_looped(sched, max_new_tokens=30)
    plan = sched.schedule(driver.now + 1)
    drafts = plan.seqs[0].token_ids[1:]
    wrong = (drafts[0] + 1) % 97
    before = (list(req.output_token_ids), req.num_computed_tokens, req.status)
    for verified in ({}, {"r": [wrong, 1]}, {"r": [*drafts, 1, 2]}):
        with pytest.raises(ValueError):
            sched.update(plan, {"r": (verified.get("r") or [1])[0]}, driver.now, verified=verified)
    assert (req.output_token_ids, req.num_computed_tokens, req.status) == before


# -- what drafts cost ---------------------------------------------------------


def test_drafts_are_priced_as_prefill_tokens_and_fit_under_urgent_ceilings() -> None:
    from slipstream.scheduler.batch_shaping import BatchShaper
    from slipstream.scheduler.cost_model import CostCoefficients, CostModel, StepShape
    from slipstream.scheduler.plan import ScheduledSeq, StepPlan

    seq = ScheduledSeq("r", [1, 2, 3, 4, 5], 20, [0], True, 3, SamplingParams(), 4)
    shape = StepShape.of(StepPlan(step=1, seqs=[seq]))
    assert (shape.num_decode_seqs, shape.num_prefill_tokens, shape.num_context_tokens) == (1, 4, 25)

    # base 10 ms, 1 ms a prefill token, 10 ms a decode: an urgent decode makes
    # 20 ms of a 26 ms ceiling, which leaves room for 6 of its drafts.
    cost = CostModel(CostCoefficients(0.01, 0.001, 0.01, 0.0, 0.0))
    ceilings = {"urgent": 0.026}
    shaper = BatchShaper(cost, 0.0, lambda r, now: ceilings.get(r.req_id, float("inf")))
    urgent = make_request("urgent", 1, 40)
    urgent.output_token_ids.append(1)
    urgent.num_computed_tokens = 1
    assert shaper.fit(urgent, 1) == 1
    assert shaper.fit_drafts(urgent, 8) == 6  # its own ceiling: 6 ms left of 26
    shaper.commit(urgent, 1, 5)
    assert shaper.predicted_step_s == pytest.approx(0.025)
    background = make_request("bg", 1, 40, priority=2)
    background.output_token_ids.append(1)
    background.num_computed_tokens = 1
    assert shaper.fit(background, 1) == 0  # its decode alone passes the ceiling
    ceilings["urgent"] = 0.033
    shaper = BatchShaper(cost, 0.0, lambda r, now: ceilings.get(r.req_id, float("inf")))
    shaper.commit(urgent, 1)
    assert shaper.fit(background, 1) == 1  # 30 ms with its decode: 3 ms left
    assert shaper.fit_drafts(background, 8) == 3
    # Its own ceiling bounds them too: drafts all rejected must not make it late.
    ceilings["bg"] = 0.0315
    assert shaper.fit_drafts(background, 8) == 1


def test_what_holding_drafts_costs_a_step_is_measured() -> None:
    overhead = DraftOverhead()
    overhead.observe(True, 0.004, 0.010)
    assert overhead.seconds == 0.0  # nothing to compare with yet
    overhead.observe(False, 0.001, 0.010)  # the model's own error, drafts or not
    assert overhead.seconds == pytest.approx(0.003)
    for _ in range(100):
        overhead.observe(True, 0.0, 0.010)
    assert overhead.seconds == 0.0  # never below 0


def test_one_slow_step_moves_the_overhead_by_at_most_its_predicted_time() -> None:
    """A drafting step a page fault or a busy host slowed by 100 ms took
    the estimate to 100 ms at once, which priced every draft out."""
    overhead = DraftOverhead()
    overhead.observe(False, 0.0, 0.010)
    overhead.observe(True, 0.100, 0.010)
    assert overhead.seconds == pytest.approx(0.010)


def test_the_scheduler_prices_the_measured_overhead_of_drafting_steps() -> None:
    from slipstream.scheduler.cost_model import CostCoefficients, CostModel

    cost = CostModel(CostCoefficients(0.0056, 0.0004, 0.0004, 0.0, 0.0))
    config = SchedulerConfig(
        num_device_blocks=64, block_size=4, max_model_len=256, num_speculative_tokens=4
    )
    sched = Scheduler(config, cost_model=cost)
    driver, req = decoding_looped(sched, max_new_tokens=60)
    now = driver.now
    for draftable, late_s in ((False, 0.0), (True, 0.003)):  # drafting steps 3 ms late
        req.is_draftable = draftable
        now += 1
        plan = sched.schedule(now)
        assert (plan.seqs[0].num_drafts > 0) is draftable
        sampled = driver.runner.execute(plan)
        step_s = cost.plan_seconds(plan) + late_s
        sched.update(plan, sampled, now, step_s, verified=driver.runner.verified)
    draft_price = sched._draft_price()
    assert draft_price is not None and draft_price.step_s == pytest.approx(0.003)


def drafts_in_steps(sched: Scheduler, driver: Driver, req: Request, steps: int) -> int:
    """Draft tokens planned for ``req`` over ``steps`` steps (each updated
    with its predicted time, so the cost model and the overhead stay put)."""
    cost = sched._cost_model
    num_drafts = 0
    for _ in range(steps):
        if req.status.name == "FINISHED":
            break
        driver.now += 1
        plan = sched.schedule(driver.now)
        num_drafts += sum(seq.num_drafts for seq in plan.seqs)
        sampled = driver.runner.execute(plan)
        step_s = None if cost is None else cost.plan_seconds(plan)
        sched.update(plan, sampled, driver.now, step_s, verified=driver.runner.verified)
    return num_drafts


def draft_ready(cost: object, max_new_tokens: int = 120, **sampling: object) -> tuple:
    from slipstream.scheduler.request import SamplingParams

    config = SchedulerConfig(
        num_device_blocks=128, block_size=4, max_model_len=512, num_speculative_tokens=4
    )
    sched = Scheduler(config, cost_model=cost)  # type: ignore[arg-type]
    driver = Driver(sched, model=echo_model)
    req = make_request("r", prompt_len=0, max_new_tokens=max_new_tokens)
    req.prompt_token_ids = [3, 4, 5, 6, 7, 3, 4, 5]
    if sampling:
        req.sampling = SamplingParams(**sampling)  # type: ignore[arg-type]
    return sched, driver, req


def test_a_calibrations_prefill_step_cost_does_not_rule_drafting_out() -> None:
    """The once-only cost of a drafting step was the larger of the measured
    overhead and the cost model's prefill-step coefficient; a noisy
    start-up fit put that at 0.36-0.82 s on a CPU, no draft was ever made,
    and so nothing was measured that could correct it."""
    from slipstream.scheduler.cost_model import CostCoefficients, CostModel

    cost = CostModel(CostCoefficients(0.0056, 0.0004, 0.0004, 0.0, per_prefill_step_s=0.8))
    sched, driver, req = draft_ready(cost)
    decoding(sched, req, driver)
    assert drafts_in_steps(sched, driver, req, 8) > 0


def test_drafting_priced_out_by_a_stale_overhead_is_probed_again() -> None:
    from slipstream.scheduler.cost_model import CostCoefficients, CostModel
    from slipstream.scheduler.speculative import DRAFT_PROBE_STEPS

    cost = CostModel(CostCoefficients(0.0056, 0.0004, 0.0004, 0.0, 0.0))
    sched, driver, req = draft_ready(cost, max_new_tokens=200)
    decoding(sched, req, driver)
    sched._draft_overhead.observe(False, 0.0, 1.0)
    sched._draft_overhead.observe(True, 1.0, 1.0)  # a second a step: nothing pays that
    assert drafts_in_steps(sched, driver, req, DRAFT_PROBE_STEPS) == 0
    assert drafts_in_steps(sched, driver, req, 2) > 0  # a probe step holds drafts


def test_a_request_drafts_once_its_min_tokens_are_out() -> None:
    """min_tokens masks EOS and stop ids only until that many outputs are
    out; it kept a request from drafting for its whole life."""
    sched, driver, req = draft_ready(None, min_tokens=3)
    decoding(sched, req, driver)
    assert drafts_in_steps(sched, driver, req, 1) == 0  # 1 output: still inside min_tokens
    assert drafts_in_steps(sched, driver, req, 12) > 0

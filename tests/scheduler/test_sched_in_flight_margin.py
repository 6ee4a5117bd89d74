"""The deadline policy's step ceilings while a step is in flight: an engine
planning ahead runs a request's next step one step later than its count of
steps says, and the ceilings keep ``IN_FLIGHT_MARGIN_STEPS`` more spare
steps for it."""

from __future__ import annotations

import pytest
from sched_fakes import make_request

from slipstream.scheduler import CostCoefficients, CostModel, Scheduler, SchedulerConfig
from slipstream.scheduler.batch_shaping import CEILING_MARGIN_STEPS, IN_FLIGHT_MARGIN_STEPS
from slipstream.scheduler.deadline_policy import DeadlinePolicy

STEP_S = 0.002


def _scheduler() -> Scheduler:
    config = SchedulerConfig(
        num_device_blocks=256, block_size=16, max_model_len=512, max_num_seqs=8, policy="deadline"
    )
    cost = CostModel(CostCoefficients(base_s=STEP_S, per_prefill_token_s=0.0,
                                      per_decode_seq_s=0.0, per_context_token_s=0.0))  # fmt: skip
    return Scheduler(config, cost_model=cost)


def test_a_step_in_flight_widens_the_ceilings_margin() -> None:
    sched = _scheduler()
    policy = sched.policy
    assert isinstance(policy, DeadlinePolicy)
    req = make_request("a", 20, 10, deadline=1.0)
    steps = 10  # one prefill that samples, then nine decodes
    policy.observe_in_flight(0)
    assert policy.step_ceiling(req, 0.0) == pytest.approx(1.0 / (steps + CEILING_MARGIN_STEPS))
    assert policy.steps_to_limit(req) == steps + CEILING_MARGIN_STEPS
    policy.observe_in_flight(1)
    wider = steps + CEILING_MARGIN_STEPS + IN_FLIGHT_MARGIN_STEPS
    assert IN_FLIGHT_MARGIN_STEPS > 0
    assert policy.step_ceiling(req, 0.0) == pytest.approx(1.0 / wider)
    assert policy.steps_to_limit(req) == wider


def test_the_scheduler_says_whether_a_step_is_in_flight() -> None:
    sched = _scheduler()
    req = make_request("a", 20, 10, deadline=1.0)
    sched.add_request(req)
    told: list[int] = []
    observe = sched.policy.observe_in_flight
    sched.policy.observe_in_flight = lambda steps: (told.append(steps), observe(steps))[1]  # type: ignore[method-assign]
    first = sched.schedule(0.0)
    second = sched.schedule(STEP_S, ahead=True)  # the first still on the device
    sched.update(first, {s.req_id: 7 for s in first.seqs if s.sample}, 2 * STEP_S)
    sched.update(second, {s.req_id: 7 for s in second.seqs if s.sample}, 2 * STEP_S)
    sched.schedule(2 * STEP_S)
    assert told == [0, 1, 0]

"""The simulator planning ahead, as the engine does on a GPU: each step is
planned while the one before runs, so work that arrives while the device is
busy gets its tokens one step later than when every step is planned after
the one before ends, and nothing else changes."""

from __future__ import annotations

import random

import pytest

from slipstream.scheduler import CostCoefficients, CostModel, SchedulerConfig
from slipstream.scheduler.plan import StepPlan
from slipstream.scheduler.request import FinishReason
from slipstream.scheduler.simulator import SimRequest, simulate

STEP_S = 0.01


def _config(policy: str = "fcfs") -> SchedulerConfig:
    return SchedulerConfig(
        num_device_blocks=512, block_size=16, max_model_len=512, max_num_seqs=8, policy=policy
    )


def _fixed_step(plan: StepPlan) -> float:
    return STEP_S


def _cost() -> CostModel:
    return CostModel(CostCoefficients(base_s=STEP_S, per_prefill_token_s=0.0, per_decode_seq_s=0.0,
                                      per_context_token_s=0.0))  # fmt: skip


def _run(requests: list[SimRequest], ahead: bool, policy: str = "fcfs"):  # type: ignore[no-untyped-def]
    result = simulate(requests, _config(policy), _cost(), step_seconds=_fixed_step,
                      plan_ahead=ahead)  # fmt: skip
    return result, {o.req_id: o for o in result.outcomes}


def test_a_lone_request_is_not_delayed_by_planning_ahead() -> None:
    # Alone, the device runs its steps back to back either way.
    alone = [SimRequest("a", 0.0, prompt_len=20, output_len=5)]
    _, sync = _run(alone, ahead=False)
    _, ahead = _run(alone, ahead=True)
    assert sync["a"].first_token_time == ahead["a"].first_token_time == pytest.approx(STEP_S)
    assert sync["a"].finish_time == ahead["a"].finish_time == pytest.approx(5 * STEP_S)


def test_work_arriving_while_a_step_runs_gets_its_tokens_one_step_later() -> None:
    # b arrives halfway through a's first step: planned after that step ends,
    # it runs one step later; planned ahead, the step after that is already
    # planned (without it) and b joins the one after.
    requests = [
        SimRequest("a", 0.0, prompt_len=20, output_len=20),
        SimRequest("b", STEP_S / 2, prompt_len=20, output_len=4),
    ]
    _, sync = _run(requests, ahead=False)
    _, ahead = _run(requests, ahead=True)
    assert sync["b"].first_token_time == pytest.approx(2 * STEP_S)
    assert ahead["b"].first_token_time == pytest.approx(3 * STEP_S)
    assert ahead["b"].finish_time - sync["b"].finish_time == pytest.approx(STEP_S)
    assert ahead["a"].finish_time == sync["a"].finish_time  # a's steps never waited


@pytest.mark.parametrize("policy", ["fcfs", "priority", "deadline"])
def test_planning_ahead_completes_every_request_with_all_its_tokens(policy: str) -> None:
    rng = random.Random(7)
    requests, now = [], 0.0
    for i in range(120):
        now += rng.expovariate(60.0)
        output = rng.randint(1, 30)
        requests.append(
            SimRequest(f"r{i}", now, rng.randint(1, 200), output, priority=rng.choice((0, 1, 2)))
        )
    result, outcomes = _run(requests, ahead=True, policy=policy)
    assert all(o.finish_reason is FinishReason.MAX_TOKENS for o in outcomes.values())
    for spec in requests:
        out = outcomes[spec.req_id]
        assert out.num_output_tokens == spec.output_len
        assert out.first_token_time is not None and out.first_token_time > spec.arrival
    assert result.busy_s <= result.makespan_s + 1e-9

"""A cost model that has talked itself out of every request must come back:
its predictions stay within MAX_DRIFT of the start-up calibration, and idle
time relaxes it (and the deadline policy's loaded step) toward that
calibration, so an engine that turned all work away lets work in again."""

from __future__ import annotations

import pytest
from sched_fakes import Driver, make_request

from slipstream.scheduler import (
    CostCoefficients,
    CostModel,
    DeadlineInfeasible,
    Scheduler,
    SchedulerConfig,
    StepShape,
)
from slipstream.scheduler.cost_model import MAX_DRIFT, RELAX_HALF_LIFE_S

START = CostCoefficients(0.01, 0.0004, 0.0015, 2e-6, 0.0)  # a start-up calibration
SHAPES = (StepShape(0, 1, 100), StepShape(0, 32, 4000), StepShape(512, 0, 512))


def _storm(model: CostModel, steps: int = 400) -> None:
    """Every step 100x its prediction: a host that stalls for minutes."""
    for i in range(steps):
        shape = SHAPES[i % len(SHAPES)]
        model.observe(shape, 100.0 * model.step_seconds(shape))


def test_a_storm_of_stalls_moves_predictions_at_most_max_drift() -> None:
    start = CostModel(START)
    capped, free = CostModel(START), CostModel(START, max_drift=None)
    _storm(capped)
    _storm(free)
    for shape in SHAPES:
        assert capped.step_seconds(shape) <= MAX_DRIFT * start.step_seconds(shape) * (1 + 1e-9)
        assert free.step_seconds(shape) > 2 * MAX_DRIFT * start.step_seconds(shape)
    # The closed forms are held to the same bound.
    alone = start.service_seconds(0, 64, 32, token_budget=512)
    assert capped.service_seconds(0, 64, 32, token_budget=512) <= MAX_DRIFT * alone * (1 + 1e-9)


def test_idle_time_relaxes_the_fit_toward_the_start_by_its_half_life() -> None:
    start = CostModel(START)
    model = CostModel(START)
    _storm(model, steps=6)  # a moderate departure, under the cap
    shape = SHAPES[0]
    departure = model.step_seconds(shape) - start.step_seconds(shape)
    assert departure > 0
    model.relax(RELAX_HALF_LIFE_S)
    assert model.step_seconds(shape) - start.step_seconds(shape) == pytest.approx(departure / 2)
    model.relax(0.0)  # no time, no change
    assert model.step_seconds(shape) - start.step_seconds(shape) == pytest.approx(departure / 2)


def test_idle_time_relaxes_the_pace_and_overrun_a_stall_left() -> None:
    """Steps 8x their prediction leave a pace and an overrun (the margin every
    deadline keeps) that no step corrects while the engine idles: idle time
    takes them back toward their start like the fit."""
    model = CostModel(START, overrun=0.1)
    for i in range(60):
        shape = SHAPES[i % len(SHAPES)]
        model.observe(shape, 8.0 * model.step_seconds(shape))
    pace, overrun = model.pace, model.overrun
    assert pace > 3.0 and overrun > 0.4
    model.relax(RELAX_HALF_LIFE_S)
    assert model.pace - 1.1 == pytest.approx((pace - 1.1) / 2)
    assert model.overrun - 0.1 == pytest.approx((overrun - 0.1) / 2)
    model.relax(1e6)
    assert model.pace == pytest.approx(1.1) and model.overrun == pytest.approx(0.1)


def test_relaxing_a_model_at_its_start_changes_nothing() -> None:
    model = CostModel(START)
    before = [model.step_seconds(s) for s in SHAPES]
    model.relax(1e6)
    assert [model.step_seconds(s) for s in SHAPES] == before


def test_an_engine_that_refused_everything_lets_work_in_after_idling() -> None:
    model = CostModel(START)
    sched = Scheduler(
        SchedulerConfig(
            num_device_blocks=256,
            block_size=16,
            max_model_len=1024,
            policy="deadline",
            min_residency_s=0.0,
        ),
        cost_model=model,
    )
    alone = CostModel(START).service_seconds(0, 64, 32, token_budget=512)
    driver = Driver(sched)
    # Steps measured far slower than predicted poison both the model and the
    # policy's loaded step time.
    for i in range(4):
        sched.add_request(make_request(f"bg{i}", 64, 200, priority=2, arrival=0.0))
    for _ in range(60):
        plan = sched.schedule(driver.now)
        model.observe_plan(plan, 100.0 * model.plan_seconds(plan))
        driver.record(sched.update(plan, driver.runner.execute(plan), driver.now))
        driver.now += 1.0
    for i in range(4):
        driver.abort(f"bg{i}")
    assert not sched.has_unfinished()

    def urgent(req_id: str) -> object:
        deadline = driver.now + 4.0 * alone  # four times its calibrated time alone
        return make_request(req_id, 64, 32, priority=2, arrival=driver.now, deadline=deadline)

    with pytest.raises(DeadlineInfeasible):
        sched.add_request(urgent("refused"))  # type: ignore[arg-type]
    sched.observe_idle(5 * RELAX_HALF_LIFE_S)
    sched.add_request(urgent("admitted"))  # type: ignore[arg-type]
    plan = sched.schedule(driver.now)
    assert [seq.req_id for seq in plan.seqs] == ["admitted"], plan.finished


def test_the_step_time_pace_is_reported_once_steps_are_measured() -> None:
    """``step_time_pace`` (a gauge operators watch): None before any measured
    step, then above 1 while steps run slower than predicted."""
    model = CostModel(START)
    sched = Scheduler(
        SchedulerConfig(num_device_blocks=64, block_size=16, max_model_len=256), cost_model=model
    )
    assert sched.step_time_pace is None
    assert Scheduler(SchedulerConfig(64, 16, 256)).step_time_pace is None  # no cost model
    sched.add_request(make_request("a", 8, 4, arrival=0.0))
    driver = Driver(sched)
    for _ in range(3):
        plan = sched.schedule(driver.now)
        step_s = 3.0 * model.plan_seconds(plan)
        driver.record(sched.update(plan, driver.runner.execute(plan), driver.now, step_s))
    pace = sched.step_time_pace
    assert pace is not None and 1.0 < pace <= 3.0

"""The fast paths of the deadline policy and the scheduler against brute force.

The same random script drives two schedulers: one as shipped, one with a
reference policy that recomputes every urgency from the formulas in
``deadline_estimates``'s docstring (no per-step memo), asks about abandonment
one request at a time (the seam's default), picks admission victims by a
plain maximum over all running requests, and a scheduler that ranks the
waiting queue afresh on every walk. Every plan and every output must be
identical — the optimizations may only make decisions faster.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_fakes import Driver, make_request

from slipstream.scheduler import (
    CostCoefficients,
    CostModel,
    DeadlinePolicy,
    PreemptionMode,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
)
from slipstream.scheduler.deadline_estimates import HOPELESS_LOAD_FRACTION
from slipstream.scheduler.scheduler import _StepState
from slipstream.scheduler.simulator import SimRequest, simulate

# The reference's hopeless rule uses the loaded remaining time as is.
assert HOPELESS_LOAD_FRACTION == 1.0

COEFFS = CostCoefficients(1.0, 0.05, 0.1, 0.001, 0.001)


class BruteForceDeadlinePolicy(DeadlinePolicy):
    """The deadline policy's decisions, each computed from scratch."""

    name = "deadline-brute-force"
    num_admission_victims = 0

    def is_hopeless(self, req: Request, now: float) -> bool:
        if req.deadline is None:
            return False
        needed = self.remaining_seconds(req)
        if req.status is not RequestStatus.RUNNING and self.effective_class(req, now) > 0:
            needed = self.loaded_remaining_seconds(req)
        return now + needed > req.deadline

    def urgency_key(self, req: Request, now: float) -> tuple[float, ...]:
        return (
            float(self.is_hopeless(req, now)),
            float(self.effective_class(req, now)),
            self._latest_start(req),
            float(req.arrival_index),
        )

    def order_waiting(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: self.urgency_key(r, now))

    def order_swapped(self, swapped: Iterable[Request], now: float) -> list[Request]:
        return sorted(swapped, key=lambda r: self.urgency_key(r, now))

    def order_running(self, running: Iterable[Request], now: float) -> list[Request]:
        return sorted(running, key=lambda r: self.urgency_key(r, now))

    def victim_key(self, req: Request, now: float) -> tuple[float, ...]:
        return (
            float(self.is_hopeless(req, now)),
            float(req.priority),
            -float(req.num_computed_tokens),
            self._latest_start(req),
            float(req.arrival_index),
        )

    def admission_victim(
        self, candidate: Request, running: Sequence[Request], now: float, num_ahead: int = 0
    ) -> Request | None:
        if self.is_hopeless(candidate, now):
            return None
        eligible = [r for r in running if not self._is_protected(r, now)]
        victim = max(eligible, key=lambda r: self.victim_key(r, now), default=None)
        if victim is None:
            return None
        if not self.is_hopeless(victim, now) and (
            victim.priority <= candidate.priority
            or self._can_wait(candidate, running, now, num_ahead)
        ):
            return None
        self.num_admission_victims += 1
        return victim

    def preemption_mode(self, victim: Request, can_swap: bool, now: float) -> PreemptionMode:
        if not can_swap or victim.num_computed_tokens == 0 or self.is_hopeless(victim, now):
            return PreemptionMode.RECOMPUTE
        return super().preemption_mode(victim, can_swap, now)

    def abandon_reason(self, req: Request, now: float) -> str:
        hopeless = req.deadline is not None and self.is_hopeless(req, now)
        reason = super().abandon_reason(req, now)  # only for its message
        assert bool(reason) == hopeless, (req.req_id, reason)
        return reason

    # One request at a time, through ``abandon_reason``.
    abandon_reasons = SchedulingPolicy.abandon_reasons


class RankEveryWalkScheduler(Scheduler):
    """Asks the policy for the waiting order on every walk of the queue, and
    for the budget held back from every running request."""

    num_held_back_tokens = 0

    def _ordered_waiting(self, state: _StepState, now: float) -> list[Request]:
        return self.policy.order_waiting(self._waiting, now)

    def _available(
        self, state: _StepState, req: Request, now: float, needed: int, reserved: int
    ) -> int:
        held = self._held(state, req, now)
        self.num_held_back_tokens += held
        return state.token_budget - held


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    return SchedulerConfig(
        num_device_blocks=draw(st.integers(6, 16)),
        block_size=draw(st.integers(1, 4)),
        max_model_len=24,
        max_num_seqs=draw(st.integers(1, 3)),
        max_num_batched_tokens=draw(st.integers(4, 16)),
        num_host_blocks=draw(st.sampled_from([0, 4, 12])),
        max_queue_len=draw(st.integers(4, 12)),
        aging_s=draw(st.sampled_from([0.0, 4.0, 60.0])),
        min_residency_s=draw(st.sampled_from([0.0, 0.0, 1.5])),
        reject_infeasible=draw(st.booleans()),
        abandon_hopeless=draw(st.booleans()),
    )


add_op = st.tuples(
    st.just("add"),
    st.integers(1, 10),  # prompt length
    st.integers(1, 8),  # max_new_tokens
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.floats(3.0, 15.0), st.floats(3.0, 60.0)),  # deadline offset
    st.booleans(),  # ignore_eos
)
step_op = st.tuples(st.just("step"), st.sampled_from([0.25, 1.0, 1.0, 2.5]))
ops = st.lists(
    st.one_of(
        add_op, add_op, add_op, step_op, step_op, st.tuples(st.just("abort"), st.integers(0, 99))
    ),
    min_size=20,
    max_size=80,
)


class Pair:
    """The shipped scheduler and the brute-force one, driven in lockstep."""

    def __init__(self, config: SchedulerConfig) -> None:
        fast = Scheduler(config, DeadlinePolicy(config, CostModel(COEFFS)))
        slow = RankEveryWalkScheduler(config, BruteForceDeadlinePolicy(config, CostModel(COEFFS)))
        self.drivers = (Driver(fast), Driver(slow))
        self.num_added = 0

    def apply(self, op: tuple[object, ...]) -> None:
        fast, slow = self.drivers
        if op[0] == "add":
            self._add(*op[1:])
        elif op[0] == "step":
            assert isinstance(op[1], float)
            outputs = [driver.step(op[1]) for driver in self.drivers]
            assert outputs[0] == outputs[1]
            assert fast.plans[-1] == slow.plans[-1]
        else:
            live = fast.scheduler.live_req_ids()
            assert live == slow.scheduler.live_req_ids()
            if live:
                assert isinstance(op[1], int)
                victim = live[op[1] % len(live)]
                for driver in self.drivers:
                    driver.abort(victim)

    def _add(self, *params: object) -> None:
        prompt_len, max_new, priority, offset, ignore_eos = params
        assert isinstance(prompt_len, int) and isinstance(max_new, int)
        assert isinstance(priority, int) and isinstance(ignore_eos, bool)
        req_id = f"r{self.num_added}"
        self.num_added += 1
        rejections = []
        for driver in self.drivers:
            req = make_request(
                req_id,
                prompt_len,
                max_new,
                arrival=driver.now,
                priority=priority,
                deadline=None if offset is None else driver.now + float(offset),  # type: ignore[arg-type]
                ignore_eos=ignore_eos,
            )
            try:
                driver.scheduler.add_request(req)
                rejections.append("")
            except Exception as exc:
                rejections.append(f"{type(exc).__name__}: {exc}")
        assert rejections[0] == rejections[1]

    def finish(self) -> None:
        for _ in range(500):
            if not self.drivers[0].scheduler.has_unfinished():
                break
            self.apply(("step", 1.0))
        fast, slow = self.drivers
        assert not fast.scheduler.has_unfinished() and not slow.scheduler.has_unfinished()
        assert fast.finishes == slow.finishes and fast.outputs == slow.outputs
        for name in ("num_abandoned", "num_expired", "num_swap_preemptions"):
            assert getattr(fast.scheduler, name) == getattr(slow.scheduler, name), name
        # Shown by ``pytest --hypothesis-show-statistics``: the scripts reach the fast paths.
        sched = fast.scheduler
        event(f"abandoned: {sched.num_abandoned > 0}")
        event(f"preempted: {sched.num_swap_preemptions + sched.num_recompute_preemptions > 0}")
        policy = slow.scheduler.policy
        assert isinstance(policy, BruteForceDeadlinePolicy)
        event(f"preempted for admission: {policy.num_admission_victims > 0}")
        assert isinstance(slow.scheduler, RankEveryWalkScheduler)
        event(f"budget held back from running work: {slow.scheduler.num_held_back_tokens > 0}")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), script=ops)
def test_fast_paths_plan_exactly_like_brute_force(
    config: SchedulerConfig, script: list[tuple[object, ...]]
) -> None:
    pair = Pair(config)
    for op in script:
        pair.apply(op)
    pair.finish()


def test_simulated_overload_decides_exactly_like_brute_force() -> None:
    """Long queues, aging, abandonment and swaps at once, as in the SLO bench."""
    rng = random.Random(7)
    requests, now = [], 0.0
    for i in range(300):
        now += rng.expovariate(1.0 / 0.04)
        prompt, output = rng.randint(8, 200), rng.randint(4, 60)
        slack = rng.choice([None, 2.0, 6.0, 20.0])
        requests.append(
            SimRequest(
                req_id=f"r{i}",
                arrival=now,
                prompt_len=prompt,
                output_len=output,
                priority=i % 3,
                deadline=None if slack is None else now + slack,
                expected_output_tokens=rng.choice([None, output, output // 2 + 1]),
            )
        )
    config = SchedulerConfig(
        num_device_blocks=96,
        block_size=16,
        max_model_len=264,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        num_host_blocks=48,
        aging_s=3.0,
        # Overload shedding would turn the heavy requests away at the door
        # and leave no preemption to compare.
        shed_under_overload=False,
    )
    cost = CostModel(CostCoefficients(0.01, 0.0004, 0.0015, 0.000002, 0.00005))
    fast = simulate(requests, config, cost)  # config.policy: the shipped deadline policy
    slow = simulate(requests, config, cost, BruteForceDeadlinePolicy(config, cost))
    assert fast == slow
    reasons = {o.finish_reason.name for o in fast.outcomes}
    # The workload reaches both completion and an early end (expired, or
    # rejected as infeasible while queued).
    assert "MAX_TOKENS" in reasons and reasons & {"DEADLINE_EXCEEDED", "REJECTED"}
    assert fast.num_swap_preemptions + fast.num_recompute_preemptions > 0

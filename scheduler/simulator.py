"""The policy simulator: the real ``Scheduler`` driven by a fake clock, with
the cost model standing in for the model.

Each iteration is one engine step::

    submit every request that has arrived by now
    plan = scheduler.schedule(now)
    now += cost_model.plan_seconds(plan)       # swaps + one forward
    scheduler.update(plan, {sampling seq: token}, now)

Planning ahead (``plan_ahead``, as the engine does on a GPU): step N+1 is
planned when step N starts on the device, before N's results, and N's
results are applied when N ends, where N+1 starts::

    plan N+1 = scheduler.schedule(now, ahead=True)   # now: N's start
    now = N's start + N's seconds
    scheduler.update(plan N, ...)                    # N+1 starts at now

so a request's tokens arrive one step after the plan that schedules them
ends, as on the engine (the host's own time is left out: the device is the
pace).

Requests ignore EOS and make exactly ``output_len`` tokens (unless they
expire). A step's seconds are charged to its sequences in proportion to
their scheduled tokens, so the compute a request consumed is known even when
it later misses its deadline. Deterministic: same inputs, same result.

A simulated *twin* of a live engine starts where the engine's policy stood:
``carried_state`` takes what the policy has learned from past requests,
``resume_policy`` starts the twin's policy from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .batch_shaping import ArrivalReserve
from .config import SchedulerConfig
from .cost_model import CostModel
from .deadline_policy import DeadlinePolicy
from .errors import SchedulerError
from .overload import OverloadShedder
from .plan import RequestOutput, StepPlan
from .policy_base import SchedulingPolicy
from .request import FinishReason, RejectCause, Request
from .scheduler import Scheduler

_TOKEN = 5  # every prompt and output token; the simulated "model" ignores content


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One simulated request; times are seconds from the start of the run."""

    req_id: str
    arrival: float
    prompt_len: int
    output_len: int
    priority: int = 0
    deadline: float | None = None
    expected_output_tokens: int | None = None
    first_token_deadline: float | None = None


# ``SimOutcome.rejection`` of requests the scheduler rejected after queueing
# them (the names of the errors an early rejection raises, and "Shed").
REJECT_CAUSE_NAMES = {
    RejectCause.SHED: "Shed",
    RejectCause.DEADLINE_INFEASIBLE: "DeadlineInfeasible",
}


@dataclass(frozen=True, slots=True)
class SimOutcome:
    """What happened to one request. ``rejection`` names the domain error of
    an early rejection ("" when admitted; "Shed" when displaced from a full
    queue); times are None when not reached."""

    req_id: str
    priority: int
    arrival: float
    deadline: float | None
    finish_reason: FinishReason
    rejection: str
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    num_output_tokens: int
    compute_s: float
    num_preemptions: int
    first_token_deadline: float | None = None
    num_held_back: int = 0  # steps the batch shaper held it back

    @property
    def met_deadline(self) -> bool:
        """Completed within its deadline and, if it had one, its first-token deadline."""
        completed = self.finish_reason in (FinishReason.MAX_TOKENS, FinishReason.EOS)
        if not completed or (self.deadline is not None and self.finish_time > self.deadline):
            return False
        limit = self.first_token_deadline
        return limit is None or (
            self.first_token_time is not None and self.first_token_time <= limit
        )


@dataclass(frozen=True, slots=True)
class SimResult:
    outcomes: list[SimOutcome]
    makespan_s: float
    busy_s: float
    num_steps: int
    num_swap_preemptions: int
    num_recompute_preemptions: int
    num_swapped_out_blocks: int


@dataclass(slots=True)
class _Track:
    spec: SimRequest
    req: Request
    compute_s: float = 0.0
    finish_time: float | None = None


class Simulator:
    """Replays ``requests`` through a fresh scheduler; one ``run()`` each."""

    def __init__(
        self,
        config: SchedulerConfig,
        cost_model: CostModel,
        policy: SchedulingPolicy | None = None,
        max_steps: int = 10_000_000,
        step_seconds: Callable[[StepPlan], float] | None = None,
        plan_ahead: bool = False,
    ) -> None:
        """``step_seconds``: what a step really takes on the simulated device
        (None: the cost model's prediction). Given, the scheduler's cost model
        refits online from those times, as the engine's does from measured
        steps: a device whose steps the model cannot express. ``plan_ahead``:
        each step is planned while the one before it runs (the module)."""
        self.config = config
        self.cost_model = cost_model
        self._step_seconds = step_seconds
        self._plan_ahead = plan_ahead
        # Planning ahead: the step on the device, its start and its seconds.
        self._in_flight: tuple[StepPlan, float] | None = None
        self.scheduler = Scheduler(config, policy, cost_model)
        self._max_steps = max_steps
        self._tracks: dict[str, _Track] = {}
        self._outcomes: dict[str, SimOutcome] = {}
        self._busy_s = 0.0
        self._swapped_out = 0
        self.now = 0.0

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        pending = sorted(requests, key=lambda r: (r.arrival, r.req_id))
        sched = self.scheduler
        next_index, steps = 0, 0
        while next_index < len(pending) or sched.has_unfinished() or self._in_flight:
            while next_index < len(pending) and pending[next_index].arrival <= self.now:
                self._submit(pending[next_index])
                next_index += 1
            if not sched.has_unfinished() and self._in_flight is None:
                if next_index < len(pending):
                    # Idle until the next arrival, as the engine would be.
                    then = max(self.now, pending[next_index].arrival)
                    sched.observe_idle(then - self.now)
                    self.now = then
                continue
            steps += 1
            if steps > self._max_steps:
                raise RuntimeError(f"simulation did not finish in {self._max_steps} steps")
            next_arrival = pending[next_index].arrival if next_index < len(pending) else None
            self._step(next_arrival)
        outcomes = [self._outcomes[r.req_id] for r in requests]
        return SimResult(
            outcomes=outcomes,
            makespan_s=self.now,
            busy_s=self._busy_s,
            num_steps=steps,
            num_swap_preemptions=sched.num_swap_preemptions,
            num_recompute_preemptions=sched.num_recompute_preemptions,
            num_swapped_out_blocks=self._swapped_out,
        )

    def _submit(self, spec: SimRequest) -> None:
        req = Request(
            req_id=spec.req_id,
            prompt_token_ids=[_TOKEN] * spec.prompt_len,
            max_new_tokens=spec.output_len,
            ignore_eos=True,
            priority=spec.priority,
            arrival_time=spec.arrival,
            deadline=spec.deadline,
            first_token_deadline=spec.first_token_deadline,
            expected_output_tokens=spec.expected_output_tokens,
        )
        track = _Track(spec, req)
        try:
            self.scheduler.add_request(req, self.now)
        except SchedulerError as exc:
            track.finish_time = self.now
            self._close(track, FinishReason.REJECTED, type(exc).__name__)
            return
        self._tracks[spec.req_id] = track

    def _step(self, next_arrival: float | None) -> None:
        in_flight = self._in_flight
        plan = self.scheduler.schedule(self.now, ahead=in_flight is not None)
        for finished in plan.finished:
            cause = finished.reject_cause
            rejection = "" if cause is None else REJECT_CAUSE_NAMES[cause]
            self._finish(finished.req_id, finished.reason, rejection)
        if in_flight is not None:  # planning ahead: the step before ends, this one starts
            self._in_flight = None
            self._finish_step(*in_flight)
        if plan.is_empty:
            if in_flight is None:
                # Nothing runnable right now: idle until the next arrival (or a
                # tick, so deadlines of the queued work still come due).
                tick = self.cost_model.idle_seconds()
                self.now = self.now + tick if next_arrival is None else max(self.now, next_arrival)
            return
        truth = self._step_seconds
        seconds = self.cost_model.plan_seconds(plan) if truth is None else truth(plan)
        self._charge(plan, seconds)
        self._busy_s += seconds
        self._swapped_out += len(plan.swap_out)
        if self._plan_ahead:
            self._in_flight = (plan, seconds)
        else:
            self._finish_step(plan, seconds)

    def _finish_step(self, plan: StepPlan, seconds: float) -> None:
        """``plan``'s step ends ``seconds`` from now: its results applied."""
        self.now += seconds
        sampled = {seq.req_id: _TOKEN for seq in plan.seqs if seq.sample}
        measured = None if self._step_seconds is None else seconds
        self._record(self.scheduler.update(plan, sampled, self.now, step_s=measured))

    def _charge(self, plan: StepPlan, seconds: float) -> None:
        num_tokens = plan.num_tokens
        for seq in plan.seqs:
            track = self._tracks.get(seq.req_id)
            if track is not None and num_tokens:
                track.compute_s += seconds * len(seq.token_ids) / num_tokens

    def _record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                self._finish(out.req_id, out.finish_reason)

    def _finish(self, req_id: str, reason: FinishReason, rejection: str = "") -> None:
        track = self._tracks.pop(req_id)
        track.finish_time = self.now
        self._close(track, reason, rejection)

    def _close(self, track: _Track, reason: FinishReason, rejection: str) -> None:
        spec, req = track.spec, track.req
        if spec.req_id in self._outcomes:
            raise RuntimeError(f"request {spec.req_id!r} finished twice")
        assert track.finish_time is not None
        self._outcomes[spec.req_id] = SimOutcome(
            req_id=spec.req_id,
            priority=spec.priority,
            arrival=spec.arrival,
            deadline=spec.deadline,
            finish_reason=reason,
            rejection=rejection,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=track.finish_time,
            num_output_tokens=req.num_output_tokens,
            compute_s=track.compute_s,
            num_preemptions=req.num_preemptions,
            first_token_deadline=spec.first_token_deadline,
            num_held_back=req.num_held_back,
        )


def simulate(
    requests: Sequence[SimRequest],
    config: SchedulerConfig,
    cost_model: CostModel,
    policy: SchedulingPolicy | None = None,
    step_seconds: Callable[[StepPlan], float] | None = None,
    plan_ahead: bool = False,
) -> SimResult:
    """One run of ``requests`` (ids unique) under ``config.policy`` (or
    ``policy``); ``step_seconds`` and ``plan_ahead`` as for ``Simulator``."""
    simulator = Simulator(config, cost_model, policy, step_seconds=step_seconds,
                          plan_ahead=plan_ahead)  # fmt: skip
    return simulator.run(requests)


@dataclass(frozen=True, slots=True)
class CarriedState:
    """What a deadline policy has learned from past requests (overload
    window, class-0 arrival reserve, loaded step time); resumed as copies,
    so one snapshot can start several twins."""

    shedder: OverloadShedder | None
    reserve: ArrivalReserve
    loaded_step_s: float


def carried_state(policy: SchedulingPolicy, shift_s: float) -> CarriedState | None:
    """What ``policy`` has learned, on a clock ``shift_s`` ahead, for
    ``resume_policy`` of another policy of the same kind; None when it
    learns nothing."""
    if not isinstance(policy, DeadlinePolicy):
        return None
    shedder = policy.overload_shedder
    return CarriedState(
        None if shedder is None else shedder.shifted(shift_s),
        policy.arrival_reserve.shifted(shift_s),
        policy.loaded_step_s,
    )


def resume_policy(policy: SchedulingPolicy, state: object | None) -> None:
    """Starts ``policy`` from ``carried_state`` of a policy of the same kind
    (TypeError for anything else); nothing for a policy that learns nothing."""
    if not isinstance(policy, DeadlinePolicy):
        return
    if not isinstance(state, CarriedState):
        raise TypeError(f"cannot resume a deadline policy from {type(state).__name__}")
    if policy.overload_shedder is not None and state.shedder is not None:
        policy.overload_shedder = state.shedder.shifted(0.0)
    policy.arrival_reserve = state.reserve.shifted(0.0)
    policy.loaded_step_s = state.loaded_step_s

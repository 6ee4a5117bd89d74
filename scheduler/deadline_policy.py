"""The ``deadline`` policy: priority classes, deadline slack within a class,
preemption of less urgent running work only when urgent work would
otherwise miss, early abandonment of work that can no longer make its
deadline, swap vs recompute by cost.

How long each request still needs (alone and under load) and its urgency
key, ``(is_hopeless, effective_class, latest start, arrival_index)``, are
``deadline_estimates.py``'s.

Overload (``overload_refusal``): past capacity, arrivals of classes above 0
are refused at the door, the least urgent class first and the heaviest
within it (``overload.py``), so the work that must go is given up by weight,
before it runs, not by urgency after.

Preemption for admission (``admission_victim``): a waiting request pushes
out a running one only when (1) the victim is in a strictly less urgent
*base* class, or hopeless; (2) the victim has run ``min_residency_s`` since
it was last admitted or resumed; and (3) the candidate cannot afford to wait
for the next running request to finish — its loaded slack is below that
finish time plus a margin of ``_MARGIN_STEPS`` steps. (3) is what stops
churn: background work is pushed out only at the last responsible moment,
not by every urgent arrival. Victims: hopeless first, then the least urgent
base class, then the least computed progress (the least sunk work), then
the most slack.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from typing import ClassVar

from .batch_shaping import (
    CEILING_MARGIN_STEPS,
    IN_FLIGHT_MARGIN_STEPS,
    ArrivalReserve,
    BatchShaper,
)
from .config import SchedulerConfig
from .cost_model import CostModel, StepShape, idle_keep
from .deadline_estimates import DeadlineEstimates, output_target
from .overload import OverloadShedder
from .plan import StepPlan
from .policy_base import Infeasible, PreemptionMode, SchedulingPolicy, least_urgent_class_victim
from .request import ExpiredLimit, FinishReason, Request

# Steps of headroom an urgent waiting request keeps before it preempts.
_MARGIN_STEPS = 3.0
# Weight of the newest plan in the loaded step-time average.
_STEP_EWMA = 0.05


class DeadlinePolicy(DeadlineEstimates, SchedulingPolicy):
    """Slack-ordered priority classes; preempts for urgent work only when it
    must; abandons hopeless work; swap or recompute, whichever is cheaper."""

    name: ClassVar[str] = "deadline"

    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None) -> None:
        super().__init__(config, cost_model)
        self._min_residency_s = config.min_residency_s
        self.arrival_reserve = ArrivalReserve()  # keeps steps short for class-0 arrivals
        self._batch = config.max_num_seqs
        self._shedder = OverloadShedder() if config.shed_under_overload else None
        # (req_id, weight, shed class) of the arrival ``overload_refusal`` let
        # in, recorded by ``observe_arrival`` once the scheduler queued it.
        self._pending_arrival: tuple[str, float, int | None] | None = None
        self._swept_epoch = -1  # the epoch of the latest ``abandon_reasons``
        self._margin_steps = CEILING_MARGIN_STEPS  # see observe_in_flight

    # -- what the steps teach -------------------------------------------

    def observe_plan(self, plan: StepPlan, saturated: bool = False) -> None:
        shedder = self._shedder
        if not plan.seqs:
            return
        cost = self.cost_model
        shape = StepShape.of(plan)
        seconds = cost.step_seconds(shape)  # plan_seconds(plan): the plan has sequences
        self.loaded_step_s += _STEP_EWMA * (seconds - self.loaded_step_s)
        if shedder is None or not saturated:
            return
        # Steps the batch shaper kept short for urgent work count too: what
        # the engine gets through under this workload is its service rate.
        work = cost.batched_step_seconds(shape, self._batch)
        shedder.observe_step(work, seconds * cost.pace)

    def observe_in_flight(self, steps: int) -> None:
        """A step still in flight (planning ahead) delays every request's
        next step by one: the step ceilings keep ``IN_FLIGHT_MARGIN_STEPS``
        more spare steps for it."""
        self._margin_steps = CEILING_MARGIN_STEPS + IN_FLIGHT_MARGIN_STEPS * steps

    def observe_room(self, has_room: bool) -> None:
        shedder = self._shedder
        if shedder is None:
            return
        if has_room:
            shedder.observe_room()
        else:
            shedder.observe_saturated()

    def observe_idle(self, idle_s: float) -> None:
        """Idle time relaxes the cost model toward its start-up coefficients
        and the loaded step toward a lone decode: a model that predicted every
        arrival infeasible would otherwise never run a step to learn better.
        An idle engine has room: nothing is refused as overloaded."""
        cost = self.cost_model
        cost.relax(idle_s)
        if self._shedder is not None:
            self._shedder.observe_idle()
        c = cost.coefficients
        lone = c.base_s + c.per_decode_seq_s
        self.loaded_step_s = lone + (self.loaded_step_s - lone) * idle_keep(idle_s)

    def forget(self, req_id: str) -> None:
        self._entries.pop(req_id, None)

    # -- the policy seam -------------------------------------------------

    def urgency_key(self, req: Request, now: float) -> tuple[float, ...]:
        return self._urgency_of(req, now).key

    def order_waiting(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: self._urgency_of(r, now).key)

    def order_swapped(self, swapped: Iterable[Request], now: float) -> list[Request]:
        return sorted(swapped, key=lambda r: self._urgency_of(r, now).key)

    def order_running(self, running: Iterable[Request], now: float) -> list[Request]:
        return sorted(running, key=lambda r: self._urgency_of(r, now).key)

    def victim_key(self, req: Request, now: float) -> tuple[float, ...]:
        """Larger is a better victim: hopeless first, then the least urgent
        *base* class (aging never protects), then the least computed work,
        then the most slack."""
        parts = self._urgency_of(req, now)
        return (
            float(parts.is_hopeless),
            float(req.priority),
            -float(req.num_computed_tokens),
            parts.latest_start,
            float(req.arrival_index),
        )

    def choose_victim(
        self, candidates: Sequence[Request], requester: Request, now: float
    ) -> Request | None:
        return max(candidates, key=lambda r: self.victim_key(r, now), default=None)

    def admission_victim(
        self, candidate: Request, running: Sequence[Request], now: float, num_ahead: int = 0
    ) -> Request | None:
        """For a candidate that is not hopeless: the ``victim_key`` maximum
        of the unprotected running requests when it is hopeless, or when it
        is in a less urgent base class than the candidate and the candidate
        cannot wait. The maximum is only looked for once it can matter: it is
        hopeless if any one is, and otherwise in the least urgent base class
        present."""
        urgency_of = self._urgency_of
        if urgency_of(candidate, now).is_hopeless:
            return None
        swept = self._has_swept(now)
        # Asked per waiting candidate with the batch full: when no running
        # request at all is in a less urgent class, no unprotected one is.
        if swept and max((r.priority for r in running), default=-1) <= candidate.priority:
            return None
        eligible = [r for r in running if not self._is_protected(r, now)]
        if not swept:
            hopeless = [r for r in eligible if urgency_of(r, now).is_hopeless]
            if hopeless:
                return max(hopeless, key=lambda r: self.victim_key(r, now))
        least_urgent = max((r.priority for r in eligible), default=None)
        if least_urgent is None or least_urgent <= candidate.priority:
            return None
        if self._can_wait(candidate, running, now, num_ahead):
            return None
        return max(eligible, key=lambda r: self.victim_key(r, now))

    def _can_wait(
        self, candidate: Request, running: Sequence[Request], now: float, num_ahead: int = 0
    ) -> bool:
        """True when the candidate's slack outlasts the finish that frees its
        slot (plus a margin): the ``num_ahead + 1``-th among ``running``, the
        earlier ones going to the waiting work ahead of it."""
        if candidate.deadline is None:
            return True
        finishes = heapq.nsmallest(
            num_ahead + 1, (self.loaded_remaining_seconds(r) for r in running)
        )
        if len(finishes) <= num_ahead:
            return False  # more waiting ahead than running work to finish
        next_free = finishes[-1]
        return self.slack(candidate, now) > next_free + _MARGIN_STEPS * self.loaded_step_s

    def _is_protected(self, req: Request, now: float) -> bool:
        since = req.last_resumed_time
        return since is not None and now - since < self._min_residency_s

    def preemption_mode(self, victim: Request, can_swap: bool, now: float) -> PreemptionMode:
        if not can_swap or victim.num_computed_tokens == 0 or self.is_hopeless(victim, now):
            return PreemptionMode.RECOMPUTE  # a predicted miss is not worth host blocks
        cost = self.cost_model
        swap = cost.swap_seconds(2 * len(victim.block_ids))
        recompute = cost.prefill_seconds(victim.num_computed_tokens, self._budget)
        return PreemptionMode.SWAP if swap <= recompute else PreemptionMode.RECOMPUTE

    def check_admission(self, req: Request, now: float) -> Infeasible | None:
        """Which time limit ``req`` misses even alone from ``now`` (None if none)."""
        first_token_deadline = req.first_token_deadline
        if first_token_deadline is not None and req.first_token_time is None:
            needed = self._estimate(req).first_token_isolated_s
            if now + needed > first_token_deadline:
                return Infeasible(
                    ExpiredLimit.FIRST_TOKEN,
                    _missed(
                        "first-token deadline",
                        first_token_deadline - now,
                        f"the prompt alone needs an estimated {duration(needed)}",
                    ),
                )
        if req.deadline is None:
            return None
        remaining = self.remaining_seconds(req)
        if now + remaining <= req.deadline:
            return None
        return Infeasible(
            ExpiredLimit.DEADLINE,
            _missed(
                "deadline",
                req.deadline - now,
                f"running alone it needs an estimated {duration(remaining)}",
            ),
        )

    def overload_refusal(self, req: Request, now: float) -> str:
        """While the engine is full, an arrival of a class above 0 with a
        deadline, ranked past the overload threshold (``overload.py``), is
        refused. "" when it may come in; it counts toward the offered load
        once queued (``observe_arrival``)."""
        shedder = self._shedder
        if shedder is None:
            return ""
        weight = self.cost_model.batched_seconds(
            len(req.prompt_token_ids), output_target(req, 0), self._batch
        )
        shed_class = req.priority if req.priority > 0 and req.deadline is not None else None
        if not shedder.refuses(weight, shed_class):
            self._pending_arrival = (req.req_id, weight, shed_class)
            return ""
        shedder.record(now, weight, shed_class, is_refused=True)
        threshold_class, threshold_weight = shedder.threshold
        heavier = (
            f"heavier than {threshold_weight:.3f}s of batched compute"
            if req.priority == threshold_class
            else "of every weight"
        )
        return (
            f"overloaded ({shedder.load():.2f}x what the engine serves, with its batch full "
            f"and work waiting): class {req.priority} requests {heavier} are turned away "
            f"(this one: {weight:.3f}s)"
        )

    @property
    def overload_shedder(self) -> OverloadShedder | None:
        """The overload estimate and threshold (None with shedding off)."""
        return self._shedder

    @overload_shedder.setter
    def overload_shedder(self, shedder: OverloadShedder | None) -> None:
        self._shedder = shedder

    def overload_estimate(self, now: float | None = None) -> float | None:
        shedder = self._shedder
        return None if shedder is None else shedder.load(now)

    def observe_finish(self, req: Request, reason: FinishReason) -> None:
        """Work ``req`` did not use no longer counts as offered (see
        ``OverloadShedder.observe_departure``)."""
        shedder = self._shedder
        if shedder is None:
            return
        weight = self.cost_model.batched_seconds(
            len(req.prompt_token_ids), output_target(req, 0), self._batch
        )
        served = 0.0
        prompt_done = min(req.num_computed_tokens, len(req.prompt_token_ids))
        if prompt_done > 0:
            outputs = max(1, len(req.output_token_ids))
            served = self.cost_model.batched_seconds(prompt_done, outputs, self._batch)
        is_load_driven = reason in (FinishReason.DEADLINE_EXCEEDED, FinishReason.REJECTED)
        shedder.observe_departure(req.req_id, weight - served, is_load_driven)

    def expired_limit(self, req: Request, now: float) -> ExpiredLimit:
        return self._urgency_of(req, now).hopeless_limit

    def abandon_reason(self, req: Request, now: float) -> str:
        if not self._urgency_of(req, now).is_hopeless:
            return ""
        return self._abandon_message(req, now)

    def abandon_reasons(self, live: Iterable[Request], now: float) -> list[tuple[Request, str]]:
        """The scheduler ends every request returned: until the epoch moves
        on, no running request is hopeless (``_has_swept``)."""
        urgency_of = self._urgency_of
        reasons = [
            (req, self._abandon_message(req, now))
            for req in live
            if (req.deadline is not None or req.first_token_deadline is not None)
            and urgency_of(req, now).is_hopeless
        ]
        self._swept_epoch = self._epoch_at(now)
        return reasons

    def _has_swept(self, now: float) -> bool:
        """Whether ``abandon_reasons`` ran at this epoch: then every running
        request is known not hopeless (a running request's urgency changes
        only with its progress, and planning makes none), and nothing needs
        asking each one again."""
        return self._swept_epoch == self._epoch_at(now)

    def _abandon_message(self, req: Request, now: float) -> str:
        entry = self._urgency_of(req, now)
        if entry.hopeless_limit is ExpiredLimit.FIRST_TOKEN:
            assert req.first_token_deadline is not None
            left = req.first_token_deadline - now
            needed = max(entry.first_token_isolated_s, entry.first_token_steps * self.loaded_step_s)
            return (
                f"cannot meet first-token deadline: {duration(left)} left, an estimated "
                f"{duration(needed)} needed at the current load"
            )
        assert req.deadline is not None
        return (
            f"cannot meet deadline: {duration(req.deadline - now)} left, an estimated "
            f"{duration(self.loaded_remaining_seconds(req))} needed at the current load"
        )

    def shed_victim(
        self, newcomer: Request, waiting: Iterable[Request], now: float
    ) -> Request | None:
        return least_urgent_class_victim(newcomer, waiting)

    # -- batch shaping ---------------------------------------------------

    def batch_shaper(self, now: float) -> BatchShaper:
        return BatchShaper(
            self.cost_model,
            now,
            self.step_ceiling,
            self.arrival_reserve.ceiling_s(now),
            self.steps_to_limit,
        )

    def observe_arrival(self, req: Request, now: float) -> None:
        pending = self._pending_arrival
        if pending is not None and self._shedder is not None and pending[0] == req.req_id:
            self._shedder.record(now, pending[1], pending[2], req.req_id)
        self._pending_arrival = None
        if req.priority == 0:
            self.arrival_reserve.observe(now, self.step_ceiling(req, now))

    def step_ceiling(self, req: Request, now: float) -> float:
        """The longest step ``req`` can afford, as the cost model predicts
        steps: the time to its nearest limit over the steps it still needs
        (plus a margin, wider while a step is in flight), shrunk by the
        model's measured overrun (a step predicted at the ceiling tends to
        run that much longer); +inf without limits."""
        if req.deadline is None and req.first_token_deadline is None:
            return math.inf
        entry = self._estimate(req)
        margin = self._margin_steps
        ceiling = math.inf
        if req.deadline is not None:
            ceiling = (req.deadline - now) / (entry.num_steps + margin)
        if req.first_token_deadline is not None and entry.first_token_steps:
            steps = entry.first_token_steps + margin
            ceiling = min(ceiling, (req.first_token_deadline - now) / steps)
        return ceiling / (1.0 + self.cost_model.overrun)

    def steps_to_limit(self, req: Request) -> float:
        """The steps ``step_ceiling`` divides ``req``'s time by (its deadline's)."""
        return self._estimate(req).num_steps + self._margin_steps

    @property
    def is_urgency_driven(self) -> bool:
        return True


def _missed(limit: str, left_s: float, needs: str) -> str:
    """Why ``limit``, ``left_s`` from now, cannot be met: what meeting it
    ``needs``, or that it has passed already (a clock mismatch or a stale
    absolute deadline, which no estimate explains)."""
    if left_s < 0:
        return f"{limit} passed {duration(-left_s)} ago"
    return f"{limit} in {duration(left_s)}, but {needs}"


def duration(seconds: float) -> str:
    """A time for a caller to read, three significant digits: "1.28 ms",
    "45 ms", "12.3 s" (a deadline of 1 ms against an estimate of 1.3 ms read
    "0.001s" and "0.001s" at three decimals)."""
    if abs(seconds) < 0.9995:
        return f"{seconds * 1e3:.3g} ms"
    if abs(seconds) < 999.5:
        return f"{seconds:.3g} s"
    return f"{seconds:.0f} s"

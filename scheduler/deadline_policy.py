"""The ``deadline`` policy: priority classes, deadline slack within a class,
preemption of less urgent running work only when urgent work would
otherwise miss, early abandonment of work that can no longer make its
deadline, swap vs recompute by cost.

Estimates. For each request the policy caches, per progress (computed
tokens, outputs, status), the *isolated* remaining time (the cost model's
service time if it ran alone: rest of the prefill, in budget-sized chunks,
then the decodes to ``expected_output_tokens`` or ``max_new_tokens``, plus
a swap-in when swapped) and the number of steps that takes. Under load a
step is slower than an isolated one, so the *loaded* remaining time is
``max(isolated, steps * loaded_step_s)`` where ``loaded_step_s`` is an
exponential average of the predicted seconds of the plans actually made
(``observe_plan``). Caching the components keeps every estimate O(1);
only the multiplication by the current step time is redone, once per
``(now, loaded_step_s)`` and request.

Urgency (smaller sorts first)::

    (is_hopeless, effective_class, deadline - loaded_remaining, arrival_index)

- ``is_hopeless``: ``now + loaded_remaining > deadline``. The scheduler
  abandons such work (DEADLINE_EXCEEDED, "cannot meet deadline") when
  ``SchedulerConfig.abandon_hopeless``; compute spent on it is wasted and
  only makes others miss too.
- ``effective_class``: ``priority`` lowered by one per ``aging_s`` seconds
  since arrival, down to 0: the least urgent class competes on slack with
  class 0 after ``2 * aging_s`` — its wait is bounded by that (or by its own
  deadline, when abandoned). Promotion changes order only, never the right
  to preempt.

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

from .batch_shaping import CEILING_MARGIN_STEPS, ArrivalReserve, BatchShaper
from .config import SchedulerConfig
from .cost_model import CostModel, StepShape, idle_keep
from .overload import OverloadShedder
from .plan import StepPlan
from .policy_base import Infeasible, PreemptionMode, SchedulingPolicy, least_urgent_class_victim
from .request import ExpiredLimit, FinishReason, Request, RequestStatus

# Steps of headroom an urgent waiting request keeps before it preempts.
_MARGIN_STEPS = 3.0
# A request is hopeless when even this fraction of its loaded remaining time
# overruns its deadline: the loaded estimate is an average, and a wrong
# "hopeless" costs a request that might have made it.
HOPELESS_LOAD_FRACTION = 1.0
# Weight of the newest plan in the loaded step-time average.
_STEP_EWMA = 0.05


# The request fields an urgency depends on: (computed tokens, outputs,
# status, deadline, first-token deadline, priority, arrival time, arrival
# index). The first three are the progress an estimate depends on.
_Signature = tuple[int, int, RequestStatus, float | None, float | None, int, float, int]
_Progress = tuple[int, int, RequestStatus]


def _output_target(req: Request, outputs: int) -> int:
    """The outputs ``req`` is expected to end with, having ``outputs``:
    its expected count (else ``max_new_tokens``), at least one more than it
    has, at most ``max_new_tokens``."""
    target = req.expected_output_tokens or req.max_new_tokens
    return min(max(target, outputs + 1), req.max_new_tokens)


class _Entry:
    """What the policy knows about one live request: a record updated in
    place, not rebuilt, every time the request is ranked in a new step.

    The estimate (``isolated_s``, ``num_steps``) is valid while ``progress``
    is the request's; the urgency (``is_hopeless``, ``latest_start``,
    ``key``) while, in addition, ``epoch`` is the policy's current one (one
    ``(now, loaded_step_s)``) and ``signature`` is the request's.
    """

    __slots__ = (
        "epoch",
        "first_token_isolated_s",
        "first_token_steps",
        "hopeless_limit",
        "is_hopeless",
        "isolated_s",
        "key",
        "latest_start",
        "num_steps",
        "progress",
        "signature",
    )

    def __init__(self) -> None:
        self.progress: _Progress | None = None
        self.isolated_s = 0.0
        self.num_steps = 0
        # Until the first output: the same for the first token (else 0).
        self.first_token_isolated_s = 0.0
        self.first_token_steps = 0
        self.epoch = -1
        self.signature: _Signature | None = None
        self.is_hopeless = False
        self.hopeless_limit = ExpiredLimit.DEADLINE
        self.latest_start = math.inf
        self.key: tuple[float, ...] = ()


class DeadlinePolicy(SchedulingPolicy):
    """Slack-ordered priority classes; preempts for urgent work only when it
    must; abandons hopeless work; swap or recompute, whichever is cheaper."""

    name: ClassVar[str] = "deadline"

    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None) -> None:
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self._budget = config.max_num_batched_tokens
        self._aging_s = config.aging_s
        self._min_residency_s = config.min_residency_s
        self._entries: dict[str, _Entry] = {}
        self.arrival_reserve = ArrivalReserve()  # keeps steps short for class-0 arrivals
        self._batch = config.max_num_seqs
        self._shedder = OverloadShedder() if config.shed_under_overload else None
        # (req_id, weight, shed class) of the arrival ``overload_refusal`` let
        # in, recorded by ``observe_arrival`` once the scheduler queued it.
        self._pending_arrival: tuple[str, float, int | None] | None = None
        # Every queue is ranked several times per step at one (now, loaded
        # step time), an epoch: urgencies are computed once per epoch.
        self._epoch = 0
        self._epoch_now = math.nan  # NaN equals nothing: the first call starts epoch 1
        self._epoch_step_s = math.nan
        c = self.cost_model.coefficients
        self.loaded_step_s = c.base_s + c.per_decode_seq_s  # one isolated decode step

    # -- estimates -------------------------------------------------------

    def observe_plan(self, plan: StepPlan, saturated: bool = False) -> None:
        shedder = self._shedder
        if not plan.seqs:
            return
        cost = self.cost_model
        seconds = cost.plan_seconds(plan)
        self.loaded_step_s += _STEP_EWMA * (seconds - self.loaded_step_s)
        if shedder is None or not saturated:
            return
        # Steps the batch shaper kept short for urgent work count too: what
        # the engine gets through under this workload is its service rate.
        work = cost.batched_step_seconds(StepShape.of(plan), self._batch)
        shedder.observe_step(work, seconds * cost.pace)

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

    def remaining_seconds(self, req: Request) -> float:
        """Isolated remaining service time (swap-in included when swapped)."""
        return self._estimate(req).isolated_s

    def loaded_remaining_seconds(self, req: Request) -> float:
        """Remaining time at the current loaded step time (never below isolated)."""
        est = self._estimate(req)
        return max(est.isolated_s, est.num_steps * self.loaded_step_s)

    def _estimate(self, req: Request) -> _Entry:
        """``req``'s entry with its estimate up to date."""
        progress = (req.num_known_kv_tokens, len(req.output_token_ids), req.status)
        entry = self._entry(req.req_id)
        if entry.progress != progress:
            self._new_estimate(entry, req, progress)
        return entry

    def _entry(self, req_id: str) -> _Entry:
        entry = self._entries.get(req_id)
        if entry is None:
            entry = self._entries[req_id] = _Entry()
        return entry

    def _new_estimate(self, entry: _Entry, req: Request, progress: _Progress) -> None:
        computed, outputs, status = progress
        outputs_left = max(1, _output_target(req, outputs) - outputs)
        num_tokens = len(req.prompt_token_ids) + outputs
        cost = self.cost_model
        prefill = cost.prefill_seconds(num_tokens - computed, self._budget, computed)
        isolated = prefill + cost.decode_seconds(num_tokens, max(0, outputs_left - 1))
        if status is RequestStatus.SWAPPED:
            swap = cost.swap_seconds(len(req.host_block_ids))
            isolated += swap
            prefill += swap
        chunks = -(-(num_tokens - computed) // self._budget)
        entry.progress = progress
        entry.isolated_s = isolated
        entry.num_steps = chunks + outputs_left - 1
        entry.first_token_isolated_s = prefill if outputs == 0 else 0.0
        entry.first_token_steps = max(1, chunks) if outputs == 0 else 0

    def slack(self, req: Request, now: float) -> float:
        return self._latest_start(req) - now

    def _latest_start(self, req: Request) -> float:
        """The last moment it could start under the current load and still
        meet its deadline (``deadline - loaded remaining``) and, before its
        first token, its first-token deadline; +inf without either."""
        latest = math.inf
        if req.deadline is not None:
            latest = req.deadline - self.loaded_remaining_seconds(req)
        est = self._estimate(req)
        if req.first_token_deadline is not None and est.first_token_steps:
            loaded = max(est.first_token_isolated_s, est.first_token_steps * self.loaded_step_s)
            latest = min(latest, req.first_token_deadline - loaded)
        return latest

    def forget(self, req_id: str) -> None:
        self._entries.pop(req_id, None)

    def _urgency_of(self, req: Request, now: float) -> _Entry:
        """``req``'s entry with its urgency at ``now``: exactly what
        ``is_hopeless``, ``effective_class`` and ``slack`` compute,
        memoized per epoch."""
        if now != self._epoch_now or self.loaded_step_s != self._epoch_step_s:
            self._epoch += 1
            self._epoch_now, self._epoch_step_s = now, self.loaded_step_s
        signature = (
            req.num_known_kv_tokens,
            len(req.output_token_ids),
            req.status,
            req.deadline,
            req.first_token_deadline,
            req.priority,
            req.arrival_time,
            req.arrival_index,
        )
        entry = self._entry(req.req_id)
        if entry.epoch == self._epoch and entry.signature == signature:
            return entry
        self._new_urgency(entry, req, now, signature)
        return entry

    def _new_urgency(self, entry: _Entry, req: Request, now: float, signature: _Signature) -> None:
        computed, outputs, status, deadline, first_token_deadline, _, _, arrival_index = signature
        if entry.progress != (computed, outputs, status):
            self._new_estimate(entry, req, (computed, outputs, status))
        effective = self.effective_class(req, now)
        hopeless, latest, limit = False, math.inf, ExpiredLimit.DEADLINE
        # Loaded time counts against waiting / swapped work of a class above 0
        # only: see ``is_hopeless``.
        judge_loaded = effective > 0 and status is not RequestStatus.RUNNING
        step_s = self.loaded_step_s
        if deadline is not None:
            isolated, loaded = entry.isolated_s, entry.num_steps * step_s
            latest = deadline - (loaded if loaded > isolated else isolated)  # max()
            needed = isolated
            if judge_loaded:
                needed = max(needed, HOPELESS_LOAD_FRACTION * entry.num_steps * step_s)
            hopeless = now + needed > deadline
        if first_token_deadline is not None and entry.first_token_steps:
            isolated, loaded = entry.first_token_isolated_s, entry.first_token_steps * step_s
            latest = min(latest, first_token_deadline - (loaded if loaded > isolated else isolated))
            needed = isolated
            if judge_loaded:
                needed = max(needed, HOPELESS_LOAD_FRACTION * loaded)
            if not hopeless and now + needed > first_token_deadline:
                hopeless, limit = True, ExpiredLimit.FIRST_TOKEN
        entry.epoch = self._epoch
        entry.signature = signature
        entry.is_hopeless = hopeless
        entry.hopeless_limit = limit
        entry.latest_start = latest
        entry.key = (1.0 if hopeless else 0.0, float(effective), latest, float(arrival_index))

    def effective_class(self, req: Request, now: float) -> int:
        if self._aging_s <= 0 or req.priority <= 0:
            return req.priority
        promoted = int((now - req.arrival_time) // self._aging_s)
        return max(0, req.priority - promoted)

    def is_hopeless(self, req: Request, now: float) -> bool:
        """Waiting or swapped work: it would miss at the current load.
        Running work, and work of effective class 0: it would miss even
        alone — the loaded average is too noisy a reason to throw away work
        that is making progress, and class 0 preempts its way in and so
        fares better than the average request."""
        return self._urgency_of(req, now).is_hopeless

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
        eligible = [r for r in running if not self._is_protected(r, now)]
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
                    f"first-token deadline in {first_token_deadline - now:.3f}s, but the "
                    f"prompt alone needs an estimated {needed:.3f}s",
                )
        if req.deadline is None:
            return None
        remaining = self.remaining_seconds(req)
        if now + remaining <= req.deadline:
            return None
        return Infeasible(
            ExpiredLimit.DEADLINE,
            f"deadline in {req.deadline - now:.3f}s, but running alone it needs "
            f"an estimated {remaining:.3f}s",
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
            len(req.prompt_token_ids), _output_target(req, 0), self._batch
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

    def overload_estimate(self) -> float | None:
        shedder = self._shedder
        return None if shedder is None else shedder.load()

    def observe_finish(self, req: Request, reason: FinishReason) -> None:
        """Work ``req`` did not use no longer counts as offered (see
        ``OverloadShedder.observe_departure``)."""
        shedder = self._shedder
        if shedder is None:
            return
        weight = self.cost_model.batched_seconds(
            len(req.prompt_token_ids), _output_target(req, 0), self._batch
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
        urgency_of = self._urgency_of
        return [
            (req, self._abandon_message(req, now))
            for req in live
            if (req.deadline is not None or req.first_token_deadline is not None)
            and urgency_of(req, now).is_hopeless
        ]

    def _abandon_message(self, req: Request, now: float) -> str:
        entry = self._urgency_of(req, now)
        if entry.hopeless_limit is ExpiredLimit.FIRST_TOKEN:
            assert req.first_token_deadline is not None
            left = req.first_token_deadline - now
            needed = max(entry.first_token_isolated_s, entry.first_token_steps * self.loaded_step_s)
            return (
                f"cannot meet first-token deadline: {left:.3f}s left, an estimated "
                f"{needed:.3f}s needed at the current load"
            )
        assert req.deadline is not None
        return (
            f"cannot meet deadline: {req.deadline - now:.3f}s left, an estimated "
            f"{self.loaded_remaining_seconds(req):.3f}s needed at the current load"
        )

    def shed_victim(
        self, newcomer: Request, waiting: Iterable[Request], now: float
    ) -> Request | None:
        return least_urgent_class_victim(newcomer, waiting)

    # -- batch shaping ---------------------------------------------------

    def batch_shaper(self, now: float) -> BatchShaper:
        return BatchShaper(
            self.cost_model, now, self.step_ceiling, self.arrival_reserve.ceiling_s(now)
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
        (plus a margin), shrunk by the model's measured overrun (a step
        predicted at the ceiling tends to run that much longer); +inf
        without limits."""
        if req.deadline is None and req.first_token_deadline is None:
            return math.inf
        entry = self._estimate(req)
        ceiling = math.inf
        if req.deadline is not None:
            ceiling = (req.deadline - now) / (entry.num_steps + CEILING_MARGIN_STEPS)
        if req.first_token_deadline is not None and entry.first_token_steps:
            steps = entry.first_token_steps + CEILING_MARGIN_STEPS
            ceiling = min(ceiling, (req.first_token_deadline - now) / steps)
        return ceiling / (1.0 + self.cost_model.overrun)

    @property
    def is_urgency_driven(self) -> bool:
        return True

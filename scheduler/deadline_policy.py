"""The ``deadline`` policy: priority classes, deadline slack within a class,
preemption of less urgent running work to admit more urgent work, swap vs
recompute by cost.

Urgency (smaller sorts first)::

    (is_hopeless, effective_class, deadline - remaining, arrival_index)

- ``remaining`` is the cost model's estimate of the request's remaining time
  if it ran alone: finish its prefill (all of prompt + outputs after a
  recompute preemption), then decode ``expected_output_tokens`` (or
  ``max_new_tokens``) minus what it already produced. Slack is
  ``deadline - now - remaining``; ordering by ``deadline - remaining`` is the
  same order at every ``now``, and cacheable.
- ``is_hopeless``: slack < 0 — even running alone from now it would miss
  (the isolated estimate is a lower bound). Such work sorts last and is the
  first victim: spending compute on it only makes others miss too.
- ``effective_class``: ``priority`` lowered by one per ``aging_s`` seconds
  since arrival, down to 0 — so class 2 reaches class 0 after ``2 * aging_s``
  and then competes on slack; a waiting request's slack only shrinks, so it
  eventually leads (or, with a deadline, expires). That bounds its wait.
  Promotion changes order only, never the right to preempt.

Preemption for admission (``admission_victim``): a waiting request may push
out the least urgent running one only when that one is in a strictly less
urgent *base* class (or hopeless) and has run for at least
``min_residency_s`` since it was last admitted or resumed. The class gap and
the residency are the thrash guard: the pushed-out request cannot push back
(its class is not more urgent; promotion grants no preemption right) and
a resumed request is not immediately
pushed out again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from .config import SchedulerConfig
from .cost_model import CostModel
from .policy import PreemptionMode, SchedulingPolicy
from .request import Request, RequestStatus


class DeadlinePolicy(SchedulingPolicy):
    """Slack-ordered priority classes; preempts for urgent work; swap or
    recompute, whichever the cost model says is cheaper."""

    name: ClassVar[str] = "deadline"

    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None) -> None:
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self._budget = config.max_num_batched_tokens
        self._aging_s = config.aging_s
        self._min_residency_s = config.min_residency_s
        # req_id -> ((num_computed, num_outputs, status), remaining, deadline - remaining)
        self._refs: dict[str, tuple[tuple[int, int, int], float, float]] = {}

    # -- estimates -------------------------------------------------------

    def remaining_seconds(self, req: Request) -> float:
        """Isolated remaining service time (swap-in included when swapped)."""
        target = req.expected_output_tokens or req.max_new_tokens
        target = min(max(target, req.num_output_tokens + 1), req.max_new_tokens)
        outputs_left = max(1, target - req.num_output_tokens)
        cost = self.cost_model
        seconds = cost.service_seconds(
            req.num_computed_tokens, req.num_tokens, outputs_left, self._budget
        )
        if req.status is RequestStatus.SWAPPED:
            seconds += cost.swap_seconds(len(req.host_block_ids))
        return seconds

    def slack(self, req: Request, now: float) -> float:
        return self._latest_start(req) - now

    def _latest_start(self, req: Request) -> float:
        """``deadline - remaining``: the last moment it could start alone and
        still finish in time (+inf without a deadline)."""
        return self._estimate(req)[1]

    def _estimate(self, req: Request) -> tuple[float, float]:
        """(remaining, latest start), cached per progress of the request."""
        if req.deadline is None:
            return (0.0, math.inf)
        stamp = (req.num_computed_tokens, req.num_output_tokens, int(req.status))
        cached = self._refs.get(req.req_id)
        if cached is not None and cached[0] == stamp:
            return cached[1], cached[2]
        remaining = self.remaining_seconds(req)
        latest = req.deadline - remaining
        self._refs[req.req_id] = (stamp, remaining, latest)
        return remaining, latest

    def forget(self, req_id: str) -> None:
        self._refs.pop(req_id, None)

    def effective_class(self, req: Request, now: float) -> int:
        if self._aging_s <= 0 or req.priority <= 0:
            return req.priority
        promoted = int((now - req.arrival_time) // self._aging_s)
        return max(0, req.priority - promoted)

    def is_hopeless(self, req: Request, now: float) -> bool:
        return self._latest_start(req) < now

    # -- the policy seam -------------------------------------------------

    def urgency_key(self, req: Request, now: float) -> tuple[float, ...]:
        latest = self._latest_start(req)
        return (
            float(latest < now),
            float(self.effective_class(req, now)),
            latest,
            float(req.arrival_index),
        )

    def victim_key(self, req: Request, now: float) -> tuple[float, ...]:
        """Larger is a better victim: hopeless first, then the least urgent
        *base* class, then the most slack (aging never makes a victim)."""
        latest = self._latest_start(req)
        return (float(latest < now), float(req.priority), latest, float(req.arrival_index))

    def choose_victim(
        self, candidates: Sequence[Request], requester: Request, now: float
    ) -> Request | None:
        return max(candidates, key=lambda r: self.victim_key(r, now), default=None)

    def admission_victim(
        self, candidate: Request, running: Sequence[Request], now: float
    ) -> Request | None:
        if self.is_hopeless(candidate, now):
            return None
        eligible = [r for r in running if not self._is_protected(r, now)]
        victim = max(eligible, key=lambda r: self.victim_key(r, now), default=None)
        if victim is None:
            return None
        if self.is_hopeless(victim, now) or victim.priority > candidate.priority:
            return victim
        return None

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

    def check_admission(self, req: Request, now: float) -> str:
        """Why ``req`` is infeasible even alone from ``now`` ("" if feasible)."""
        if req.deadline is None:
            return ""
        remaining = self.remaining_seconds(req)
        if now + remaining <= req.deadline:
            return ""
        return (
            f"deadline in {req.deadline - now:.3f}s, but running alone it needs "
            f"an estimated {remaining:.3f}s"
        )

    @property
    def is_urgency_driven(self) -> bool:
        return True

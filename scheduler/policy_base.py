"""The policy seam: every scheduling *decision* the scheduler delegates.

The scheduler owns mechanics (budgets, blocks, queues, the plan); a policy
only answers questions about order and victims:

- ``order_waiting`` / ``order_swapped`` / ``order_running``: who goes first.
  The scheduler admits (or swaps in) in that order and stops at the first
  request that does not fit, so the head of the queue is never overtaken.
- ``choose_victim``: a running request needs a KV block and none is free —
  which of the candidates (running requests not yet scheduled this step,
  plus the requester itself) gives its blocks up, or ``None`` to let the
  requester wait instead.
- ``preemption_mode``: how that victim is preempted, recompute or swap.
- ``admission_victim``: before the step is planned, may a waiting request
  push a running one out even though no pool is exhausted? (FCFS and
  priority: never.)
- ``shed_victim``: the queue is full and a request arrives — which queued
  request (of a less urgent class) gives its place up, or ``None`` to refuse
  the newcomer (FCFS: always refuse).
- ``batch_shaper``: a ``BatchShaper`` that holds back less urgent tokens
  when the step would be too slow for urgent work, or ``None`` (no shaping).

Convention: "more urgent" sorts first; ``urgency_key`` is the one ordering a
policy usually needs to define.

Within one ``schedule()`` call the scheduler may reuse an answer for
unchanged inputs (e.g. one ``order_waiting`` for every walk of an unchanged
waiting queue): answers may depend on policy state that ``observe_plan``
updates between steps, not on the number or order of questions asked.

Policies by name (``SchedulerConfig.policy``):

- ``fcfs``: arrival order; preempt the latest arrival, by recompute.
- ``priority``: vLLM V1-style — (priority class, arrival); preempt only when
  KV runs out, the least urgent first, by recompute.
- ``deadline`` (``deadline_policy.py``): class, then slack ``deadline - now -
  estimated remaining time`` from a step-cost model; overrides
  ``admission_victim`` to let urgent work in, ``preemption_mode`` to pick swap
  vs recompute by cost, ``check_admission`` to reject infeasible
  deadlines early, and ``overload_refusal`` to turn the heaviest less urgent
  arrivals away past capacity.

The registry of policies by name lives in ``policy_registry.py``.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from .batch_shaping import BatchShaper
from .plan import StepPlan
from .request import ExpiredLimit, FinishReason, Request


class PreemptionMode(enum.Enum):
    """RECOMPUTE frees the victim's blocks and re-prefills prompt + outputs
    later; SWAP copies its blocks to the host pool and back when resumed."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(frozen=True, slots=True)
class Infeasible:
    """Why a request cannot meet one of its time limits: which, and a message."""

    limit: ExpiredLimit
    message: str


class SchedulingPolicy(abc.ABC):
    """Answers order and victim questions; never mutates requests or pools."""

    name: ClassVar[str]

    @abc.abstractmethod
    def urgency_key(self, req: Request, now: float) -> tuple[float, ...]:
        """Sort key: smaller is more urgent. Must be total (ties broken by
        ``arrival_index``) so that every decision is deterministic."""

    def order_waiting(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: self.urgency_key(r, now))

    def order_swapped(self, swapped: Iterable[Request], now: float) -> list[Request]:
        return sorted(swapped, key=lambda r: self.urgency_key(r, now))

    def order_running(self, running: Iterable[Request], now: float) -> list[Request]:
        """Token budget and blocks go to running requests in this order."""
        return sorted(running, key=lambda r: self.urgency_key(r, now))

    def choose_victim(
        self, candidates: Sequence[Request], requester: Request, now: float
    ) -> Request | None:
        """Default: the least urgent candidate (which may be the requester)."""
        return max(candidates, key=lambda r: self.urgency_key(r, now), default=None)

    def preemption_mode(self, victim: Request, can_swap: bool, now: float) -> PreemptionMode:
        """``can_swap`` says whether the host pool can take all the victim's
        blocks right now. Default: always recompute."""
        return PreemptionMode.RECOMPUTE

    def admission_victim(
        self, candidate: Request, running: Sequence[Request], now: float, num_ahead: int = 0
    ) -> Request | None:
        """A running request to preempt so ``candidate`` can be admitted, or
        ``None``. ``num_ahead`` more urgent waiting requests found no room
        this step and wait for running work to finish: they take the first
        ``num_ahead`` slots that free up. Default: waiting work never preempts
        running work."""
        return None

    @property
    def is_urgency_driven(self) -> bool:
        """True for policies that rank all queues by ``urgency_key`` (those
        that preempt for admission): waiting work they make room for reserves
        its share of the token budget ahead of less urgent running prefills,
        and swapped work resumes only ahead of less urgent waiting work."""
        return False

    def check_admission(self, req: Request, now: float) -> Infeasible | None:
        """Which time limit ``req`` cannot meet even alone from ``now``, or
        None — the scheduler then raises DeadlineInfeasible (if configured)."""
        return None

    def expired_limit(self, req: Request, now: float) -> ExpiredLimit:
        """The limit an abandoned ``req`` (see ``abandon_reason``) would miss."""
        return ExpiredLimit.DEADLINE

    def shed_victim(
        self, newcomer: Request, waiting: Iterable[Request], now: float
    ) -> Request | None:
        """The queue is full: a waiting request to reject (SHED) so that
        ``newcomer`` takes its place, or None to refuse the newcomer
        (QueueFull). Default: never shed."""
        return None

    def batch_shaper(self, now: float) -> BatchShaper | None:
        """This step's batch shaper, or None: no shaping (the default)."""
        return None

    def observe_arrival(self, req: Request, now: float) -> None:
        """``req`` joined the queue at ``now`` (after admission and shedding)."""
        return None

    def observe_in_flight(self, steps: int) -> None:
        """Said at the start of every ``schedule()``: how many steps planned
        before are still to finish ahead of the one being planned (1 while
        the engine plans ahead, else 0)."""
        return None

    def abandon_reason(self, req: Request, now: float) -> str:
        """Why live ``req`` can no longer meet its deadline, or "" — the
        scheduler then ends it DEADLINE_EXCEEDED (if configured) instead of
        spending compute on it. Default: never abandon early."""
        return ""

    def abandon_reasons(self, live: Iterable[Request], now: float) -> list[tuple[Request, str]]:
        """``(req, abandon_reason(req, now))`` for each request of ``live``
        that has a time limit and a non-empty reason, in ``live``'s order: what
        the scheduler asks once per step about all its live requests, before
        anything else, ending each request returned. An override may only be
        faster, never different."""
        if type(self).abandon_reason is SchedulingPolicy.abandon_reason:
            return []  # the default never abandons: no need to ask about each request
        return [
            (req, reason)
            for req in live
            if has_time_limit(req) and (reason := self.abandon_reason(req, now))
        ]

    def overload_refusal(self, req: Request, now: float) -> str:
        """Why ``req`` is turned away at arrival because the engine is
        overloaded (the scheduler raises Overloaded), or "" to let it in.
        Default: never."""
        return ""

    def overload_estimate(self, now: float | None = None) -> float | None:
        """The load ``overload_refusal`` decides on (offered work over what
        the engine serves; at most 1 while the engine has room), or None
        when the policy sheds nothing; given ``now``, the offered work per
        second counts the time since the last arrival too."""
        return None

    def observe_finish(self, req: Request, reason: FinishReason) -> None:
        """``req`` ended with ``reason`` (just before ``forget``): any way a
        request leaves, served or not."""
        return None

    def observe_plan(self, plan: StepPlan, saturated: bool = False) -> None:
        """The plan ``schedule()`` just made (e.g. to track the loaded step
        time); ``saturated`` when waiting work was left out for want of room."""
        return None

    def observe_room(self, has_room: bool) -> None:
        """After ``observe_plan``: whether the step left no waiting work
        out, neither for want of room nor held back by the batch shaper."""
        return None

    def observe_idle(self, idle_s: float) -> None:
        """The engine had no live request for ``idle_s`` seconds."""
        return None

    def forget(self, req_id: str) -> None:
        """``req_id`` finished: drop anything cached about it."""
        return None  # nothing cached by default


class FcfsPolicy(SchedulingPolicy):
    """First come, first served. The waiting queue keeps its own order: new
    requests at the back, recompute-preempted ones at the front."""

    name: ClassVar[str] = "fcfs"

    def urgency_key(self, req: Request, now: float) -> tuple[float, ...]:
        return (req.arrival_time, req.arrival_index)

    def order_waiting(self, waiting: Iterable[Request], now: float) -> list[Request]:
        return list(waiting)


class PriorityPolicy(SchedulingPolicy):
    """Priority class first (0 most urgent), then arrival. Preempts only when
    KV runs out; the least urgent running request is the victim. A full
    queue sheds its least urgent class for a more urgent newcomer."""

    name: ClassVar[str] = "priority"

    def urgency_key(self, req: Request, now: float) -> tuple[float, ...]:
        return (req.priority, req.arrival_time, req.arrival_index)

    def shed_victim(
        self, newcomer: Request, waiting: Iterable[Request], now: float
    ) -> Request | None:
        return least_urgent_class_victim(newcomer, waiting)


def has_time_limit(req: Request) -> bool:
    return req.deadline is not None or (
        req.first_token_deadline is not None and req.first_token_time is None
    )


def least_urgent_class_victim(newcomer: Request, waiting: Iterable[Request]) -> Request | None:
    """The waiting request of the least urgent class, if that class is less
    urgent than ``newcomer``'s; within it, one that never ran before one
    that was preempted (nothing it streamed is lost), then the latest
    arrival (it has waited least)."""
    victim = max(
        waiting,
        key=lambda r: (r.priority, r.first_scheduled_time is None, r.arrival_index),
        default=None,
    )
    if victim is None or victim.priority <= newcomer.priority:
        return None
    return victim

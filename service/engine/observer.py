"""What the engine tells telemetry, from the engine thread.

The engine holds at most one ``EngineObserver`` (``None`` costs nothing: no
call is made). ``on_step`` and ``on_finish`` run on the engine thread, inside
the step loop; ``on_submit`` runs on the submitting thread while it holds the
engine's lock. So an implementation must be cheap and must never block:
record plain values per step and defer SDK work (span events, exporting) to
another thread.

Call order for one request: ``on_submit`` once (caller's thread, after the
scheduler accepted it), then ``on_step`` for every step while it lives, then
``on_finish`` exactly once.
"""

from __future__ import annotations

from typing import Protocol

from slipstream.scheduler.plan import RequestOutput, StepPlan
from slipstream.scheduler.request import Request, RequestStatus
from slipstream.service.engine.events import FinishEvent, RequestSpec


class EngineObserver(Protocol):
    def on_submit(self, request: RequestSpec, state: Request) -> None:
        """``state`` is the scheduler's record: read it, never write it."""

    def on_step(
        self, plan: StepPlan, outputs: list[RequestOutput], started: float, ended: float
    ) -> None:
        """One step: ``started`` is when it was planned, ``ended`` when its
        tokens were sampled (``time.monotonic()`` seconds)."""

    def on_finish(self, event: FinishEvent) -> None: ...


class ObserverGroup:
    """Several observers behind one, called in order."""

    def __init__(self, observers: list[EngineObserver]) -> None:
        self._observers = tuple(observers)

    def on_submit(self, request: RequestSpec, state: Request) -> None:
        for observer in self._observers:
            observer.on_submit(request, state)

    def on_step(
        self, plan: StepPlan, outputs: list[RequestOutput], started: float, ended: float
    ) -> None:
        for observer in self._observers:
            observer.on_step(plan, outputs, started, ended)

    def on_finish(self, event: FinishEvent) -> None:
        for observer in self._observers:
            observer.on_finish(event)


def preemption_kind(state: Request) -> str:
    """``swap`` or ``recompute`` for a request preempted in the latest plan.
    Valid until its next step: nothing preempted runs in the step that
    preempted it, so the status still tells where its KV went."""
    return "swap" if state.status is RequestStatus.SWAPPED else "recompute"

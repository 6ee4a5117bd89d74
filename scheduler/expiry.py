"""Time limits at the start of a step: requests past their deadline (or
first-token deadline) expire, and, when configured, live work the policy
says can no longer make its limit is abandoned.
"""

from __future__ import annotations

import heapq

from .plan import FinishedRequest
from .request import ExpiredLimit, FinishReason, RejectCause, Request, RequestStatus
from .scheduler_state import SchedulerState, _StepState


class Expiry(SchedulerState):
    """Ends work that is past, or can no longer make, its time limit."""

    def _expire_deadlines(self, state: _StepState, now: float) -> None:
        due: dict[int, Request] = {}
        while self._deadlines and self._deadlines[0][0] <= now:
            _, index, req = heapq.heappop(self._deadlines)
            if self._requests.get(req.req_id) is req:
                due[index] = req
        for _, req in sorted(due.items()):
            expiry = _expiry(req, now)
            if expiry is not None:
                limit, message = expiry
                self._finish(req, FinishReason.DEADLINE_EXCEEDED, message)
                self._num_expired += 1
                state.finished.append(
                    FinishedRequest(
                        req.req_id, FinishReason.DEADLINE_EXCEEDED, message, expired_limit=limit
                    )
                )

    def _abandon_hopeless(self, state: _StepState, now: float) -> None:
        """Ends, in arrival order, live work the policy says can no longer
        make a time limit: its compute would be wasted, its queue slot is
        better given to work that can. Work still queued that never ran is
        rejected (DEADLINE_INFEASIBLE); work that ran expires early
        (DEADLINE_EXCEEDED). Work without a time limit is never asked about."""
        for req, reason in self.policy.abandon_reasons(self._requests.values(), now):
            limit = self.policy.expired_limit(req, now)
            never_ran = req.status is RequestStatus.WAITING and req.first_scheduled_time is None
            finish = FinishReason.REJECTED if never_ran else FinishReason.DEADLINE_EXCEEDED
            self._finish(req, finish, reason)
            self._num_abandoned += 1
            state.finished.append(
                FinishedRequest(
                    req.req_id,
                    finish,
                    reason,
                    expired_limit=limit,
                    reject_cause=RejectCause.DEADLINE_INFEASIBLE if never_ran else None,
                )
            )


def _expiry(req: Request, now: float) -> tuple[ExpiredLimit, str] | None:
    if req.deadline is not None and req.deadline <= now:
        return ExpiredLimit.DEADLINE, "deadline exceeded"
    if (
        req.first_token_deadline is not None
        and req.first_token_time is None
        and req.first_token_deadline <= now
    ):
        return ExpiredLimit.FIRST_TOKEN, "first-token deadline exceeded"
    return None

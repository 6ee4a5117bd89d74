"""The one table between Slipstream's domain outcomes and the wire.

Every domain error a submit can raise maps to a ``RejectReason`` (the request
alone finishes REJECTED) and to the gRPC status code the same condition has
when it concerns a whole call. Every ``FinishReason`` maps to the wire's
``FinishReason``. Nothing else in ``service/`` or ``clients/`` interprets
these values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from slipstream.scheduler.errors import (
    DeadlineInfeasible,
    Draining,
    DuplicateRequest,
    InvalidRequest,
    Overloaded,
    PromptTooLong,
    QueueFull,
)
from slipstream.scheduler.request import FinishReason, RejectCause
from slipstream.service.api.auth import PermissionDenied, QuotaExceeded, Unauthenticated
from slipstream.service.api.lifecycle import Loading, NotServing
from slipstream.service.telemetry.request_trace import WireStatus
from slipstream.v1 import inference_pb2 as pb

if TYPE_CHECKING:
    from slipstream.service.engine.events import FinishEvent


@dataclass(frozen=True, slots=True)
class Rejection:
    """``label``: a finer name than the wire's reason has, for a whole call's
    refusal, which carries only the label (``loading``, on the wire
    REJECT_REASON_DRAINING); empty for the reason's own name."""

    reject_reason: int  # pb.RejectReason
    status: grpc.StatusCode
    label: str = ""

    @property
    def reason_name(self) -> str:
        """``queue_full``, ``invalid``, ...: the reject reason as a label."""
        return self.label or reject_reason_name(self.reject_reason)

    @property
    def wire_status(self) -> WireStatus:
        return _wire_status(self.status)


def reject_reason_name(reject_reason: int) -> str:
    """A ``pb.RejectReason`` as its label (``queue_full``): for metrics, logs and
    the ``slipstream-reject-reason`` trailer (the clients read it back)."""
    return pb.RejectReason.Name(reject_reason).removeprefix("REJECT_REASON_").lower()


def _wire_status(code: grpc.StatusCode) -> WireStatus:
    return WireStatus(code.name, code.value[0])


INVALID = Rejection(pb.REJECT_REASON_INVALID, grpc.StatusCode.INVALID_ARGUMENT)

# Most specific class first: lookups walk the exception's MRO.
_REJECTIONS: dict[type[Exception], Rejection] = {
    PromptTooLong: Rejection(pb.REJECT_REASON_PROMPT_TOO_LONG, grpc.StatusCode.INVALID_ARGUMENT),
    DuplicateRequest: Rejection(
        pb.REJECT_REASON_DUPLICATE_REQUEST_ID, grpc.StatusCode.ALREADY_EXISTS
    ),
    QueueFull: Rejection(pb.REJECT_REASON_QUEUE_FULL, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # The engine is full and offered more than it serves (never while it has room).
    Overloaded: Rejection(pb.REJECT_REASON_OVERLOADED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    DeadlineInfeasible: Rejection(
        pb.REJECT_REASON_DEADLINE_INFEASIBLE, grpc.StatusCode.DEADLINE_EXCEEDED
    ),
    Draining: Rejection(pb.REJECT_REASON_DRAINING, grpc.StatusCode.UNAVAILABLE),
    # A whole call refused while the server loads or drains: the same wire
    # reason, labelled (trailer, logs, metrics) as what the server is doing.
    Loading: Rejection(pb.REJECT_REASON_DRAINING, grpc.StatusCode.UNAVAILABLE, "loading"),
    NotServing: Rejection(pb.REJECT_REASON_DRAINING, grpc.StatusCode.UNAVAILABLE),
    Unauthenticated: Rejection(pb.REJECT_REASON_UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),
    PermissionDenied: Rejection(
        pb.REJECT_REASON_PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED
    ),
    QuotaExceeded: Rejection(pb.REJECT_REASON_QUOTA_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ValueError: INVALID,
}

# Why the scheduler rejected a request it had queued -> the same table's rejection.
_CAUSES: dict[RejectCause, Rejection] = {
    RejectCause.SHED: Rejection(pb.REJECT_REASON_SHED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    RejectCause.DEADLINE_INFEASIBLE: _REJECTIONS[DeadlineInfeasible],
}

# Domain finish reason -> (wire finish reason, equivalent gRPC status).
_FINISHES: dict[FinishReason, tuple[int, grpc.StatusCode]] = {
    FinishReason.EOS: (pb.FINISH_REASON_EOS, grpc.StatusCode.OK),
    FinishReason.MAX_TOKENS: (pb.FINISH_REASON_MAX_TOKENS, grpc.StatusCode.OK),
    FinishReason.STOP_SEQUENCE: (pb.FINISH_REASON_STOP_SEQUENCE, grpc.StatusCode.OK),
    FinishReason.CANCELLED: (pb.FINISH_REASON_CANCELLED, grpc.StatusCode.CANCELLED),
    # Cut off by the server's shutdown: CANCELLED on the wire (no new value for
    # clients to learn), UNAVAILABLE where a client's own cancel says CANCELLED.
    FinishReason.SHUTDOWN: (pb.FINISH_REASON_CANCELLED, grpc.StatusCode.UNAVAILABLE),
    FinishReason.DEADLINE_EXCEEDED: (
        pb.FINISH_REASON_DEADLINE_EXCEEDED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ),
    FinishReason.REJECTED: (pb.FINISH_REASON_REJECTED, grpc.StatusCode.FAILED_PRECONDITION),
    FinishReason.ERROR: (pb.FINISH_REASON_ERROR, grpc.StatusCode.INTERNAL),
    # The stream's outbound buffer stayed full: the server's memory for it ran out.
    FinishReason.SLOW_READER: (pb.FINISH_REASON_SLOW_READER, grpc.StatusCode.RESOURCE_EXHAUSTED),
    FinishReason.OUT_OF_MEMORY: (
        pb.FINISH_REASON_OUT_OF_MEMORY,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),
}


def caller_message(error: Exception) -> str:
    """What a rejected caller is told: the scheduler's own checks without the
    engine's id for the request (stream-scoped, not the caller's)."""
    return error.detail if isinstance(error, InvalidRequest) else str(error)


def rejection_for(error: Exception) -> Rejection | None:
    """The rejection for a domain error a submit raised, or None when the
    error is not one a caller can cause (a server bug: let it propagate)."""
    for cls in type(error).__mro__:
        rejection = _REJECTIONS.get(cls)
        if rejection is not None:
            return rejection
    return None


def retry_after_ms(error: Exception) -> int:
    """The retry hint a rejection carries (``Finished.retry_after_ms``); 0: none."""
    seconds = getattr(error, "retry_after_s", None)
    return 0 if seconds is None else max(1, math.ceil(seconds * 1000))


def rejection_for_cause(cause: RejectCause) -> Rejection:
    """The rejection of a request the scheduler rejected after queueing it."""
    return _CAUSES[cause]


def wire_finish(reason: FinishReason) -> tuple[int, grpc.StatusCode]:
    return _FINISHES[reason]


def finish_status(event: FinishEvent) -> WireStatus:
    """The gRPC status of a finish, for telemetry (which never reads the wire):
    the one the wire carries, so a request the scheduler shed after queueing
    it is RESOURCE_EXHAUSTED on its span as in its status."""
    if event.reason is FinishReason.REJECTED and event.reject_cause is not None:
        return _wire_status(rejection_for_cause(event.reject_cause).status)
    return _wire_status(_FINISHES[event.reason][1])

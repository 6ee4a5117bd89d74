"""Slipstream scheduler: request state, KV block accounting, admission,
policy and preemption decisions. Standard library only (no torch, no grpc)."""

from .block_manager import BlockAccountingError, BlockPool
from .config import SchedulerConfig
from .errors import (
    DeadlineInfeasible,
    Draining,
    DuplicateRequest,
    PromptTooLong,
    QueueFull,
    SchedulerError,
)
from .plan import FinishedRequest, RequestOutput, ScheduledSeq, StepPlan
from .policy import (
    POLICIES,
    FcfsPolicy,
    PreemptionMode,
    PriorityPolicy,
    SchedulingPolicy,
    make_policy,
)
from .request import FinishReason, Request, RequestStatus, SamplingParams
from .scheduler import Scheduler

__all__ = [
    "POLICIES",
    "BlockAccountingError",
    "BlockPool",
    "DeadlineInfeasible",
    "Draining",
    "DuplicateRequest",
    "FcfsPolicy",
    "FinishReason",
    "FinishedRequest",
    "PreemptionMode",
    "PriorityPolicy",
    "PromptTooLong",
    "QueueFull",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulingPolicy",
    "StepPlan",
    "make_policy",
]

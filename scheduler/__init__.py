"""Slipstream scheduler: request state, KV block accounting, admission,
policy and preemption decisions. Standard library only (no torch, no grpc)."""

from .batch_shaping import BatchShaper
from .block_manager import BlockAccountingError, BlockPool
from .config import SchedulerConfig
from .cost_model import CostCoefficients, CostModel, StepShape
from .deadline_policy import DeadlinePolicy
from .errors import (
    AtCapacity,
    DeadlineInfeasible,
    Draining,
    DuplicateRequest,
    InvalidRequest,
    Overloaded,
    PromptTooLong,
    QueueFull,
    SchedulerError,
)
from .plan import FinishedRequest, RequestOutput, ScheduledSeq, StepPlan
from .policy_base import FcfsPolicy, Infeasible, PreemptionMode, PriorityPolicy, SchedulingPolicy
from .policy_registry import DEFAULT_POLICY, POLICY_NAMES, make_policy
from .request import (
    ExpiredLimit,
    FinishReason,
    RejectCause,
    Request,
    RequestStatus,
    SamplingParams,
)
from .scheduler import Scheduler

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "AtCapacity",
    "BatchShaper",
    "BlockAccountingError",
    "BlockPool",
    "CostCoefficients",
    "CostModel",
    "DeadlineInfeasible",
    "DeadlinePolicy",
    "Draining",
    "DuplicateRequest",
    "ExpiredLimit",
    "FcfsPolicy",
    "FinishReason",
    "FinishedRequest",
    "Infeasible",
    "InvalidRequest",
    "Overloaded",
    "PreemptionMode",
    "PriorityPolicy",
    "PromptTooLong",
    "QueueFull",
    "RejectCause",
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
    "StepShape",
    "make_policy",
]

"""Domain errors raised inside the scheduler. ``service/`` maps each to a gRPC
status / REJECTED reason in one table."""

from __future__ import annotations

from .request import ExpiredLimit


class SchedulerError(Exception):
    """Base of every error a caller can cause."""


class PromptTooLong(SchedulerError):
    """The prompt (plus max_new_tokens) cannot fit the model's context or KV pool."""


class QueueFull(SchedulerError):
    """The waiting queue is at its configured bound and nothing queued is in
    a less urgent class. ``retry_after_s`` hints when a retry may succeed."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(QueueFull):
    """More work arrives than the engine serves: a request of a class above
    0 ranked past the overload threshold (least urgent class, heaviest
    first) is turned away at arrival (``overload.py``). Answered like
    QueueFull, retry hint included."""


class DeadlineInfeasible(SchedulerError):
    """A time limit cannot be met even if the request ran alone from now.
    ``expired_limit`` says which (``ExpiredLimit.DEADLINE`` when unset)."""

    def __init__(self, message: str, expired_limit: ExpiredLimit = ExpiredLimit.DEADLINE) -> None:
        super().__init__(message)
        self.expired_limit = expired_limit


class Draining(SchedulerError):
    """The server is shutting down and takes no new requests."""


class DuplicateRequest(SchedulerError):
    """A live request already has this id."""

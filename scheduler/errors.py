"""Domain errors raised inside the scheduler. ``service/`` maps each to a gRPC
status / REJECTED reason in one table."""


class SchedulerError(Exception):
    """Base of every error a caller can cause."""


class PromptTooLong(SchedulerError):
    """The prompt (plus max_new_tokens) cannot fit the model's context or KV pool."""


class QueueFull(SchedulerError):
    """The waiting queue is at its configured bound."""


class DeadlineInfeasible(SchedulerError):
    """The deadline cannot be met even if the request ran alone from now."""


class Draining(SchedulerError):
    """The server is shutting down and takes no new requests."""


class DuplicateRequest(SchedulerError):
    """A live request already has this id."""

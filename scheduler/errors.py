"""Domain errors raised inside the scheduler. ``service/`` maps each to a gRPC
status / REJECTED reason in one table."""

from __future__ import annotations

from .request import ExpiredLimit


class SchedulerError(Exception):
    """Base of every error a caller can cause."""


class InvalidRequest(ValueError):
    """A malformed request (a caller's bug, not a capacity issue). ``detail``
    says what is wrong without the request's id, for a front door whose
    caller knows which request it sent (and knows it by another id);
    ``field``, where one field is at fault (``prompt_token_ids``), names it
    so the front door can name its own parameter."""

    def __init__(self, req_id: str, detail: str, field: str | None = None) -> None:
        super().__init__(f"request {req_id!r}: {detail}")
        self.detail = detail
        self.field = field


class PromptTooLong(SchedulerError):
    """The prompt (plus max_new_tokens) cannot fit the model's context or KV pool."""

    @classmethod
    def over_context(
        cls, num_prompt_tokens: int, max_new_tokens: int, max_model_len: int
    ) -> PromptTooLong:
        """The one wording of a request over the context, wherever it is caught."""
        return cls(
            f"prompt ({num_prompt_tokens}) + max_new_tokens ({max_new_tokens}) "
            f"exceeds max_model_len ({max_model_len})"
        )


class AtCapacity(SchedulerError):
    """Refused for want of capacity; ``retry_after_s`` hints when a retry
    may succeed. Never raised itself: QueueFull or Overloaded say which."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(AtCapacity):
    """The waiting queue is at its configured bound and nothing queued is in
    a less urgent class (or a front door's own bounded pool is full)."""


class Overloaded(AtCapacity):
    """The engine is full (its last step left waiting work out for want of
    room) and more work arrives than it serves: a request of a class above
    0 ranked past the overload threshold (least urgent class, heaviest
    first) is turned away at arrival (``overload.py``). ``load`` is the
    estimate that decided it (offered over served work, > 1). Its own
    reject reason (OVERLOADED), never QUEUE_FULL: the queue is not full."""

    def __init__(self, message: str, retry_after_s: float | None = None, load: float = 0.0) -> None:
        super().__init__(message, retry_after_s)
        self.load = load


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

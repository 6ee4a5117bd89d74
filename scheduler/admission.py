"""Admission checks: what a request must satisfy before it may queue.

Each check raises before anything is mutated, so a rejected request leaves
the scheduler exactly as it was. The deadline-feasibility check
(``DeadlineInfeasible``) belongs here too; it needs the step-cost model.
"""

from __future__ import annotations

from .config import SchedulerConfig
from .errors import PromptTooLong
from .request import Request


def check_request_shape(req: Request) -> None:
    """ValueError for a malformed request (caller bug, not a capacity issue)."""
    if not req.req_id:
        raise ValueError("req_id must be a non-empty string")
    if not req.prompt_token_ids:
        raise ValueError(f"request {req.req_id!r} has an empty prompt")
    if req.max_new_tokens < 1:
        raise ValueError(f"request {req.req_id!r}: max_new_tokens must be >= 1")
    sampling = req.sampling
    bad = (
        (sampling.temperature < 0, "temperature must be >= 0"),
        (not 0.0 < sampling.top_p <= 1.0, "top_p must be in (0, 1]"),
        (sampling.top_k < 0, "top_k must be >= 0"),
        (req.priority < 0, "priority must be >= 0"),
    )
    for failed, message in bad:
        if failed:
            raise ValueError(f"request {req.req_id!r}: {message}")
    if req.has_scheduling_state:
        raise ValueError(f"request {req.req_id!r} was already scheduled once; submit a fresh one")


def check_request_fits(req: Request, config: SchedulerConfig) -> None:
    """PromptTooLong unless the whole request (prompt + max_new_tokens) fits
    both the model's context and the device KV pool. Fitting the pool alone
    is what guarantees progress: the most urgent running request can always
    preempt everyone else and finish."""
    total = req.num_prompt_tokens + req.max_new_tokens
    if total > config.max_model_len:
        raise PromptTooLong(
            f"prompt ({req.num_prompt_tokens}) + max_new_tokens ({req.max_new_tokens}) "
            f"exceeds max_model_len ({config.max_model_len})"
        )
    blocks = -(-total // config.block_size)
    if blocks > config.num_device_blocks:
        raise PromptTooLong(
            f"prompt + max_new_tokens needs {blocks} KV blocks, "
            f"the device pool has {config.num_device_blocks}"
        )

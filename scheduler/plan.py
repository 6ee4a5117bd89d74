"""The plan: what ``Scheduler.schedule()`` hands to the runner for one step,
and what comes back. Plain frozen data; the runner needs nothing else.
The two records made per sequence per step (``ScheduledSeq``,
``RequestOutput``) are named tuples: as immutable as a frozen dataclass and
a quarter of its construction time (0.6 against 2.4 µs on a 2-core AMD EPYC
Zen 3), which at 256 sequences is a tenth of planning a step.

One step's batch is ragged: every scheduled sequence contributes
``len(token_ids)`` query tokens at positions ``start_pos ...``; a decode
contributes one (and its drafts, when it has some), a prefill chunk many.
All are packed into one flat tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .request import ExpiredLimit, FinishReason, RejectCause, SamplingParams

# A token a step still in flight samples, in a plan made ahead of its results
# (``Scheduler.schedule(ahead=True)``): the runner takes the id from that
# step's output. Never a real token id.
PENDING_TOKEN = -1


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step.

    ``token_ids`` are the tokens at positions ``[start_pos, start_pos +
    len(token_ids))``; their K/V are written to the slots of ``block_ids``
    (the sequence's whole device block table, in order). When ``sample`` is
    true the logits of the last position are sampled into output token number
    ``output_index`` (0-based); a prefill chunk that does not reach the end of
    the known tokens has ``sample == False``.

    A decode with drafts (speculative.py) ends in ``num_drafts`` draft tokens
    after its one known token: ``token_ids == [last, d1 .. dk]``. It samples
    at every position, outputs ``output_index ...``: the drafts the model
    agrees with, in order, and then one token of its own (1 to k + 1).
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    output_index: int
    sampling: SamplingParams
    num_drafts: int = 0


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request the scheduler ended while planning or admitting (rejected,
    shed, expired, aborted), reported so the service can tell its caller.

    ``expired_limit`` is set when a time limit ended it (DEADLINE_EXCEEDED,
    or REJECTED for DEADLINE_INFEASIBLE); ``reject_cause`` when it is
    REJECTED; ``retry_after_s`` when a retry may succeed later (SHED)."""

    req_id: str
    reason: FinishReason
    message: str = ""
    expired_limit: ExpiredLimit | None = None
    reject_cause: RejectCause | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything the runner executes for one step, in this order:
    swap_out, swap_in, copies, then one forward over ``seqs``."""

    step: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    finished: list[FinishedRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in


class RequestOutput(NamedTuple):
    """What one step produced for one request: new tokens (one, or more for
    a decode whose drafts were accepted) and, when it ended, why."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    message: str = ""


def with_pending_tokens(plan: StepPlan, previous: Mapping[str, int]) -> StepPlan:
    """``plan`` with each ``PENDING_TOKEN`` replaced by the token the previous
    step sampled for that request (``previous``: req_id -> token), as a runner
    that has that step's output on the host takes it. A pending token is only
    ever a decode's one token. Returns ``plan`` itself when it has none."""
    if not any(seq.token_ids == [PENDING_TOKEN] for seq in plan.seqs):
        return plan
    seqs = [
        seq._replace(token_ids=[previous[seq.req_id]]) if seq.token_ids == [PENDING_TOKEN] else seq
        for seq in plan.seqs
    ]
    return dataclasses.replace(plan, seqs=seqs)

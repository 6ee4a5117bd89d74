"""The scheduler's state: its queues, pools and counters (``SchedulerState``,
the base of every part of ``Scheduler``), and one ``schedule()`` call's
scratch (``_StepState``), which becomes the frozen ``StepPlan``.

See ``scheduler.py`` for the invariants every public method keeps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .batch_shaping import BatchShaper
from .block_manager import BlockPool
from .config import SchedulerConfig
from .cost_model import CostModel
from .plan import PENDING_TOKEN, FinishedRequest, ScheduledSeq, StepPlan
from .policy_base import PreemptionMode, SchedulingPolicy
from .policy_registry import make_policy
from .request import FinishReason, Request, RequestStatus
from .speculative import DraftOverhead, DraftPrice


@dataclass(slots=True)
class _StepState:
    """Scratch for one ``schedule()`` call; becomes the frozen ``StepPlan``."""

    step: int
    token_budget: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    preempted_ids: dict[str, None] = field(default_factory=dict)  # ordered set
    scheduled: dict[str, Request] = field(default_factory=dict)
    # A running request had to preempt for blocks: admitting new work now would
    # only take the blocks the running ones need next step.
    is_kv_exhausted: bool = False
    # Waiting work was left out for want of room (sequences, budget or
    # blocks), not held back: the step is as full as the engine makes them.
    is_saturated: bool = False
    # Waiting work was held back by the batch shaper: it waits too.
    is_held_back: bool = False
    # (urgency key, tokens) of waiting work that budget is held back for,
    # ascending: running work less urgent than a key leaves those tokens.
    reservations: list[tuple[tuple[float, ...], int]] = field(default_factory=list)
    # The policy's order of the waiting queue at ``waiting_version``: one
    # ranking serves every walk of an unchanged queue in this step.
    waiting_order: list[Request] = field(default_factory=list)
    waiting_version: int = -1
    # Holds back less urgent tokens when the step would be too slow for
    # urgent work (None: the policy does not shape batches).
    shaper: BatchShaper | None = None
    # What drafting costs this step and what a token is worth (speculative.py;
    # None: not priced, every draft is made); whether the step holds a
    # prefill-priced token yet (a prefill chunk or drafts).
    draft_price: DraftPrice | None = None
    holds_prefill: bool = False

    def to_plan(self) -> StepPlan:
        return StepPlan(
            step=self.step,
            seqs=self.seqs,
            swap_out=self.swap_out,
            swap_in=self.swap_in,
            finished=self.finished,
            preempted_req_ids=list(self.preempted_ids),
        )


class SchedulerState:
    """What a ``Scheduler`` holds — the request queues, the device and host
    block pools, the policy and the counters — and the two moves every part
    of it makes: admitting a waiting request and finishing a live one."""

    def __init__(
        self,
        config: SchedulerConfig,
        policy: SchedulingPolicy | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        self.config = config
        self.policy = (
            policy if policy is not None else make_policy(config.policy, config, cost_model)
        )
        self._cost_model = cost_model
        self.device_pool = BlockPool(config.num_device_blocks, config.block_size)
        self.host_pool = BlockPool(config.num_host_blocks, config.block_size)
        self._requests: dict[str, Request] = {}  # every live request
        self._waiting: deque[Request] = deque()
        self._waiting_version = 0  # bumped on every change to ``_waiting``
        self._running: dict[str, Request] = {}  # insertion order = admission order
        self._swapped: dict[str, Request] = {}
        # Held out of every plan (their caller cannot take more output): see pause().
        self._paused: set[str] = set()
        self._step = 0
        self._num_arrivals = 0
        self._in_flight_step: int | None = None
        self._in_flight: dict[str, Request] = {}
        self._in_flight_plan: StepPlan | None = None
        # Planning ahead (Scheduler.schedule): the plan taken as done before
        # its results came, with its sequences then current; and the requests
        # planned no further until they come: those it brought to a token
        # limit (ended by update), and those whose drafts it verifies (how
        # many tokens they get is known only then).
        self._ahead: tuple[StepPlan, list[tuple[ScheduledSeq, Request]]] | None = None
        self._held_for_results: set[str] = set()
        # Speculative decoding (speculative.py): on, and draft tokens
        # proposed in plans that were updated, and of those, accepted.
        self._drafting = config.num_speculative_tokens > 0
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._draft_overhead = DraftOverhead()
        self._steps_without_drafts = 0  # planned since the last step that held any
        self._num_preemptions = {mode: 0 for mode in PreemptionMode}
        self._num_expired = 0
        self._num_abandoned = 0
        self._prefix_cache = config.enable_prefix_cache
        self._num_prefix_queried_tokens = 0  # looked up at admissions
        self._num_prefix_hit_tokens = 0  # of those, found cached
        self._num_lost_swaps = 0  # swapped requests requeued by _requeue_lost_swap
        self._num_prefix_waits = 0  # steps waiting requests sat out for a computing prefix
        # (time, arrival_index, req) per deadline / first-token deadline;
        # entries of finished requests are dropped when they surface, or all
        # at once by Admission._compact_deadlines when they pile up.
        self._deadlines: list[tuple[float, int, Request]] = []
        # Requests ended outside schedule() (shed by add_request), reported
        # in the next plan's ``finished``.
        self._ended: list[FinishedRequest] = []
        self._num_shed: dict[int, int] = {}
        # Arrivals refused for capacity, by (class, reason): "overloaded", "queue_full".
        self._num_refused: dict[tuple[int, str], int] = {}
        self._num_held_back = 0
        self._last_finish_time: float | None = None
        self._finish_gap_s: float | None = None  # average time between finishes

    def _admit(self, req: Request, now: float) -> None:
        _remove_by_identity(self._waiting, req)
        self._waiting_version += 1
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.mark_resumed(now)
        self._running[req.req_id] = req

    def _finish(self, req: Request, reason: FinishReason, message: str) -> None:
        if req.status is RequestStatus.WAITING:
            _remove_by_identity(self._waiting, req)
            self._waiting_version += 1
        elif req.status is RequestStatus.RUNNING:
            del self._running[req.req_id]
        elif req.status is RequestStatus.SWAPPED:
            del self._swapped[req.req_id]
        self.device_pool.free(req.block_ids)
        self.host_pool.free(req.host_block_ids)
        if req.output_token_ids and req.output_token_ids[-1] == PENDING_TOKEN:
            req.output_token_ids.pop()  # ended before the step in flight brought it
        req.block_ids = []
        req.host_block_ids = []
        req.num_committed_blocks = req.num_released_blocks = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_message = message
        del self._requests[req.req_id]
        self._paused.discard(req.req_id)
        self.policy.observe_finish(req, reason)
        self.policy.forget(req.req_id)


def _remove_by_identity(queue: deque[Request], req: Request) -> None:
    for index, queued in enumerate(queue):
        if queued is req:
            del queue[index]
            return
    raise ValueError(f"request {req.req_id!r} is not in the queue")

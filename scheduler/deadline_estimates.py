"""The deadline policy's estimates and urgencies (``DeadlineEstimates``, the
base of ``DeadlinePolicy``): how long each request still needs, alone and
under the current load, and where that puts it in the urgency order.

Estimates. For each request the policy caches, per progress (computed
tokens, outputs, status), the *isolated* remaining time (the cost model's
service time if it ran alone: rest of the prefill, in budget-sized chunks,
then the decodes to ``expected_output_tokens`` or ``max_new_tokens``, plus
a swap-in when swapped) and the number of steps that takes. Under load a
step is slower than an isolated one, so the *loaded* remaining time is
``max(isolated, steps * loaded_step_s)`` where ``loaded_step_s`` is an
exponential average of the predicted seconds of the plans actually made
(``observe_plan``). Caching the components keeps every estimate O(1);
only the multiplication by the current step time is redone, once per
``(now, loaded_step_s)`` and request.

Urgency (smaller sorts first)::

    (is_hopeless, effective_class, deadline - loaded_remaining, arrival_index)

- ``is_hopeless``: ``now + loaded_remaining > deadline``. The scheduler
  abandons such work (DEADLINE_EXCEEDED, "cannot meet deadline") when
  ``SchedulerConfig.abandon_hopeless``; compute spent on it is wasted and
  only makes others miss too.
- ``effective_class``: ``priority`` lowered by one per ``aging_s`` seconds
  since arrival, down to 0: the least urgent class competes on slack with
  class 0 after ``2 * aging_s`` — its wait is bounded by that (or by its own
  deadline, when abandoned). Promotion changes order only, never the right
  to preempt.
"""

from __future__ import annotations

import math

from .config import SchedulerConfig
from .cost_model import CostModel
from .request import ExpiredLimit, Request, RequestStatus

# A request is hopeless when even this fraction of its loaded remaining time
# overruns its deadline: the loaded estimate is an average, and a wrong
# "hopeless" costs a request that might have made it.
HOPELESS_LOAD_FRACTION = 1.0

# The request fields an urgency depends on: (computed tokens, outputs,
# status, deadline, first-token deadline, priority, arrival time, arrival
# index). The first three are the progress an estimate depends on.
_Signature = tuple[int, int, RequestStatus, float | None, float | None, int, float, int]
_Progress = tuple[int, int, RequestStatus]

# Read per live request several times a step: a module name is a dict look-up,
# an enum member through its class ~0.1 µs on Python 3.11.
_WAITING, _RUNNING, _SWAPPED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED
_DEADLINE = ExpiredLimit.DEADLINE


def output_target(req: Request, outputs: int) -> int:
    """The outputs ``req`` is expected to end with, having ``outputs``:
    its expected count (else ``max_new_tokens``), at least one more than it
    has, at most ``max_new_tokens``."""
    target = req.expected_output_tokens or req.max_new_tokens
    return min(max(target, outputs + 1), req.max_new_tokens)


class _Entry:
    """What the policy knows about one live request: a record updated in
    place, not rebuilt, every time the request is ranked in a new step.

    The estimate (``isolated_s``, ``num_steps``) is valid while ``progress``
    is the request's; the urgency (``is_hopeless``, ``latest_start``,
    ``key``) while, in addition, ``epoch`` is the policy's current one (one
    ``(now, loaded_step_s)``) and ``signature`` is the request's.
    """

    __slots__ = (
        "epoch",
        "first_token_isolated_s",
        "first_token_steps",
        "hopeless_limit",
        "is_hopeless",
        "isolated_s",
        "key",
        "latest_start",
        "num_steps",
        "progress",
        "signature",
    )

    def __init__(self) -> None:
        self.progress: _Progress | None = None
        self.isolated_s = 0.0
        self.num_steps = 0
        # Until the first output: the same for the first token (else 0).
        self.first_token_isolated_s = 0.0
        self.first_token_steps = 0
        self.epoch = -1
        self.signature: _Signature | None = None
        self.is_hopeless = False
        self.hopeless_limit = ExpiredLimit.DEADLINE
        self.latest_start = math.inf
        self.key: tuple[float, ...] = ()


class DeadlineEstimates:
    """Per-request remaining-time estimates and urgencies, cached per
    progress and memoized per epoch (one ``(now, loaded_step_s)``)."""

    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None) -> None:
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self._budget = config.max_num_batched_tokens
        self._aging_s = config.aging_s
        self._entries: dict[str, _Entry] = {}
        # Every queue is ranked several times per step at one (now, loaded
        # step time), an epoch: urgencies are computed once per epoch.
        self._epoch = 0
        self._epoch_now = math.nan  # NaN equals nothing: the first call starts epoch 1
        self._epoch_step_s = math.nan
        c = self.cost_model.coefficients
        self.loaded_step_s = c.base_s + c.per_decode_seq_s  # one isolated decode step

    def remaining_seconds(self, req: Request) -> float:
        """Isolated remaining service time (swap-in included when swapped)."""
        return self._estimate(req).isolated_s

    def loaded_remaining_seconds(self, req: Request) -> float:
        """Remaining time at the current loaded step time (never below isolated)."""
        est = self._estimate(req)
        return max(est.isolated_s, est.num_steps * self.loaded_step_s)

    def _estimate(self, req: Request) -> _Entry:
        """``req``'s entry with its estimate up to date."""
        # Per scheduled request a step: ``num_known_kv_tokens`` inlined.
        status = req.status
        computed = req.num_computed_tokens
        if status is _WAITING and req.num_prefix_hit_tokens > computed:
            computed = req.num_prefix_hit_tokens
        progress = (computed, len(req.output_token_ids), status)
        entry = self._entries.get(req.req_id)
        if entry is None:
            entry = self._entries[req.req_id] = _Entry()
        if entry.progress != progress:
            self._new_estimate(entry, req, progress)
        return entry

    def _new_estimate(self, entry: _Entry, req: Request, progress: _Progress) -> None:
        """Once per running request a step (its progress moves): ``output_target``
        inlined, and each ``max`` of two a comparison (the same value)."""
        computed, outputs, status = progress
        target = req.expected_output_tokens or req.max_new_tokens
        if target <= outputs:
            target = outputs + 1
        if target > req.max_new_tokens:
            target = req.max_new_tokens
        outputs_left = target - outputs if target - outputs > 1 else 1
        num_tokens = len(req.prompt_token_ids) + outputs
        cost = self.cost_model
        prefill = cost.prefill_seconds(num_tokens - computed, self._budget, computed)
        isolated = prefill + cost.decode_seconds(num_tokens, outputs_left - 1)
        if status is _SWAPPED:
            swap = cost.swap_seconds(len(req.host_block_ids))
            isolated += swap
            prefill += swap
        chunks = -(-(num_tokens - computed) // self._budget)
        entry.progress = progress
        entry.isolated_s = isolated
        entry.num_steps = chunks + outputs_left - 1
        if outputs == 0:
            entry.first_token_isolated_s = prefill
            entry.first_token_steps = chunks if chunks > 1 else 1
        else:
            entry.first_token_isolated_s = 0.0
            entry.first_token_steps = 0

    def slack(self, req: Request, now: float) -> float:
        return self._latest_start(req) - now

    def _latest_start(self, req: Request) -> float:
        """The last moment it could start under the current load and still
        meet its deadline (``deadline - loaded remaining``) and, before its
        first token, its first-token deadline; +inf without either."""
        latest = math.inf
        if req.deadline is not None:
            latest = req.deadline - self.loaded_remaining_seconds(req)
        est = self._estimate(req)
        if req.first_token_deadline is not None and est.first_token_steps:
            loaded = max(est.first_token_isolated_s, est.first_token_steps * self.loaded_step_s)
            latest = min(latest, req.first_token_deadline - loaded)
        return latest

    def _urgency_of(self, req: Request, now: float) -> _Entry:
        """``req``'s entry with its urgency at ``now``: exactly what
        ``is_hopeless``, ``effective_class`` and ``slack`` compute,
        memoized per epoch."""
        if now != self._epoch_now or self.loaded_step_s != self._epoch_step_s:
            self._epoch_at(now)  # a new epoch (checked here first: a call per request costs)
        epoch = self._epoch
        # Per live request, twice a step: ``num_known_kv_tokens`` inlined.
        status = req.status
        computed = req.num_computed_tokens
        if status is _WAITING and req.num_prefix_hit_tokens > computed:
            computed = req.num_prefix_hit_tokens
        signature = (
            computed,
            len(req.output_token_ids),
            status,
            req.deadline,
            req.first_token_deadline,
            req.priority,
            req.arrival_time,
            req.arrival_index,
        )
        entry = self._entries.get(req.req_id)
        if entry is None:
            entry = self._entries[req.req_id] = _Entry()
        elif entry.epoch == epoch and entry.signature == signature:
            return entry
        self._new_urgency(entry, req, now, signature)
        return entry

    def _epoch_at(self, now: float) -> int:
        """The epoch of ``(now, loaded_step_s)``, a new one when either moved."""
        if now != self._epoch_now or self.loaded_step_s != self._epoch_step_s:
            self._epoch += 1
            self._epoch_now, self._epoch_step_s = now, self.loaded_step_s
        return self._epoch

    def _new_urgency(self, entry: _Entry, req: Request, now: float, signature: _Signature) -> None:
        """Once per live request a step: ``_effective_class`` inlined, and each
        ``max`` / ``min`` of two a comparison (the same value)."""
        computed, outputs, status, deadline, first_token_deadline, priority, arrived, index = (
            signature
        )
        # Only a time limit reads the estimate: work without one (most of a
        # throughput batch) skips it, and ``_estimate`` makes it when asked.
        if deadline is not None or first_token_deadline is not None:
            progress = (computed, outputs, status)
            if entry.progress != progress:
                self._new_estimate(entry, req, progress)
        effective = priority
        aging_s = self._aging_s
        if aging_s > 0 and priority > 0:
            effective = priority - int((now - arrived) // aging_s)
            if effective < 0:
                effective = 0
        hopeless, latest, limit = False, math.inf, _DEADLINE
        # Loaded time counts against waiting / swapped work of a class above 0
        # only: see ``is_hopeless``.
        judge_loaded = effective > 0 and status is not _RUNNING
        step_s = self.loaded_step_s
        if deadline is not None:
            isolated, loaded = entry.isolated_s, entry.num_steps * step_s
            latest = deadline - (loaded if loaded > isolated else isolated)  # max()
            needed = isolated
            if judge_loaded:
                loaded = HOPELESS_LOAD_FRACTION * entry.num_steps * step_s
                if loaded > needed:
                    needed = loaded
            hopeless = now + needed > deadline
        if first_token_deadline is not None and entry.first_token_steps:
            isolated, loaded = entry.first_token_isolated_s, entry.first_token_steps * step_s
            first = first_token_deadline - (loaded if loaded > isolated else isolated)
            if first < latest:
                latest = first
            needed = isolated
            if judge_loaded:
                loaded = HOPELESS_LOAD_FRACTION * loaded
                if loaded > needed:
                    needed = loaded
            if not hopeless and now + needed > first_token_deadline:
                hopeless, limit = True, ExpiredLimit.FIRST_TOKEN
        entry.epoch = self._epoch
        entry.signature = signature
        entry.is_hopeless = hopeless
        entry.hopeless_limit = limit
        entry.latest_start = latest
        entry.key = (1.0 if hopeless else 0.0, float(effective), latest, float(index))

    def effective_class(self, req: Request, now: float) -> int:
        return _effective_class(req.priority, req.arrival_time, now, self._aging_s)

    def is_hopeless(self, req: Request, now: float) -> bool:
        """Waiting or swapped work: it would miss at the current load.
        Running work, and work of effective class 0: it would miss even
        alone — the loaded average is too noisy a reason to throw away work
        that is making progress, and class 0 preempts its way in and so
        fares better than the average request."""
        return self._urgency_of(req, now).is_hopeless


def _effective_class(priority: int, arrival_time: float, now: float, aging_s: float) -> int:
    """``priority`` lowered by one per ``aging_s`` since arrival, down to 0."""
    if aging_s <= 0 or priority <= 0:
        return priority
    return max(0, priority - int((now - arrival_time) // aging_s))

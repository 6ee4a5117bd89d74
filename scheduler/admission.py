"""Admission: what a request must satisfy before it may queue, and what the
door does with it (``Admission.add_request``): the deadline-feasibility and
overload checks the policy answers, and a full queue's shedding.

Each check raises before anything is mutated, so a rejected request leaves
the scheduler exactly as it was.
"""

from __future__ import annotations

import heapq
import math

from .config import SchedulerConfig
from .errors import (
    DeadlineInfeasible,
    DuplicateRequest,
    InvalidRequest,
    Overloaded,
    PromptTooLong,
    QueueFull,
)
from .plan import FinishedRequest
from .prefix_sharing import PrefixSharing
from .request import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    FinishReason,
    RejectCause,
    Request,
    RequestStatus,
    SamplingParams,
)


def check_request_shape(req: Request) -> None:
    """InvalidRequest (a ValueError) for a malformed request (caller bug,
    not a capacity issue). Every entry point meets these, an in-process
    caller's ``RequestSpec`` too; the fronts check the same bounds first
    to name their own parameters."""
    if not req.req_id:
        raise ValueError("req_id must be a non-empty string")
    sampling = req.sampling
    num_top = sampling.logprobs
    bad = (
        (not req.prompt_token_ids, "the prompt is empty"),
        (req.max_new_tokens < 1, "max_new_tokens must be >= 1"),
        # NaN or inf would reach the sampler's softmax (a NaN compares as not < 0)
        (not math.isfinite(sampling.temperature), "temperature must be finite"),
        (sampling.temperature < 0, "temperature must be >= 0"),
        (not 0.0 < sampling.top_p <= 1.0, "top_p must be in (0, 1]"),
        (sampling.top_k < 0, "top_k must be >= 0"),
        # a negative count fails the step's top-k, every request in it
        (
            num_top is not None and not 0 <= num_top <= MAX_TOP_LOGPROBS,
            f"logprobs must be None or in [0, {MAX_TOP_LOGPROBS}], got {num_top}",
        ),
        (req.priority < 0, "priority must be >= 0"),
        (req.has_scheduling_state, "it was already scheduled once; submit a fresh one"),
    )
    for failed, detail in bad:
        if failed:
            raise InvalidRequest(req.req_id, detail)
    problem = adjustment_problem(sampling)
    if problem is not None:
        field, detail = problem
        raise InvalidRequest(req.req_id, detail, field)
    if sampling.min_tokens > req.max_new_tokens:  # after its own bounds: a negative one first
        raise InvalidRequest(
            req.req_id,
            f"min_tokens ({sampling.min_tokens}) must be at most max_new_tokens "
            f"({req.max_new_tokens})",
            "min_tokens",
        )


def adjustment_problem(sampling: SamplingParams) -> tuple[str, str] | None:
    """The first of ``sampling``'s logit adjustments, ``min_p`` and
    ``stop_token_ids`` out of its bounds, as (its field, what is wrong, in
    the wire's words), or None. Out of bounds, a penalty or bias still
    samples, but not as OpenAI's ranges promise, and a NaN or infinite one
    makes a row's logits NaN. ``min_tokens``' bound is the request's
    ``max_new_tokens`` (``check_request_shape``); the ids' is the
    vocabulary (the wire's, and the sampler skips one past it)."""
    if sampling.min_p and not 0.0 <= sampling.min_p <= 1.0:  # NaN included
        return "min_p", f"min_p must be in [0, 1] (0 is off), got {sampling.min_p:g}"
    stop_ids = sampling.stop_token_ids
    if stop_ids:
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            return "stop_token_ids", (
                f"stop_token_ids has {len(stop_ids)} ids, more than the "
                f"{MAX_STOP_TOKEN_IDS} allowed"
            )
        if min(stop_ids) < 0:
            return "stop_token_ids", f"stop_token_ids must be token ids, got {min(stop_ids)}"
    if not sampling.has_logit_adjustments:
        return None  # all off: the common case, one test
    if sampling.min_tokens < 0:
        return "min_tokens", f"min_tokens must be >= 0, got {sampling.min_tokens}"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN included
            return name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value:g}"
    repetition = sampling.repetition_penalty
    if not 1 / MAX_REPETITION_PENALTY <= repetition <= MAX_REPETITION_PENALTY:  # NaN included
        return "repetition_penalty", (
            f"repetition_penalty must be in [{1 / MAX_REPETITION_PENALTY:g}, "
            f"{MAX_REPETITION_PENALTY:g}] (1 is off), got {repetition:g}"
        )
    bias = sampling.logit_bias
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        return "logit_bias", (
            f"logit_bias has {len(bias)} tokens, more than the {MAX_LOGIT_BIAS_TOKENS} allowed"
        )
    for token, value in bias:
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN included
            return "logit_bias", (
                f"logit_bias: the bias of token {token} must be in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value:g}"
            )
    if len({token for token, _ in bias}) < len(bias):  # the sampler adds a repeat's twice
        return "logit_bias", "logit_bias: each token id may appear once"
    return None


def check_request_fits(req: Request, config: SchedulerConfig) -> None:
    """PromptTooLong unless the whole request (prompt + max_new_tokens) fits
    both the model's context and the device KV pool. Fitting the pool alone
    is what guarantees progress: the most urgent running request can always
    preempt everyone else and finish."""
    total = req.num_prompt_tokens + req.max_new_tokens
    if total > config.max_model_len:
        raise PromptTooLong.over_context(
            req.num_prompt_tokens, req.max_new_tokens, config.max_model_len
        )
    blocks = -(-total // config.block_size)
    if blocks > config.num_device_blocks:
        raise PromptTooLong(
            f"prompt + max_new_tokens needs {blocks} KV blocks, "
            f"the device pool has {config.num_device_blocks}"
        )


# Bounds of a retry-after hint, and the weight of the newest gap between
# finishes in the average that sizes it.
_RETRY_AFTER_S = (0.05, 300.0)
_FINISH_GAP_EWMA = 0.1


class Admission(PrefixSharing):
    """The door: queues a request or refuses it, shedding a less urgent
    queued request to make room when the policy names one."""

    def add_request(self, req: Request, now: float | None = None) -> None:
        """Queues ``req`` (WAITING). Raises ValueError, DuplicateRequest,
        PromptTooLong, DeadlineInfeasible or QueueFull — and then changes
        nothing. ``now`` defaults to ``req.arrival_time``.

        A full queue sheds the queued request the policy names
        (``shed_victim``: a less urgent class) to make room: it ends
        REJECTED (``RejectCause.SHED``) and is reported in the next plan's
        ``finished``. Without a victim the newcomer gets QueueFull."""
        check_request_shape(req)
        if req.req_id in self._requests:
            raise DuplicateRequest(f"request {req.req_id!r} is already live")
        check_request_fits(req, self.config)
        self._prefix_hits(req)  # cached tokens cost nothing in the estimates below
        at = req.arrival_time if now is None else now
        if self.config.reject_infeasible:
            infeasible = self.policy.check_admission(req, at)
            if infeasible is not None:
                self.policy.forget(req.req_id)
                raise DeadlineInfeasible(infeasible.message, infeasible.limit)
        refusal = self.policy.overload_refusal(req, at)
        if refusal:
            self.policy.forget(req.req_id)
            retry = self.retry_after_seconds(req.priority)
            self._count_refusal(req.priority, "overloaded")
            load = self.policy.overload_estimate()
            raise Overloaded(f"{refusal}; retry after {retry:.3f}s", retry, load or 0.0)
        if len(self._waiting) >= self.config.max_queue_len:
            victim = self.policy.shed_victim(req, self._waiting, at)
            if victim is None:
                self.policy.forget(req.req_id)
                retry = self.retry_after_seconds(req.priority)
                self._count_refusal(req.priority, "queue_full")
                raise QueueFull(
                    f"waiting queue is full (it holds {self.config.max_queue_len}); "
                    f"retry after {retry:.3f}s",
                    retry,
                )
            self._shed(victim)
        req.arrival_index = self._num_arrivals
        self._num_arrivals += 1
        self.policy.observe_arrival(req, at)
        self._requests[req.req_id] = req
        self._waiting.append(req)
        self._waiting_version += 1
        if len(self._deadlines) > 4 * len(self._requests) + 256:
            self._compact_deadlines()
        for when in (req.deadline, req.first_token_deadline):
            if when is not None:
                heapq.heappush(self._deadlines, (when, req.arrival_index, req))

    def _compact_deadlines(self) -> None:
        """Drops the deadline entries of requests that ended. They are
        otherwise dropped only when their time comes, and a finished request
        with a deadline hours away would be held (prompt, output) until then:
        memory growing with the arrival rate times the deadlines' length. Run
        when the heap is over twice what the live requests need (two entries
        each, at most), it costs O(1) an arrival amortised."""
        live = self._requests
        self._deadlines = [
            entry for entry in self._deadlines if live.get(entry[2].req_id) is entry[2]
        ]
        heapq.heapify(self._deadlines)

    def _count_refusal(self, priority: int, reason: str) -> None:
        key = (priority, reason)
        self._num_refused[key] = self._num_refused.get(key, 0) + 1

    def _shed(self, victim: Request) -> None:
        if (
            victim.status is not RequestStatus.WAITING
            or self._requests.get(victim.req_id) is not victim
        ):
            raise ValueError(f"policy chose {victim.req_id!r} to shed, which is not waiting")
        retry = self.retry_after_seconds(victim.priority)
        message = f"shed from a full queue for a more urgent request; retry after {retry:.3f}s"
        self._finish(victim, FinishReason.REJECTED, message)
        self._num_shed[victim.priority] = self._num_shed.get(victim.priority, 0) + 1
        self._ended.append(
            FinishedRequest(
                victim.req_id,
                FinishReason.REJECTED,
                message,
                reject_cause=RejectCause.SHED,
                retry_after_s=retry,
            )
        )

    def retry_after_seconds(self, priority: int) -> float:
        """When a retry of class ``priority`` may find room: the queued work
        of that class or a more urgent one, at the recent rate of finishes."""
        gap = self._finish_gap_s if self._finish_gap_s is not None else 1.0
        ahead = sum(1 for r in self._waiting if r.priority <= priority)
        low, high = _RETRY_AFTER_S
        return min(high, max(low, (ahead + 1) * gap))

    def _note_finish(self, now: float) -> None:
        """Tracks the average gap between completions (for retry hints)."""
        last, self._last_finish_time = self._last_finish_time, now
        if last is None:
            return
        gap = now - last
        average = self._finish_gap_s
        self._finish_gap_s = (
            gap if average is None else average + _FINISH_GAP_EWMA * (gap - average)
        )

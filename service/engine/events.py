"""What crosses between the engine thread and its callers.

A caller submits a ``RequestSpec`` with a callback; the engine thread
calls it with ``TokenEvent``s as tokens are made and exactly one
``FinishEvent`` at the end. Callbacks run on the engine thread and must be
cheap and non-blocking (hand off with ``loop.call_soon_threadsafe`` or a
``queue.Queue``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from slipstream.scheduler.request import (  # noqa: F401  RequestSpec: the engine's request
    ConstraintKind,
    ExpiredLimit,
    FinishReason,
    OutputConstraint,
    RejectCause,
    RequestSpec,
    SamplingParams,
)


class StepOutOfMemory(RuntimeError):
    """The device ran out of memory during a step (runners raise it). ``req_ids``
    are the requests whose state the step may have left incomplete: the engine
    ends them OUT_OF_MEMORY (RESOURCE_EXHAUSTED), frees their blocks and goes on."""

    def __init__(self, req_ids: list[str], detail: str) -> None:
        super().__init__(f"device out of memory during a step of {len(req_ids)} requests: {detail}")
        self.req_ids = req_ids


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model (before temperature,
    top-k and top-p), and the most likely tokens at its position with theirs,
    most likely first (``SamplingParams.logprobs`` of them)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class TokenEvent(NamedTuple):
    """New tokens of one request from one engine step. ``index`` is the
    output index of ``token_ids[0]``; ``text`` is the detokenized delta (it
    may lag the ids by a few bytes until a UTF-8 character is complete).
    Made per request per step on the engine thread: a named tuple, built in
    a quarter of a frozen dataclass's time and as immutable. ``logprobs``:
    one per token id, for a request that asked for them (else None)."""

    req_id: str
    token_ids: list[int]
    text: str
    index: int
    step: int
    batch_id: int
    batch_size: int
    queue_wait_s: float
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class FinishEvent:
    """The one final event of a request. ``expired_limit`` says which time
    limit ended it (DEADLINE_EXCEEDED, or REJECTED as infeasible);
    ``reject_cause`` why the scheduler rejected it after queueing it;
    ``retry_after_s`` when a retry may succeed (shed). ``queue_wait_s`` is
    arrival to first scheduled; ``preempted_s`` the time spent preempted
    after that (swapped out or queued again for recompute)."""

    req_id: str
    reason: FinishReason
    message: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not prefilled)
    queue_wait_s: float = 0.0
    ttft_s: float | None = None
    total_s: float = 0.0
    num_preemptions: int = 0
    preempted_s: float = 0.0
    priority: int = 0
    # Steps the batch shaper held it back for more urgent work.
    num_held_back: int = 0
    text: str = ""  # any text held back until the end (incomplete UTF-8, stop-string lookahead)
    expired_limit: ExpiredLimit | None = None
    reject_cause: RejectCause | None = None
    retry_after_s: float | None = None


Event = TokenEvent | FinishEvent
EventCallback = Callable[[Event], None]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: str
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    block_size: int
    attention_backend: str
    eos_token_ids: list[int]
    kv_bytes_per_block: int = 0  # device + host KV bytes one block holds (all layers)
    requested_dtype: str = ""
    weights_packed: bool = False
    has_chat_template: bool = False  # chat messages can be rendered (Submit.messages)
    cpu: dict[str, object] = field(default_factory=dict)  # CpuFeatures.describe()
    compiled: bool = False  # the step runs the fused native kernels (EngineConfig.compile)
    kv_cache_dtype: str = ""  # the KV cache's element type: the model's dtype, or "int8"
    # Where the step runs: {"type": "cpu"}, or on CUDA the GPU's name and memory,
    # the capture time and memory of the decode graphs (DeviceRunner.info()).
    device: dict[str, Any] = field(default_factory=lambda: {"type": "cpu"})


@dataclass(frozen=True, slots=True)
class PoolStats:
    used: int
    free: int


@dataclass(frozen=True, slots=True)
class HostTimes:
    """Seconds the engine thread spent in each phase of its steps since
    start: planning, launching (on the CPU, and on a GPU without planning
    ahead, the forward is in it), waiting for a step launched ahead to land,
    the scheduler's update, publishing to callers. Planning ahead, a wait
    near zero says the device finishes each step before the host asks for
    it: the host's work sets the pace, not the device."""

    planning: float = 0.0
    launch: float = 0.0
    device_wait: float = 0.0
    update: float = 0.0
    publish: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Totals since start: tokens looked up in the prefix cache at
    admissions and, of those, found cached (so hit rate = hit / queried);
    steps waiting requests sat out while another request's chunk computed
    their next prefix blocks (``Scheduler.num_prefix_waits``: what a wait
    saved shows in the hits); device blocks the cache holds now (in use or
    evictable)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    waits: int = 0
    cached_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for GetServerStats and metrics. ``by_priority`` maps a
    priority class to ``{"waiting": n, "running": n, "swapped": n}``."""

    waiting: int
    running: int
    swapped: int
    device_blocks: PoolStats
    host_blocks: PoolStats
    by_priority: dict[int, dict[str, int]]
    step: int
    is_draining: bool
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # Arrivals refused as overloaded since start, by priority class.
    overload_refused: dict[int, int] = field(default_factory=dict)
    paused: int = 0  # live requests held out of the batch (their caller reads slowly)
    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    # Arrivals refused at the door for capacity, by (priority class, reason).
    capacity_refusals: dict[tuple[int, str], int] = field(default_factory=dict)
    overload_estimate: float | None = None  # offered over served work; None before any
    # Measured over predicted step time, a moving average; None before any step.
    step_time_pace: float | None = None
    # On a GPU: its memory in bytes (used, free); None on the CPU.
    device_memory: PoolStats | None = None
    host_times: HostTimes = field(default_factory=HostTimes)
    # Speculative decoding since start: draft tokens verified, and of those
    # accepted (each one a step's token more for its request).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

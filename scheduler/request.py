"""Request state: the one mutable record the scheduler keeps per request.

Lifecycle (``RequestStatus``, in documented order)::

    WAITING ──schedule──▶ RUNNING ──finish──▶ FINISHED
       ▲                    │
       └──── preempt ───────┤  (recompute: blocks freed, back to WAITING)
                            ▼
                         SWAPPED ──swap in──▶ RUNNING   (KV kept in the host pool)
                            │
                            └──▶ WAITING  (its shared prefix left the cache meanwhile)

Token bookkeeping follows one idea: ``num_computed_tokens`` (tokens whose KV is
in the cache) catches up with ``num_tokens`` (prompt + generated) under a
per-step token budget. A prefill is simply a request far behind; a decode is a
request exactly one token behind. Chunked prefill falls out of that.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .speculative import Drafter


class RequestStatus(enum.IntEnum):
    """Where a request is. Ordered: a request only moves to a larger value,
    except RUNNING -> WAITING (recompute), RUNNING <-> SWAPPED (swap) and
    SWAPPED -> WAITING (a swap-in whose shared prefix was evicted)."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED = 3


class FinishReason(enum.IntEnum):
    """Why a request ended. ``service/`` maps each one to the wire's finish
    reason in a single table; nothing else interprets these values."""

    EOS = 0
    MAX_TOKENS = 1
    STOP_SEQUENCE = 2
    CANCELLED = 3
    DEADLINE_EXCEEDED = 4
    REJECTED = 5
    ERROR = 6
    SLOW_READER = 7  # its caller stopped reading; cancelled after a grace
    OUT_OF_MEMORY = 8  # the device ran out of memory during its step
    SHUTDOWN = 9  # the server stopped first: its drain's grace ran out


class ExpiredLimit(enum.IntEnum):
    """Which time limit ended a request (DEADLINE_EXCEEDED, or a
    DEADLINE_INFEASIBLE rejection): the whole-response deadline or the
    first-token deadline."""

    DEADLINE = 1
    FIRST_TOKEN = 2


class RejectCause(enum.IntEnum):
    """Why the scheduler rejected (``FinishReason.REJECTED``) a request it had
    already queued. ``service/`` maps each to a wire reject reason."""

    SHED = 1  # displaced from a full queue by a request of a more urgent class
    DEADLINE_INFEASIBLE = 2  # the cost model says it can no longer make a time limit


MAX_TOP_LOGPROBS = 20  # alternatives a token's log-probability may carry (OpenAI's bound)
MAX_PENALTY = 2.0  # presence and frequency penalties are in [-2, 2] (OpenAI's range)
# repetition_penalty is in [1/100, 100]: vLLM and Hugging Face ask only that
# it be above 0, but one of 1e38 divides or multiplies every repeated token's
# logit past float32's range (-inf for every token a constraint allows, and
# the sampler then picks outside it), and 1e-38 makes them +inf (NaN
# probabilities). Practice stays within [1, 2] (1.1-1.3 the usual).
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # a logit bias is in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one request may bias: the host rebuilds them each step
MAX_STOP_TOKEN_IDS = 64  # stop token ids one request may name: looked through per token


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is drawn. ``temperature == 0`` means greedy;
    ``top_k == 0`` and ``top_p == 1.0`` disable those filters; ``seed`` makes
    a request's draws reproducible (also across preemption). ``logprobs``
    asks for each sampled token's log-probability under the model (None:
    not wanted) and that many of the most likely alternatives with theirs
    (0: the token's alone).

    The logit adjustments, made before any of the above (greedy rows
    included), in this order (vLLM's): ``logit_bias`` adds each (token id,
    bias) pair's bias to that token's logit (ids distinct); a token of the
    prompt or generated so far has its logit divided by
    ``repetition_penalty`` where positive and multiplied where not (1: off);
    each generated token's logit loses ``frequency_penalty`` times its count
    so far and ``presence_penalty`` once (0: off). While fewer than
    ``min_tokens`` outputs are out, the request's EOS ids and
    ``stop_token_ids`` are masked out of its logits (vLLM's; a greedy row's
    too).

    ``min_p`` (vLLM's; 0: off) keeps, on a sampling row, the tokens whose
    probability after temperature is at least ``min_p`` times the
    likeliest's, before top-k and top-p (vLLM's order). Sampling one of
    ``stop_token_ids`` ends the request (``FinishReason.STOP_SEQUENCE``)
    once ``min_tokens`` outputs came before it; the scheduler decides it
    with EOS."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # A penalty, a bias or min_tokens changes this request's logits before it samples.
    # Set once here: the runners ask of every sampled row every step, and a
    # property's four tests cost ~35 us a step at 256 rows.
    has_logit_adjustments: bool = field(init=False, repr=False, compare=False)
    # min_tokens or stop ids: the scheduler's per-token stop decision asks.
    has_token_stops: bool = field(init=False, repr=False, compare=False)
    # A penalty or a bias: they adjust every step's logits (not min_tokens).
    has_penalties_or_bias: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        penalised = bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )
        object.__setattr__(self, "has_penalties_or_bias", penalised)
        object.__setattr__(self, "has_logit_adjustments", penalised or bool(self.min_tokens))
        object.__setattr__(self, "has_token_stops", bool(self.min_tokens or self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request as a caller asked for it: built once at the front door (the
    wire conversion, the HTTP front, an in-process caller), handed to the
    engine, and carried inside the scheduler's ``Request`` (``Request.spec``).
    A new caller-set field is added here and in the conversion that fills it.

    Times are absolute ``time.monotonic()`` seconds; ``arrival_time`` None
    means "when the engine takes it". ``req_id`` is unique across the engine
    (the gRPC layer prefixes the stream's id). ``first_token_deadline`` is
    the time by which the first output token must be out. ``stop_sequences``
    are matched on the text by the engine; ``tenant`` names who asked, for
    telemetry only; ``constraint`` is what the output must match. The
    scheduler reads none of the three."""

    req_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    deadline: float | None = None
    expected_output_tokens: int | None = None
    arrival_time: float | None = None
    first_token_deadline: float | None = None
    tenant: str = ""
    constraint: OutputConstraint | None = None


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: the schema's JSON
    JSON_OBJECT = "json_object"  # any JSON object; no text
    REGEX = "regex"  # text: the expression


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """What a request's output must match (``RequestSpec.constraint``): the
    engine masks every step's logits by it (service/engine/grammar.py,
    where it is compiled); the scheduler never reads it."""

    kind: ConstraintKind
    text: str = ""


@dataclass(slots=True)
class Request:
    """A generation request and its scheduling state.

    Times (``arrival_time``, ``deadline``, ...) are absolute monotonic seconds,
    converted once at the service edge; the scheduler never reads a clock.
    """

    req_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    arrival_time: float = 0.0
    deadline: float | None = None
    first_token_deadline: float | None = None
    expected_output_tokens: int | None = None

    # -- mutable scheduling state --------------------------------------
    arrival_index: int = 0  # set by Scheduler.add_request: breaks arrival-time ties
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    finish_message: str = ""
    num_preemptions: int = 0
    # Steps in which the batch shaper held it back (or its next tokens) for
    # more urgent work (batch_shaping.py): waiting that was a decision.
    num_held_back: int = 0
    first_scheduled_time: float | None = None
    last_resumed_time: float | None = None  # last admission or swap-in
    # Time spent preempted (swapped out, or queued again for recompute) up to
    # the last resume; ``preempted_since`` is set while it is preempted.
    preempted_s: float = 0.0
    preempted_since: float | None = None
    first_token_time: float | None = None
    # Prefix cache (see block_manager.py): chain hashes of the leading full
    # blocks of prompt + outputs, computed as needed; how many leading blocks
    # of ``block_ids`` are in the cache (shared hits or registered); while
    # SWAPPED, how many leading shared blocks were released instead of copied
    # (found again in the cache at swap-in); prompt tokens the first
    # admission found cached (reported as ``cached_tokens``); the cached
    # prefix the latest look-up found (estimates of a waiting request).
    block_hashes: list[bytes] = field(default_factory=list)
    num_committed_blocks: int = 0
    num_released_blocks: int = 0
    num_cached_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # What the caller asked for, when the request came through the engine
    # (requests built directly, by the simulator or a test, have none).
    spec: RequestSpec | None = None
    # Speculative decoding (speculative.py): False where each token depends
    # on the one before in a way a draft cannot carry (a constraint's mask
    # follows every token); its drafting state, made at its first decode.
    is_draftable: bool = True
    drafter: Drafter | None = None

    @classmethod
    def from_spec(
        cls, spec: RequestSpec, eos_token_ids: tuple[int, ...], arrival_time: float
    ) -> Request:
        """The scheduler's request for ``spec``: every field the two share is
        taken from it by name, so a field added to both needs no copying code."""
        shared = {name: getattr(spec, name) for name in _SHARED_FIELDS}
        shared["prompt_token_ids"] = list(spec.prompt_token_ids)
        shared["arrival_time"] = arrival_time
        draftable = spec.constraint is None
        return cls(**shared, eos_token_ids=eos_token_ids, spec=spec, is_draftable=draftable)

    def mark_resumed(self, now: float) -> None:
        """Scheduled (admitted or swapped in) at ``now``: a preemption's wait ends."""
        if self.preempted_since is not None:
            self.preempted_s += now - self.preempted_since
            self.preempted_since = None
        self.last_resumed_time = now

    def preempted_time(self, now: float) -> float:
        """Seconds spent preempted up to ``now``, the current preemption included."""
        since = self.preempted_since
        return self.preempted_s + (0.0 if since is None else now - since)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are not in the cache yet (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_known_kv_tokens(self) -> int:
        """Tokens whose K/V need no computing: the computed ones, or, while
        waiting, the cached prefix its latest look-up found (cached tokens
        cost nothing to prefill)."""
        if self.status is RequestStatus.WAITING:
            return max(self.num_computed_tokens, self.num_prefix_hit_tokens)
        return self.num_computed_tokens

    @property
    def has_scheduling_state(self) -> bool:
        """True once the scheduler has touched this record; a fresh request has none."""
        return (
            self.status is not RequestStatus.WAITING
            or self.num_computed_tokens > 0
            or bool(self.output_token_ids or self.block_ids or self.host_block_ids)
        )

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens at positions ``[start, stop)`` of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]


# The caller-set fields the scheduler plans with: those a RequestSpec and a
# Request both declare (computed, so the two lists cannot drift apart).
_SHARED_FIELDS = tuple(
    name
    for name in RequestSpec.__dataclass_fields__
    if name in Request.__dataclass_fields__ and name != "spec"
)

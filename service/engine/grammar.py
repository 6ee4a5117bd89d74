"""Structured output: a request's ``OutputConstraint`` compiled for the
model's tokenizer, and each step's mask of the tokens it allows.

llguidance (guidance-ai's grammar engine in Rust, the one vLLM and SGLang
use) does the work: a JSON Schema or a regular expression becomes a
grammar, and from the tokens so far it computes, per step, the bitmask of
the vocabulary that keeps the output a prefix of a match, with EOS set only
where the output is a whole one::

    front door, worker thread           engine thread, each step
      grammar = compiler.compile(c)       matchers of the plan's constrained rows
      spec.constraint = grammar           mask_logits(logits, ...)   runner, before its sampler
    engine.submit                         matcher.take(token)        update, per sampled token
      matcher = grammar.start()

Compiling costs from a millisecond to a second (a large schema; and, once
per model, the tokenizer's tables: 0.06 s for `tiny`'s 4,096 tokens, 1 s
for SmolLM2's 49,152), so the front doors compile off their event loop; the
latest compiled grammars are kept (``GrammarCache``), and a constraint sent
again is not compiled again. Starting a request's matcher is a copy of a
compiled one (no compiling: about a microsecond).

A step's mask is filled on the host (tens of µs a row) and applied by
``mask_logits`` with plain torch ops, on the CPU and on a GPU alike.
``llguidance.torch`` is not imported: its ``apply_token_bitmask_inplace`` is
``torch.compile``d (35 s at its first call on a CPU, and a C compiler
needed) and importing it loads TorchDynamo (7 s); its
``fill_next_token_bitmask`` is the one call ``Matcher.fill`` makes.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from slipstream.scheduler.request import ConstraintKind, OutputConstraint

# What JSON object mode compiles to: a JSON object, any keys.
JSON_OBJECT_SCHEMA = '{"type": "object"}'

# Compiled grammars kept for constraints sent again (a service sends the same
# schema with every request): a hit costs a dict lookup where compiling costs
# 0.9 ms for a typical schema and 17 ms for a 19 KB one (SmolLM2's 49,152
# tokens). A compiled schema holds some 40 to 50 times its text (19 KB: 0.75
# to 0.9 MB), so the texts kept are bounded too: 512 KiB, ~25 MB compiled.
MAX_CACHED_GRAMMARS = 64
MAX_CACHED_TEXT_BYTES = 512 * 1024

# The work a constrained row's mask may take a step. llguidance's defaults
# (200,000 lexer fuel, ~14 ms at its ~14,000 a ms; 50,000 Earley items, ~2.5
# ms at ~20,000 a ms) let one costly grammar hold up every request in its
# batch for longer than SmolLM2's whole CPU step (16-20 ms). Schemas and
# expressions met in practice (nested objects, a 19 KB schema, string
# formats and patterns, a 500-value enum, anyOf of 20 objects, recursion)
# needed under 5,000 and 2,000 over 150 steps of SmolLM2's vocabulary;
# these leave them four times that. A mask past either fails (llguidance
# allows EOS alone then) and ``Matcher.take`` raises ``ConstraintTooComplex``.
# They bound the lexer's and the parser's blow-ups, not every mask: an anyOf
# of ~200 arrays of arrays costs 15-20 ms a mask (SmolLM2) within both, until
# the items limit or llguidance's 2,000-item row stops it a step or two on.
STEP_LEXER_FUEL = 20_000  # ~1.4 ms
STEP_MAX_ITEMS = 10_000  # ~0.5 ms

# The regular expressions' size, as llguidance's lexer builds them (lazily,
# as the output goes). Its default, 1,000,000, let a tiny expression with a
# large counted repeat cost 45-300 ms a mask (``(ab){100000}``, ``a{300000}``)
# within both step limits; at 50,000 these fail at their first token after a
# 6-12 ms mask ("too many expressions constructed"), and every schema and
# expression above (a{5000} included) ran 15 requests of 200 steps without
# failing. Repeats of some 10,000 and more are refused.
INITIAL_LEXER_FUEL = 50_000

# What a request's masks may cost the engine thread (CPU time, the matcher's
# own: a thread descheduled on a loaded host is not charged). Measured on
# SmolLM2's 49,152 tokens: schemas and expressions met in practice take
# under 0.5 ms a mask on average (a 150-field schema 0.06, a{5000} 0.85),
# and at most 1.3-7.5 ms at their costliest step (a first mask, a long
# repeat); an anyOf of ~200 arrays of arrays takes 15-20 ms every step. One
# mask over ``MAX_MASK_S``, or from its ``MASKS_BEFORE_MEAN``-th mask on an
# average over ``MAX_MEAN_MASK_S``, ends the request ERROR ("constraint too
# complex") before its next step: a costly grammar slows its batch for a
# step or a few, not for its whole output.
MAX_MASK_S = 0.05
MAX_MEAN_MASK_S = 0.005
MASKS_BEFORE_MEAN = 4

# A compile's probe (on the worker, off the engine thread): the first mask,
# and the second after the first token it allows, on a copy of the matcher.
# A grammar that fails there, allows nothing, or takes over this CPU time is
# refused at once (INVALID_ARGUMENT) rather than on the engine thread.
MAX_PROBE_S = 0.05


# How much of a compiler's or a matcher's message is kept: llguidance's
# repeat the constraint (160 KB for a regex of 20,000 nested groups), and the
# message goes into a log line, a gRPC trailer (8 KB of metadata at most)
# and a 400's body.
MAX_MESSAGE_CHARS = 500


def short_message(text: str) -> str:
    """``text`` on one line (whitespace runs collapsed), cut to
    ``MAX_MESSAGE_CHARS``."""
    line = " ".join(text.split())
    if len(line) <= MAX_MESSAGE_CHARS:
        return line
    return line[: MAX_MESSAGE_CHARS - 3] + "..."


class InvalidConstraint(ValueError):
    """A constraint that does not compile, with llguidance's message
    (INVALID_ARGUMENT, a 400), cut short (``short_message``)."""

    def __init__(self, message: str) -> None:
        super().__init__(short_message(message))


class ConstraintBroken(RuntimeError):
    """A sampled token the constraint does not allow (a masked row's sampler
    picked outside its mask): a server fault, not the caller's. Its message
    is cut short (``short_message``)."""

    def __init__(self, message: str) -> None:
        super().__init__(short_message(message))


class ConstraintTooComplex(ConstraintBroken):
    """A grammar past the limits on its work (a step's mask over
    ``STEP_LEXER_FUEL`` or ``STEP_MAX_ITEMS``, its lexer's expressions over
    ``INITIAL_LEXER_FUEL``, its masks' time over ``MAX_MASK_S`` or
    ``MAX_MEAN_MASK_S``): the caller's grammar's fault, and its request's
    alone. Its message starts "constraint too complex"."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"constraint too complex: {reason}")


@dataclass(frozen=True, slots=True)
class MaskBudget:
    """The CPU time a request's masks may take (``MAX_MASK_S``, ...)."""

    max_mask_s: float = MAX_MASK_S
    max_mean_mask_s: float = MAX_MEAN_MASK_S
    masks_before_mean: int = MASKS_BEFORE_MEAN


@dataclass(frozen=True, slots=True, eq=False)
class Grammar(OutputConstraint):
    """An ``OutputConstraint`` compiled for one model's tokenizer. It stands
    in for the constraint in ``RequestSpec.constraint``, so that the engine
    does not compile again what a front door compiled off its event loop.
    ``template`` is never advanced: each request's matcher is a copy."""

    template: Any = field(kw_only=True, repr=False)  # llguidance.LLMatcher
    mask_words: int = field(kw_only=True)  # of a bitmask row: the tokenizer's vocabulary / 32
    budget: MaskBudget = field(kw_only=True, default=MaskBudget(), repr=False)

    def start(self) -> Matcher:
        """A request's matcher, at the start of its output."""
        return Matcher(self.template.deep_copy(), self.mask_words, self.budget)


class Matcher:
    """One request's place in its grammar, advanced by each sampled token
    (the engine thread's alone), and what its masks cost."""

    __slots__ = ("_budget", "_mask", "_mask_ns", "_masks", "_matcher", "_total_ns", "mask_words")

    def __init__(self, matcher: Any, mask_words: int, budget: MaskBudget = MaskBudget()) -> None:
        self._matcher = matcher
        self.mask_words = mask_words
        self._budget = budget
        self._mask: np.ndarray | None = None  # the latest mask's words, until the next fill
        self._mask_ns = 0  # the latest mask's CPU time
        self._total_ns = 0
        self._masks = 0

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into ``bitmask[row]`` (int32 words
        on the host, bit ``t % 32`` of word ``t // 32`` for token ``t``),
        timing it (the calling thread's CPU time: llguidance computes it
        there)."""
        words = bitmask[row]
        start = time.thread_time_ns()
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        self._mask_ns = time.thread_time_ns() - start
        self._total_ns += self._mask_ns
        self._masks += 1
        self._mask = words.numpy()

    def take(self, token_id: int) -> bool:
        """Advances by a sampled token; True once the output is complete
        (nothing but EOS may follow). Raises ``ConstraintTooComplex`` when
        this step's mask went past the step limits (the mask then allowed
        EOS alone, and the output is not a match: no EOS may end it as
        one), when the masks cost more than their budget, or when the lexer
        fails on a token its mask allowed (too many expressions);
        ``ConstraintBroken`` for a token the constraint does not allow."""
        matcher = self._matcher
        if matcher.is_error():  # set by this step's mask: only a limit fails one
            raise ConstraintTooComplex(
                f"it needs more work a step than allowed: {_first_line(matcher)}"
            )
        self._check_cost()
        if not matcher.consume_token(token_id):
            if self._allowed(token_id):  # the mask allowed it: the lexer gave up
                raise ConstraintTooComplex(_first_line(matcher))
            raise ConstraintBroken(_first_line(matcher))
        return bool(matcher.is_stopped())

    def _check_cost(self) -> None:
        budget = self._budget
        if self._mask_ns > budget.max_mask_s * 1e9:
            raise ConstraintTooComplex(
                f"a mask took {self._mask_ns / 1e6:.1f} ms of the engine's time "
                f"(at most {budget.max_mask_s * 1e3:g} ms)"
            )
        masks = self._masks
        if (
            masks >= budget.masks_before_mean
            and self._total_ns > budget.max_mean_mask_s * 1e9 * masks
        ):
            raise ConstraintTooComplex(
                f"its masks took {self._total_ns / masks / 1e6:.1f} ms of the engine's time "
                f"on average over {masks} steps (at most {budget.max_mean_mask_s * 1e3:g} ms)"
            )

    def _allowed(self, token_id: int) -> bool:
        """Whether the latest mask allowed ``token_id`` (False with none)."""
        mask = self._mask
        if mask is None or token_id // 32 >= len(mask):
            return False
        return bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)


class GrammarCompiler:
    """Compiles constraints for one model, and keeps the latest it compiled
    (``cached``). Thread-safe: the tokenizer's tables are built once, by the
    first compile, under a lock; a kept ``Grammar`` serves any number of
    requests at once, its template only ever copied."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Sequence[int],
        *,
        max_cached: int = MAX_CACHED_GRAMMARS,
        max_cached_bytes: int = MAX_CACHED_TEXT_BYTES,
        step_lexer_fuel: int = STEP_LEXER_FUEL,
        step_max_items: int = STEP_MAX_ITEMS,
        initial_lexer_fuel: int = INITIAL_LEXER_FUEL,
        budget: MaskBudget = MaskBudget(),
        max_probe_s: float = MAX_PROBE_S,
    ) -> None:
        self._hf_tokenizer = tokenizer
        # Any of the model's EOS ids (end of turn included) may end a whole match.
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use
        self._lock = threading.Lock()
        self._cache = GrammarCache(max_cached, max_cached_bytes)
        # verbose_errors off: an error is one line, not a dump of the parser's
        # state and the caller's schema (logged, and sent back).
        self.limits = llguidance.LLParserLimits(
            step_lexer_fuel=step_lexer_fuel,
            step_max_items=step_max_items,
            initial_lexer_fuel=initial_lexer_fuel,
            verbose_errors=False,
        )
        self.budget = budget
        self.max_probe_s = max_probe_s

    def cached(self, constraint: OutputConstraint) -> Grammar | None:
        """The compiled grammar of an equal constraint, if one is kept: a
        dict lookup, fit for an event loop."""
        return self._cache.get(constraint)

    def compile(self, constraint: OutputConstraint) -> Grammar:
        """``constraint`` compiled, or kept from an earlier compile of an
        equal one; raises ``InvalidConstraint``. A compile takes a
        millisecond to a second: keep it off an event loop (llguidance
        gives up the GIL while it works)."""
        grammar = self._cache.get(constraint)
        if grammar is None:
            try:
                grammar = self._compile(constraint)
            except InvalidConstraint:
                raise
            except Exception as exc:  # RecursionError (a schema nested thousands deep), ...
                # The caller's constraint, whatever fails on it: its request
                # alone is refused, never the stream or the server it came by.
                message = f"{constraint.kind.value} does not compile: {type(exc).__name__}: {exc}"
                raise InvalidConstraint(message) from None
            self._cache.put(grammar)
        return grammar

    def _compile(self, constraint: OutputConstraint) -> Grammar:
        grammar = _grammar_text(constraint)
        tokenizer = self._llg_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidConstraint(f"{constraint.kind.value}: {matcher.get_error().rstrip()}")
        words = (tokenizer.vocab_size + 31) // 32
        grammar = Grammar(
            constraint.kind, constraint.text, template=matcher, mask_words=words, budget=self.budget
        )
        self._probe(grammar)
        return grammar

    def _probe(self, grammar: Grammar) -> None:
        """Refuses (``InvalidConstraint``) a grammar whose first steps fail,
        allow no token, or cost more than ``max_probe_s``: its first mask,
        then its second after the first token the first allows (EOS aside),
        on a copy. A grammar that matches nothing fails its first mask; a
        huge counted repeat, its first token; both cost a step's time or
        more each that would otherwise be taken on the engine thread."""
        kind = grammar.kind.value
        matcher = grammar.start()
        copy = matcher._matcher
        bitmask = torch.zeros((1, grammar.mask_words), dtype=torch.int32)
        eos = set(self._eos_token_ids)
        start = time.thread_time_ns()
        for _ in range(2):
            matcher.fill(bitmask, 0)
            if copy.is_error():
                error = _first_line(copy)
                if error == "NoExtensionBias":  # no byte can follow: it matches nothing
                    raise InvalidConstraint(f"{kind} matches no output")
                raise InvalidConstraint(f"{kind} is too complex: {error}")
            allowed = np.flatnonzero(
                np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
            )
            if not len(allowed):
                raise InvalidConstraint(f"{kind} allows no output")
            tokens = [int(t) for t in allowed[:64] if int(t) not in eos]
            if not tokens or copy.is_stopped():
                break  # EOS alone: the empty output is the one match
            if not copy.consume_token(tokens[0]):
                raise InvalidConstraint(f"{kind} is too complex: {_first_line(copy)}")
        spent_s = (time.thread_time_ns() - start) / 1e9
        if spent_s > self.max_probe_s:
            raise InvalidConstraint(
                f"{kind} is too complex: its first masks took {spent_s * 1e3:.0f} ms "
                f"(at most {self.max_probe_s * 1e3:g} ms)"
            )

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer,  # type: ignore[arg-type]  # a fast one: the engine's is
                    eos_token=self._eos_token_ids or None,
                )
            return self._tokenizer


class GrammarCache:
    """Compiled grammars by their constraint's kind and text, the least
    recently used dropped first once more than ``max_entries`` are kept or
    their texts pass ``max_bytes`` (UTF-8). Thread-safe; failures are not
    kept (a constraint that does not compile is refused again)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[ConstraintKind, str], tuple[Grammar, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, constraint: OutputConstraint) -> Grammar | None:
        key = (constraint.kind, constraint.text)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, grammar: Grammar) -> None:
        size = len(grammar.text.encode())
        if self.max_entries < 1 or size > self.max_bytes:
            return
        key = (grammar.kind, grammar.text)
        with self._lock:
            old = self._entries.pop(key, None)  # compiled twice at once: the later stays
            if old is not None:
                self.num_bytes -= old[1]
            self._entries[key] = (grammar, size)
            self.num_bytes += size
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.num_bytes -= dropped


def _first_line(matcher: Any) -> str:
    """A matcher's error, its first line (the rest, if any, dumps state)."""
    return str(matcher.get_error()).partition("\n")[0]


def _grammar_text(constraint: OutputConstraint) -> str:
    """llguidance's grammar for ``constraint``; raises ``InvalidConstraint``
    where the text itself is wrong (its JSON, or empty)."""
    kind, text = constraint.kind, constraint.text
    if kind is ConstraintKind.JSON_OBJECT:
        return str(llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA))
    if not text:
        raise InvalidConstraint(f"{kind.value} is empty")
    if kind is ConstraintKind.REGEX:
        return str(llguidance.LLMatcher.grammar_from_regex(text))
    try:  # the JSON's own error, rather than the grammar's it would become
        json.loads(text)
    except RecursionError:  # nested deeper than Python's stack: no schema needs that
        raise InvalidConstraint("json_schema is nested too deeply") from None
    except ValueError as exc:
        raise InvalidConstraint(f"json_schema is not valid JSON: {exc}") from None
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(text))
    except ValueError as exc:
        raise InvalidConstraint(f"json_schema: {exc}") from None


def mask_logits(
    logits: torch.Tensor, sampled_req_ids: Sequence[str], matchers: Mapping[str, Matcher]
) -> None:
    """Sets to ``-inf``, in place, the logits of the tokens each constrained
    row's grammar does not allow next; other rows are left as they are.
    ``logits``: a step's sampled rows ``[len(sampled_req_ids), vocab]``, on
    the host or a GPU; ``matchers``: by request, those of the constrained
    rows (others ignored). A vocabulary wider than the tokenizer's (padded
    embeddings) has its extra tokens masked too.

    The bitmask is filled on the host, then (on a GPU) copied up without
    waiting, from pinned memory; the masking is queued behind the forward,
    so nothing here waits for the device."""
    rows = [row for row, req_id in enumerate(sampled_req_ids) if req_id in matchers]
    if not rows:
        return
    num_words = next(iter(matchers.values())).mask_words  # one tokenizer: one width
    on_device = logits.device.type != "cpu"
    bitmask = torch.empty((len(rows), num_words), dtype=torch.int32, pin_memory=on_device)
    for i, row in enumerate(rows):
        matchers[sampled_req_ids[row]].fill(bitmask, i)
    blocked = _blocked(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(blocked, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.int64, pin_memory=on_device)
    index = index.to(logits.device, non_blocking=True)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(blocked, float("-inf")))


_BITS: dict[torch.device, torch.Tensor] = {}


def _blocked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[rows, vocab]``, on ``bitmask``'s device: True where
    ``bitmask`` (int32 ``[rows, words]``) has the token's bit clear, or has
    no bit for it. On the host numpy unpacks the bits (30 µs for 8 rows of
    49,152 tokens, where torch's shifts take 3 ms)."""
    if bitmask.device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        blocked = torch.from_numpy(bits == 0)
    else:
        masks = _BITS.get(bitmask.device)
        if masks is None:  # bit i of an int32 word; 1 << 31 is the sign bit
            values = [1 << i for i in range(31)] + [-(1 << 31)]
            masks = torch.tensor(values, dtype=torch.int32).to(bitmask.device)
            _BITS[bitmask.device] = masks
        blocked = ((bitmask.unsqueeze(-1) & masks) == 0).flatten(1)
    if blocked.shape[1] >= vocab:
        return blocked[:, :vocab]
    extra = blocked.new_ones((blocked.shape[0], vocab - blocked.shape[1]))
    return torch.cat([blocked, extra], dim=1)

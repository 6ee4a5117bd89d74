"""Speculative decoding by prompt lookup: draft tokens for a decode from the
request's own tokens, with no draft model (vLLM's and SGLang's "ngram").

The draft for a sequence ``... a b c`` is what followed the most recent
earlier occurrence of its last ``n`` tokens, ``n`` from ``MAX_NGRAM`` down to
``MIN_NGRAM``, searched in prompt and output alike::

    tokens   x a b c y z ... p a b c        last 3 tokens: "a b c"
                   ^^^^^ ended at e                         ^^^^^ the suffix
    draft    tokens[e : e + k] = y z ...

A repetitive task (repeat this text, edit this code, answer from this
document) drafts well; free text rarely finds a match, and then the step is
a plain decode. The scheduler plans a drafting decode as one short query,
``[last, d1 .. dk]``; the runner verifies it and the step yields the
accepted drafts plus one token of the model's own (``scheduler.py``).

``NgramIndex`` keeps, per request, where each n-gram last ended, extended
by the tokens added since the previous look-up: a look-up costs a few
dictionary probes and the indexing of the new tokens, whatever the
sequence's length. Tokens never change once taken, so the index never has
to forget anything.

How many drafts pay (``Drafter.num_worth``). A draft token costs the step
about a prefill token's time; it is worth that only where it is likely to
be accepted. The ``i``-th draft adds a token only if it and every draft
before it are accepted: with ``p`` the chance a draft is accepted after
its predecessor was, it adds ``p**i`` tokens on average. A step making one
token a decode takes ``T / B`` per token (``B`` decodes), so the ``i``-th
draft pays where ``p**i * T / B > c`` (``c``: a draft token's cost), i.e.
``p**i`` above the step's *break-even* ``c * B / T`` (``DraftPrice``, from
the cost model). A step that holds no prefill-priced token yet also pays
once for holding one, and the first request to draft in it drafts only
where its drafts' expected tokens cover that too. On the CPU that cost is
the drafts' own, not the prefill chunks' the model fits (~1.2 ms of an
11.9 ms step of 8 smollm2 decodes, bf16, Zen 5; likely the attention
kernel's path for a sequence of several query tokens), so it is measured:
what decode steps holding drafts take beyond the model's price for their
tokens (``DraftOverhead``).

At batch 1 on a CPU a step costs about its weights' read and the
break-even is a few percent: every plausible draft pays. At batch 8 on two
cores the step is mostly arithmetic and a draft token costs about what a
decode adds to it (~0.4 ms against an 8.8 ms step, break-even ~0.4): only a
request whose drafts keep being accepted drafts, one or two tokens.

``p`` is estimated per request from its own drafts (accepted over examined:
a run of ``a`` accepted drafts that ends in a rejection examined ``a + 1``),
with recent steps weighing most and an optimistic prior (a request with no
evidence is taken at ``p = 1``); a step where it does not draft for want
of ``p`` moves the estimate back toward the prior, so a request whose text
turns repetitive later is tried again within a few steps. Pure Python: no
torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

# The longest and shortest suffix looked up: longer matches are tried first
# (they predict better); single tokens match too often to be worth a draft.
MAX_NGRAM = 4
MIN_NGRAM = 2
# What a step's evidence about a request's acceptance keeps of the older
# evidence (and of it, a step where it did not draft).
ACCEPTANCE_DECAY = 0.9


class DraftPrice(NamedTuple):
    """What drafting costs in one step and what a token is worth there:
    ``token_s`` the step's time per token it makes (without drafts),
    ``draft_s`` a draft token's, ``step_s`` what a step pays once for
    holding any (measured: ``DraftOverhead``)."""

    token_s: float
    draft_s: float
    step_s: float

    @property
    def break_even(self) -> float:
        return min(1.0, self.draft_s / self.token_s)


class NgramIndex:
    """Where each n-gram (``MIN_NGRAM``..``MAX_NGRAM`` tokens) of one token
    sequence last ended (exclusive end), over every end before the last
    token: the sequence's own suffix is never its own match."""

    __slots__ = ("_ends", "_num_indexed")

    def __init__(self) -> None:
        self._ends: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # ends 1 .. _num_indexed are in _ends

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow ``token_ids`` (the
        sequence so far: it only ever grows between calls), or none."""
        if max_tokens <= 0:
            return []
        end = len(token_ids)
        self._extend(token_ids, end - 1)
        ends = self._ends
        for n in range(min(MAX_NGRAM, end - 1), MIN_NGRAM - 1, -1):
            found = ends.get(tuple(token_ids[end - n :]))
            if found is not None:
                return token_ids[found : found + max_tokens]
        return []

    def _extend(self, token_ids: list[int], last_end: int) -> None:
        ends = self._ends
        for e in range(self._num_indexed + 1, last_end + 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, e) + 1):
                ends[tuple(token_ids[e - n : e])] = e
        self._num_indexed = max(self._num_indexed, last_end)


# Weight of the newest step in ``DraftOverhead``'s two averages.
OVERHEAD_EWMA = 0.1
# Steps planned without drafts after which one step's once-only cost is
# waived: a probe that measures it again.
DRAFT_PROBE_STEPS = 32


class DraftOverhead:
    """What a decode step holding drafts takes beyond the cost model's
    price for its tokens: the moving average of measured minus predicted
    seconds over such steps, less the same over decode steps without
    drafts (the model's own error, which both share). 0 until both have
    been seen, and never below 0."""

    __slots__ = ("_with", "_without")

    def __init__(self) -> None:
        self._with: float | None = None
        self._without: float | None = None

    def observe(self, has_drafts: bool, residual_s: float, predicted_s: float) -> None:
        """A decode-only step (no prefill chunk) that ran ``residual_s``
        seconds longer than the ``predicted_s`` its tokens cost (negative:
        shorter). A sample counts at most ``predicted_s`` either way: one
        step slowed by something else (a page fault, a busy host) moves
        the average by a bounded amount."""
        residual_s = max(-predicted_s, min(residual_s, predicted_s))
        if has_drafts:
            self._with = _blend(self._with, residual_s)
        else:
            self._without = _blend(self._without, residual_s)

    @property
    def seconds(self) -> float:
        if self._with is None or self._without is None:
            return 0.0
        return max(0.0, self._with - self._without)


def _blend(average: float | None, sample: float) -> float:
    return sample if average is None else average + OVERHEAD_EWMA * (sample - average)


class Drafter:
    """One request's drafting: its n-gram index and its acceptance so far."""

    __slots__ = ("_accepted", "_examined", "index")

    def __init__(self) -> None:
        self.index = NgramIndex()
        self._accepted = 0.0  # decayed counts (see the module)
        self._examined = 0.0

    @property
    def acceptance(self) -> float:
        """The estimated chance a draft is accepted after its predecessor was."""
        return (self._accepted + 1.0) / (self._examined + 1.0)

    def num_worth(self, max_drafts: int, price: DraftPrice | None, pays_step: bool) -> int:
        """How many drafts, up to ``max_drafts``, are each expected to add
        more than their cost at ``price`` (None: all of them): the ``i``-th
        while ``acceptance**i`` exceeds the break-even; ``pays_step``: and
        together they cover the step's once-only cost. A request whose
        acceptance makes none worth it notes a step without drafts (see the
        module)."""
        if max_drafts <= 0 or price is None:
            return max(0, max_drafts)
        p = self.acceptance
        break_even = price.break_even
        if p >= 1.0 or break_even <= 0.0:
            worth = max_drafts
        elif p <= break_even:
            worth = 0
        else:
            worth = min(max_drafts, int(math.log(break_even) / math.log(p)))
        if worth <= 0:
            self._accepted *= ACCEPTANCE_DECAY
            self._examined *= ACCEPTANCE_DECAY
            return 0
        if pays_step and price.step_s > 0.0:
            gained = sum(p**i for i in range(1, worth + 1)) * price.token_s
            if gained < worth * price.draft_s + price.step_s:
                return 0
        return worth

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """A step verified ``num_drafts`` drafts and accepted the first ``num_accepted``."""
        examined = num_accepted + (1 if num_accepted < num_drafts else 0)
        self._accepted = self._accepted * ACCEPTANCE_DECAY + num_accepted
        self._examined = self._examined * ACCEPTANCE_DECAY + examined

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
to forget anything. Pure Python: no torch.
"""

from __future__ import annotations

# The longest and shortest suffix looked up: longer matches are tried first
# (they predict better); single tokens match too often to be worth a draft.
MAX_NGRAM = 4
MIN_NGRAM = 2


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

"""Incremental detokenization with stop strings.

Text is produced token by token with ``tokenizers``' ``DecodeStream``, which
holds back bytes until a UTF-8 character is complete; a character the prompt
leaves unfinished is the output's to show, once, when it completes it. Stop
strings need a second hold-back: the longest tail of the text that could still
grow into a stop string is not released until it cannot, so a caller never
sees text that a later token turns into (part of) a stop string, and text that
begins no stop string goes out at once.

A request's first ``min_tokens`` tokens cannot end it (vLLM's): a stop
string counts only where it ends in the text of a later token, as vLLM
checks only the text new since its ``min_tokens``.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens handed to the decoder as context: enough for decoders whose
# output for a token depends on its neighbours (e.g. SentencePiece's leading
# space), small enough to cost nothing.
_CONTEXT_TOKENS = 4

# What a decoder shows for the bytes of a character it has not seen all of.
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas; detects stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop_sequences: tuple[str, ...],
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        context_ids = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._context_text = tokenizer.decode(context_ids, skip_special_tokens=True)
        # DecodeStream cannot take as context ids whose text ends in U+FFFD
        # (it would show that text again); those are decoded by hand until the
        # first text is out, then handed to a stream.
        self._stream: DecodeStream | None = None
        self._pending_ids: list[int] = []
        if self._context_text.endswith(_REPLACEMENT):
            self._pending_ids = list(context_ids)
        else:
            self._stream = DecodeStream(context_ids, skip_special_tokens=True)
        self._stops = stop_sequences
        self._max_stop_len = max((len(s) for s in stop_sequences), default=0)
        self._stops_by_head: dict[str, list[str]] = {}
        for stop in stop_sequences:
            self._stops_by_head.setdefault(stop[:1], []).append(stop)
        self._text = ""
        self._num_released = 0
        # Where the text's longest tail that begins some stop string starts:
        # the text before it is released, the tail waits for what follows.
        self._stop_prefix_start = 0
        # A stop string must end past this much text: the first min_tokens tokens'.
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._stop_floor = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """All text so far (up to, not including, a matched stop string)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Feeds one token; returns the text now safe to release (may be empty).
        After a stop string matched, ``stopped`` is true and the text ends
        right before it."""
        if self.stopped:
            return ""
        self._num_tokens += 1
        if self._stream is not None:
            piece = self._stream.step(self._tokenizer, token_id)
        else:
            piece = self._step_after_partial_character(token_id)
        if piece:
            if not self._stops:  # the common case: all of it goes out
                self._text += piece
                self._stop_prefix_start = len(self._text)
            else:
                search_from = max(0, len(self._text) - self._max_stop_len + 1)
                self._text += piece
                if self._num_tokens > self._min_tokens and self._match_stop(search_from):
                    self.stopped = True
                    return self.flush()
                self._stop_prefix_start = self._find_stop_prefix()
        if self._num_tokens <= self._min_tokens:
            self._stop_floor = len(self._text)
        releasable = self._stop_prefix_start
        if releasable <= self._num_released:
            return ""
        delta = self._text[self._num_released : releasable]
        self._num_released = releasable
        return delta

    def flush(self) -> str:
        """Releases whatever is held back (at the end of the request)."""
        delta = self._text[self._num_released :]
        self._num_released = len(self._text)
        return delta

    def _step_after_partial_character(self, token_id: int) -> str | None:
        """The new text once the prompt's unfinished tail is settled: the
        output starts where its text departs from the prompt's, so a
        character the output completes is shown once, and bytes the output
        leaves invalid stay the prompt's."""
        self._pending_ids.append(token_id)
        text = self._tokenizer.decode(self._pending_ids, skip_special_tokens=True)
        if text.endswith(_REPLACEMENT):
            return None
        start = _common_prefix_len(text, self._context_text)
        if start == len(text):
            return None
        self._stream = DecodeStream(self._pending_ids, skip_special_tokens=True)
        return text[start:]

    def _find_stop_prefix(self) -> int:
        """Where the longest tail of the text that is the start of a stop
        string begins (the text's length if none is). A tail that was no
        stop string's start cannot become one by growing, so the search
        starts at the last answer: each position fails at most once."""
        text = self._text
        start = max(self._stop_prefix_start, len(text) - self._max_stop_len + 1)
        for i in range(start, len(text)):
            stops = self._stops_by_head.get(text[i])
            if stops is not None:
                tail = text[i:]
                if any(stop.startswith(tail) for stop in stops):
                    return i
        return len(text)

    def _match_stop(self, search_from: int) -> bool:
        floor = self._stop_floor
        found = (self._text.find(s, max(search_from, floor - len(s) + 1)) for s in self._stops)
        cut = min((i for i in found if i >= 0), default=-1)
        if cut < 0:
            return False
        self._text = self._text[:cut]
        self._num_released = min(self._num_released, cut)
        return True


def _common_prefix_len(a: str, b: str) -> int:
    num = min(len(a), len(b))
    return next((i for i in range(num) if a[i] != b[i]), num)

"""Output tokens' log-probabilities in OpenAI's two shapes, from the
``TokenLogprobs`` a token event carries (one per token id).

Completions (``logprobs: k``), per chunk and for the whole answer::

    {"tokens": ["Hel", "lo"], "token_logprobs": [-0.3, -1.2],
     "top_logprobs": [{"Hel": -0.3, "He": -2.1}, ...], "text_offset": [0, 3]}

``top_logprobs[i]`` holds the k likeliest tokens and the chosen one (k + 1
at most, as OpenAI's; just the chosen one for ``logprobs: 0``, as vLLM's).
A token whose bytes are not whole UTF-8 characters (a character split over
tokens) is spelled as OpenAI's legacy endpoint spells it, ``bytes:\\xf0\\x9f``,
so distinct byte tokens stay distinct keys. ``text_offset`` indexes the
answer's text: a token's offset is that of the character its first byte
belongs to, so every part of a split character has that character's offset
(the parts of one cut off at the end of the answer have the text's length).

Chat (``logprobs: true``, ``top_logprobs: k``)::

    {"content": [{"token": "Hel", "logprob": -0.3, "bytes": [72, 101, 108],
                  "top_logprobs": [{"token": "Hel", "logprob": -0.3, "bytes": [...]}, ...]}]}

In chat, a token's text is its own bytes, decoded with U+FFFD for a partial
UTF-8 character; ``bytes`` are the raw bytes (a character split over tokens
joins back from them). -inf is -9999.0, as OpenAI's and vLLM's: JSON has no
infinity.
"""

from __future__ import annotations

import codecs
import re
from typing import TYPE_CHECKING

from slipstream.service.engine.events import TokenEvent, TokenLogprobs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LOGPROB_FLOOR = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens
_WORD_START = "\u2581"  # SentencePiece's space


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: byte-level BPE spells every byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


_BYTE_OF_CHAR = {char: byte for byte, char in _bytes_to_unicode().items()}


class TokenTexts:
    """Each token id's own text and UTF-8 bytes, read from the tokenizer once
    per id (the cache holds at most the model's vocabulary).

    Byte-level BPE (GPT-2, Llama 3, SmolLM2) spells a token's bytes in
    GPT-2's table (``Ġthe``); they map back exactly, a partial character
    included. Any other tokenizer: SentencePiece's ``<0xNN>`` is that byte,
    else the token as the tokenizer writes it alone (vLLM's reading), with
    the space of SentencePiece's ``▁`` kept. Special tokens are their own text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        decoder = self._backend.decoder
        self._is_byte_level = decoder is not None and decoder.decode(["ĠÃ©"]) == " é"
        added = self._backend.get_added_tokens_decoder()
        self._added = {token_id: token.content for token_id, token in added.items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._spellings: dict[int, str] = {}

    def of(self, token_id: int) -> tuple[str, list[int]]:
        """``token_id``'s text and bytes (a list, as the JSON carries them)."""
        known = self._cache.get(token_id)
        if known is None:
            raw = self._bytes(token_id)
            known = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return known

    def spelling(self, token_id: int) -> str:
        """``token_id`` as completions' ``tokens`` spell it: its text, or
        ``bytes:\\xNN...`` when its bytes are not whole UTF-8 characters."""
        known = self._spellings.get(token_id)
        if known is None:
            raw = bytes(self.of(token_id)[1])
            try:
                known = raw.decode()
            except UnicodeDecodeError:
                known = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
            self._spellings[token_id] = known
        return known

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        symbol = self._backend.id_to_token(token_id)
        if symbol is None:  # a row of a padded LM head: no token has it
            return b""
        if self._is_byte_level:
            if all(char in _BYTE_OF_CHAR for char in symbol):
                return bytes(_BYTE_OF_CHAR[char] for char in symbol)
            return symbol.encode()
        byte = _BYTE_FALLBACK.fullmatch(symbol)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        text = self.tokenizer.convert_tokens_to_string([symbol])
        if symbol.startswith(_WORD_START) and not text.startswith(" "):
            text = " " + text  # a decoder strips the text's first space; a token keeps its own
        return text.encode()


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class LogprobsBuilder:
    """One request's log-probabilities in its endpoint's shape: ``chunk``
    renders one event's tokens (a streamed chunk's), ``add`` keeps them for
    ``whole`` (the answer's, not streamed)."""

    def __init__(self, texts: TokenTexts, is_chat: bool) -> None:
        self._texts = texts
        self._is_chat = is_chat
        # completions' text_offset: the characters the tokens so far complete
        self._offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._kept: dict[str, list[object]] = self._empty()

    def chunk(self, event: TokenEvent) -> dict[str, list[object]]:
        rendered = self._empty()
        self._render(event, rendered)
        return rendered

    def add(self, event: TokenEvent) -> None:
        self._render(event, self._kept)

    def whole(self) -> dict[str, list[object]]:
        return self._kept

    def _empty(self) -> dict[str, list[object]]:
        if self._is_chat:
            return {"content": []}
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _render(self, event: TokenEvent, into: dict[str, list[object]]) -> None:
        # A request that asked has one per token (the engine's contract).
        for token_id, token in zip(event.token_ids, event.logprobs or (), strict=False):
            if self._is_chat:
                into["content"].append(self._chat_entry(token_id, token))
            else:
                self._completion_entry(token_id, token, into)

    def _chat_entry(self, token_id: int, token: TokenLogprobs) -> dict[str, object]:
        return {
            **self._choice(token_id, token.logprob),
            "top_logprobs": [
                self._choice(top_id, logprob)
                for top_id, logprob in zip(token.top_token_ids, token.top_logprobs, strict=True)
            ],
        }

    def _choice(self, token_id: int, logprob: float) -> dict[str, object]:
        text, raw = self._texts.of(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": raw}

    def _completion_entry(
        self, token_id: int, token: TokenLogprobs, into: dict[str, list[object]]
    ) -> None:
        text = self._texts.spelling(token_id)
        logprob = _finite(token.logprob)
        top: dict[str, float] = {}
        # Likeliest first; two ids may share a spelling: the likelier stays.
        for top_id, top_logprob in zip(token.top_token_ids, token.top_logprobs, strict=True):
            top.setdefault(self._texts.spelling(top_id), _finite(top_logprob))
        top.setdefault(text, logprob)
        into["tokens"].append(text)
        into["token_logprobs"].append(logprob)
        into["top_logprobs"].append(top)
        into["text_offset"].append(self._offset)
        # A character counts once its last byte has come.
        self._offset += len(self._utf8.decode(bytes(self._texts.of(token_id)[1])))

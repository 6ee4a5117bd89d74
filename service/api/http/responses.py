"""OpenAI response bodies: whole completions and server-sent-event chunks.

A streamed token costs one ``json.dumps`` of its text: each chunk is a
prefix and a suffix fixed for the request around that encoded delta (and,
for a request that asked, a second around its log-probabilities).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from slipstream.scheduler.request import FinishReason
from slipstream.service.engine.events import FinishEvent

DONE = b"data: [DONE]\n\n"
# Finishes that are a complete answer, and OpenAI's name for each.
OPENAI_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.MAX_TOKENS: "length",
}


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def usage(event: FinishEvent) -> dict[str, int]:
    return {
        "prompt_tokens": event.num_prompt_tokens,
        "completion_tokens": event.num_output_tokens,
        "total_tokens": event.num_prompt_tokens + event.num_output_tokens,
    }


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every body of one response shares."""

    id: str
    created: int
    model: str
    is_chat: bool

    @classmethod
    def new(cls, model: str, is_chat: bool) -> Envelope:
        prefix = "chatcmpl" if is_chat else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, is_chat)

    def head(self, chunk: bool) -> dict[str, object]:
        if self.is_chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def completion(
        self, text: str, event: FinishEvent, logprobs: object = None
    ) -> dict[str, object]:
        """The whole answer (no streaming); ``logprobs`` as ``LogprobsBuilder.whole``."""
        choice: dict[str, object] = {"index": 0}
        if self.is_chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = OPENAI_FINISH[event.reason]
        return {**self.head(False), "choices": [choice], "usage": usage(event)}


class ChunkEncoder:
    """SSE lines of one streamed response."""

    def __init__(self, envelope: Envelope, include_usage: bool) -> None:
        self._envelope = envelope
        self._include_usage = include_usage
        head = _dumps(envelope.head(True))[:-1]
        key = "delta" if envelope.is_chat else "text"
        self._prefix = f'data: {head},"choices":[{{"index":0,"{key}":'.encode()
        if envelope.is_chat:
            self._prefix += b'{"content":'
        tail = "}" if envelope.is_chat else ""
        usage_null = ',"usage":null' if include_usage else ""
        end = f',"finish_reason":null}}]{usage_null}}}\n\n'.encode()
        self._suffix = f'{tail},"logprobs":null'.encode() + end
        self._logprobs_infix = f'{tail},"logprobs":'.encode()
        self._logprobs_end = end

    def first(self) -> bytes:
        """Chat's opening chunk carries the role; completions have none."""
        if not self._envelope.is_chat:
            return b""
        delta = {"role": "assistant", "content": ""}
        return self._line([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def token(self, text: str, logprobs: object = None) -> bytes:
        """A chunk of ``text``; ``logprobs`` (``LogprobsBuilder.chunk``) where asked."""
        if logprobs is None:
            return self._prefix + _dumps(text).encode() + self._suffix
        head = self._prefix + _dumps(text).encode() + self._logprobs_infix
        return head + _dumps(logprobs).encode() + self._logprobs_end

    def finish(self, text: str, event: FinishEvent) -> bytes:
        """The last chunk (held-back text, finish reason), usage if asked, [DONE]."""
        key = "delta" if self._envelope.is_chat else "text"
        delta: object = {"content": text} if self._envelope.is_chat else text
        if self._envelope.is_chat and not text:
            delta = {}
        choice = {"index": 0, key: delta, "logprobs": None}
        choice["finish_reason"] = OPENAI_FINISH[event.reason]
        out = self._line([choice])
        if self._include_usage:
            out += self._line([], usage(event))
        return out + DONE

    def _line(self, choices: list[dict[str, object]], usage: object = None) -> bytes:
        body = {**self._envelope.head(True), "choices": choices}
        if self._include_usage:
            body["usage"] = usage
        return f"data: {_dumps(body)}\n\n".encode()


def error_line(body: dict[str, object]) -> bytes:
    """A failure after the stream began (OpenAI's SDKs raise on it)."""
    return f"data: {_dumps(body)}\n\n".encode()

"""OpenAI response bodies: whole completions and server-sent-event chunks.

A request of ``n`` choices per prompt numbers them as OpenAI and vLLM do:
choice ``prompt_index * n + sample_index``.

A streamed token costs one ``json.dumps`` of its text: each chunk is a
prefix (one per choice) and a suffix fixed for the request around that
encoded delta (and, for a request that asked, a second around its
log-probabilities).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slipstream.scheduler.request import FinishReason
from slipstream.service.api.http.tool_output import Piece
from slipstream.service.engine.events import FinishEvent

DONE = b"data: [DONE]\n\n"
# Finishes that are a complete answer, and OpenAI's name for each.
OPENAI_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.MAX_TOKENS: "length",
}


def finish_reason(event: FinishEvent, has_tool_calls: bool = False) -> str:
    """OpenAI's name for a complete answer's finish: ``"tool_calls"`` where
    the answer called a function and was not cut off (``has_tool_calls``:
    its calls are whole; a stop string, a stop token id or ``max_tokens``
    that cut one short gives the request's own reason)."""
    reason = OPENAI_FINISH[event.reason]
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def usage(finishes: Sequence[FinishEvent], n: int = 1) -> dict[str, int]:
    """Every choice's output, and each prompt once (the first of its ``n``)."""
    num_prompt_tokens = sum(event.num_prompt_tokens for event in finishes[::n])
    num_output_tokens = sum(event.num_output_tokens for event in finishes)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
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
        self,
        texts: Sequence[str],
        finishes: Sequence[FinishEvent],
        logprobs: Sequence[object],
        n: int = 1,
        messages: Sequence[dict[str, object]] | None = None,
        has_tool_calls: Sequence[bool] | None = None,
    ) -> dict[str, object]:
        """The whole answer (no streaming), a choice per text in index order;
        ``logprobs`` as ``LogprobsBuilder.whole`` (or None), one per choice;
        chat's ``messages`` where tool calling made them (``ToolReply``),
        and which of them hold whole calls (``has_tool_calls``)."""
        choices = []
        for index, (text, event, chosen) in enumerate(zip(texts, finishes, logprobs, strict=True)):
            choice: dict[str, object] = {"index": index}
            has_calls = False
            if messages is not None:
                choice["message"] = messages[index]
                has_calls = has_tool_calls is not None and has_tool_calls[index]
            elif self.is_chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = chosen
            choice["finish_reason"] = finish_reason(event, has_calls)
            choices.append(choice)
        return {**self.head(False), "choices": choices, "usage": usage(finishes, n)}


class ChunkEncoder:
    """SSE lines of one streamed response of ``num_choices`` choices."""

    def __init__(self, envelope: Envelope, include_usage: bool, num_choices: int = 1) -> None:
        self._envelope = envelope
        self._include_usage = include_usage
        head = _dumps(envelope.head(True))[:-1]
        key = "delta" if envelope.is_chat else "text"
        opening = '{"content":' if envelope.is_chat else ""
        self._prefixes = [
            f'data: {head},"choices":[{{"index":{index},"{key}":{opening}'.encode()
            for index in range(num_choices)
        ]
        tail = "}" if envelope.is_chat else ""
        usage_null = ',"usage":null' if include_usage else ""
        end = f',"finish_reason":null}}]{usage_null}}}\n\n'.encode()
        self._suffix = f'{tail},"logprobs":null'.encode() + end
        self._logprobs_infix = f'{tail},"logprobs":'.encode()
        self._logprobs_end = end

    def first(self, index: int = 0, content: str | None = "") -> bytes:
        """Chat's opening chunk of a choice carries the role (and ``content``:
        null where the answer is a call alone); completions have none."""
        if not self._envelope.is_chat:
            return b""
        delta = {"role": "assistant", "content": content}
        return self._line(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def token(self, text: str, logprobs: object = None, index: int = 0) -> bytes:
        """A chunk of choice ``index``'s ``text``; ``logprobs``
        (``LogprobsBuilder.chunk``) where asked."""
        if logprobs is None:
            return self._prefixes[index] + _dumps(text).encode() + self._suffix
        head = self._prefixes[index] + _dumps(text).encode() + self._logprobs_infix
        return head + _dumps(logprobs).encode() + self._logprobs_end

    def pieces(self, pieces: Sequence[Piece], logprobs: object = None, index: int = 0) -> bytes:
        """Chat chunks of a tool-calling choice's pieces (``tool_output``), a
        chunk for each run of content or of calls; ``logprobs`` on the first,
        on a chunk of its own where the reader held the text back."""
        deltas: list[dict[str, object]] = []
        for piece in pieces:
            if isinstance(piece, str):
                if deltas and "content" in deltas[-1]:
                    deltas[-1]["content"] += piece  # type: ignore[operator]
                else:
                    deltas.append({"content": piece})
            elif deltas and "tool_calls" in deltas[-1]:
                calls: list[dict[str, Any]] = deltas[-1]["tool_calls"]  # type: ignore[assignment]
                if piece.id is None and calls[-1]["index"] == piece.index:  # one call's, merged
                    calls[-1]["function"]["arguments"] += piece.arguments
                else:
                    calls.append(piece.wire())
            else:
                deltas.append({"tool_calls": [piece.wire()]})
        if not deltas and logprobs is not None:
            deltas.append({})
        lines = []
        for delta in deltas:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            lines.append(self._line([choice]))
            logprobs = None
        return b"".join(lines)

    def finish(
        self, text: str, event: FinishEvent, index: int = 0, reason: str | None = None
    ) -> bytes:
        """A choice's last chunk: held-back text and its finish reason
        (``reason`` where tool calling chose it)."""
        key = "delta" if self._envelope.is_chat else "text"
        delta: object = {"content": text} if self._envelope.is_chat else text
        if self._envelope.is_chat and not text:
            delta = {}
        choice = {"index": index, key: delta, "logprobs": None}
        choice["finish_reason"] = reason or OPENAI_FINISH[event.reason]
        return self._line([choice])

    def end(self, finishes: Sequence[FinishEvent], n: int = 1) -> bytes:
        """After every choice's finish: usage if asked, then [DONE]."""
        if not self._include_usage:
            return DONE
        return self._line([], usage(finishes, n)) + DONE

    def _line(self, choices: list[dict[str, object]], usage: object = None) -> bytes:
        body = {**self._envelope.head(True), "choices": choices}
        if self._include_usage:
            body["usage"] = usage
        return f"data: {_dumps(body)}\n\n".encode()


def error_line(body: dict[str, object]) -> bytes:
    """A failure after the stream began (OpenAI's SDKs raise on it)."""
    return f"data: {_dumps(body)}\n\n".encode()

"""OpenAI's tool calls read from a choice's output as it comes, the reply's
side of tool calling (the request's is tools.py). One reader per choice,
fed each event's text; what it gives back is content text or a piece of a
tool call, streamed as it is (``delta.tool_calls``) or gathered into one
message (``ToolReply``), so both answers hold the same::

    reader.feed(text)  -> [piece, ...]    each token event's text
    reader.finish()    -> [piece, ...]    after the finish event's own text
    reader.is_cut()    -> bool            after finish: the output ended inside a call

    NamedReader      the output is the named function's arguments
    RequiredReader   the output is [{"name": ..., "parameters": {...}}, ...]
    HermesReader     "auto": <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                     blocks in the text (Qwen2.5's, Hermes'), text outside them content

The first piece of a call carries its id and name; its arguments follow
as they come (named, required) or whole once its block closes (auto).
A constrained output (named, required) may end before its grammar's end
(``max_tokens``, a stop string, a stop token id: the engine reports a
complete one as stopped at a stop sequence too), its last call's arguments
then cut short; an output is whole where it is JSON (a proper prefix of an
object or array never is). "auto" hands out whole blocks alone.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from slipstream.service.api.http.tools import ToolChoice, Tools

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of the ``index``-th tool call: ``id`` and ``name`` on its
    first, then more of its ``arguments`` (JSON text)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def wire(self) -> dict[str, object]:
        """As OpenAI streams it in ``delta.tool_calls``."""
        function: dict[str, object] = {"arguments": self.arguments}
        out: dict[str, object] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            function = {"name": self.name, **function}
        out["function"] = function
        return out


Piece = str | ToolCallDelta


class Reader(Protocol):
    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...

    def is_cut(self) -> bool: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def readers_for(tools: Tools | None, num_choices: int) -> list[Reader] | None:
    """A reader for each choice; None where the output is plain text."""
    if tools is None or tools.choice is ToolChoice.NONE:
        return None
    return [_reader(tools) for _ in range(num_choices)]


def _reader(tools: Tools) -> Reader:
    if tools.choice is ToolChoice.NAMED:
        assert tools.named is not None
        return NamedReader(tools.named)
    if tools.choice is ToolChoice.REQUIRED:
        return RequiredReader()
    return HermesReader(tools.names)


class NamedReader:
    """The whole output is one call's arguments (constrained to them)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._is_open = False
        self._parts: list[str] = []

    def feed(self, text: str) -> list[Piece]:
        self._parts.append(text)
        if not self._is_open:
            self._is_open = True
            return [ToolCallDelta(0, text, new_call_id(), self._name)]
        return [ToolCallDelta(0, text)] if text else []

    def finish(self) -> list[Piece]:
        return [] if self._is_open else self.feed("")

    def is_cut(self) -> bool:
        return not _is_json("".join(self._parts))


# An item's head in "required"'s array (after the one before's closing
# brace, if it has come), up to its parameters' value.
_ITEM_HEAD = re.compile(
    r'\s*(?:\}\s*)?[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*'
)


class RequiredReader:
    """The output is a JSON array of ``{"name": ..., "parameters": ...}``
    (constrained to it, the name first): each item's head opens a call, the
    text of its parameters is that call's arguments, streamed as it comes."""

    def __init__(self) -> None:
        self._text = ""
        self._head_at = 0  # where the next item's head starts
        self._value: ValueEnd | None = None  # the open call's parameters
        self._sent = 0  # the text sent as arguments so far ends here
        self._index = -1

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        out: list[Piece] = []
        while True:
            if self._value is None:
                head = _ITEM_HEAD.match(self._text, self._head_at)
                if head is None:
                    return out
                self._index += 1
                name = json.loads(f'"{head.group(1)}"')
                out.append(ToolCallDelta(self._index, "", new_call_id(), name))
                self._value = ValueEnd(head.end())
                self._sent = head.end()
                continue
            end = self._value.scan(self._text)
            self._sent = max(self._sent, self._value.start)
            stop = len(self._text) if end is None else end
            if stop > self._sent:
                out.append(ToolCallDelta(self._index, self._text[self._sent : stop]))
                self._sent = stop
            if end is None:
                return out
            self._head_at = end
            self._value = None

    def finish(self) -> list[Piece]:
        return []  # a cut-off call keeps the arguments it has

    def is_cut(self) -> bool:
        return self._index >= 0 and not _is_json(self._text)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    except RecursionError:  # nested past Python's stack: the grammar saw it through
        return True
    return True


_IN_STRING = re.compile(r'["\\]')
_OUTSIDE_STRING = re.compile(r'["{}\[\],\s]')


class ValueEnd:
    """Where a JSON value that starts at ``start`` of a growing text ends,
    each character looked at once (the text is valid JSON so far: the
    grammar saw to it). Whitespace before the value is no part of it."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._at = start  # scanned up to here
        self._depth = 0
        self._is_in_string = False
        self._has_begun = False

    def scan(self, text: str) -> int | None:
        """The value's end in ``text`` (its whole so far), or None before."""
        while self._at < len(text):
            if self._is_in_string:
                found = _IN_STRING.search(text, self._at)
                if found is None:
                    self._at = len(text)
                    return None
                if found.group() == "\\":
                    self._at = found.end() + 1  # past the escaped character, come or to come
                    continue
                self._is_in_string = False
                self._at = found.end()
                if self._depth == 0:
                    return self._at
                continue
            found = _OUTSIDE_STRING.search(text, self._at)
            if found is None or found.start() > self._at:  # a number, true, false or null
                self._has_begun = True
            if found is None:
                self._at = len(text)
                return None
            char = found.group()
            if char.isspace() or char == ",":
                if self._depth == 0 and self._has_begun:
                    return found.start()
                if not self._has_begun:  # whitespace before the value
                    self.start = found.end()
            elif char == '"':
                self._is_in_string = self._has_begun = True
            elif char in "{[":
                self._depth += 1
                self._has_begun = True
            elif self._depth == 0:  # the brace after a number, true, false or null
                return found.start()
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._at = found.end()
                    return self._at
            self._at = found.end()
        return None


class HermesReader:
    """``<tool_call>`` blocks parsed out of free text. A block whose JSON is
    not ``{"name": one of the tools, "arguments": {...}}`` stays in the
    content as written; one left open at the end counts if its JSON is
    whole. Whitespace between blocks (and around them) is dropped; text
    that could still become an opening tag, or whitespace before one, is
    held back until the next text shows which."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = frozenset(names)
        self._text = ""  # not handed out yet
        self._is_inside = False
        self._scanned = 0  # an open block's text holds no closing tag before this
        self._gap = ""  # the whitespace before the open block, if it turns out text
        self._after_call = False  # whitespace after a call is dropped
        self._index = 0

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        return self._drain(is_final=False)

    def finish(self) -> list[Piece]:
        return self._drain(is_final=True)

    def is_cut(self) -> bool:
        return False  # a block cut off stays content

    def _drain(self, is_final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self._is_inside:
                end = self._text.find(CLOSE, self._scanned)
                if end < 0 and not is_final:
                    self._scanned = max(0, len(self._text) - len(CLOSE) + 1)
                    return out
                self._scanned = 0
                closed = end >= 0
                body = self._text[:end] if closed else self._text
                self._text = self._text[end + len(CLOSE) :] if closed else ""
                self._is_inside = False
                call = self._call(body)
                if call is None:
                    self._content(out, self._gap + OPEN + body + (CLOSE if closed else ""))
                else:
                    out.append(ToolCallDelta(self._index, call[1], new_call_id(), call[0]))
                    self._index += 1
                    self._after_call = True
                continue
            start = self._text.find(OPEN)
            if start >= 0:
                before = self._text[:start]
                text = before.rstrip()
                self._gap = before[len(text) :]
                self._content(out, text)
                self._text = self._text[start + len(OPEN) :]
                self._is_inside = True
                continue
            keep = 0 if is_final else _held(self._text)
            self._content(out, self._text[: len(self._text) - keep])
            self._text = self._text[len(self._text) - keep :]
            return out

    def _content(self, out: list[Piece], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        if text:
            out.append(text)

    def _call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of a block, or None for one that
        is not a call of a function offered: its JSON is not an object whose
        name is a string naming one and whose arguments are an object of
        JSON's own values (no NaN or Infinity, which Python's parser takes)."""
        value = _strict_json(body)
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        if not (isinstance(name, str) and name in self._names):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write them as JSON text
            arguments = _strict_json(arguments)
        if not isinstance(arguments, dict):
            return None
        try:  # a number past float's range (1e999) is read as infinity
            return name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except ValueError:
            return None


def _strict_json(text: str) -> object:
    """The JSON value ``text`` holds, or None where it holds none (or holds
    NaN or Infinity)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _held(text: str) -> int:
    """How much of ``text``'s end to hold back: a start of ``OPEN``, and
    the whitespace before it (dropped if a block opens there)."""
    keep = next(
        (k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:k])), 0
    )
    start = len(text) - keep
    while start > 0 and text[start - 1].isspace():
        start -= 1
    return len(text) - start


@dataclass(slots=True)
class ToolReply:
    """A choice's pieces gathered into one message (no streaming);
    ``is_call_only`` where the output is calls alone (named, required)."""

    is_call_only: bool = False
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, pieces: Iterable[Piece]) -> None:
        for piece in pieces:
            if isinstance(piece, str):
                self.content.append(piece)
            elif piece.id is not None:
                function = {"name": piece.name, "arguments": piece.arguments}
                self.calls.append({"id": piece.id, "type": "function", "function": function})
            else:
                self.calls[piece.index]["function"]["arguments"] += piece.arguments

    def message(self) -> dict[str, object]:
        """OpenAI's assistant message: content null where calls alone came."""
        text = "".join(self.content)
        message: dict[str, object] = {"role": "assistant", "content": text}
        if self.calls or self.is_call_only:
            message["content"] = text or None
        if self.calls:
            message["tool_calls"] = self.calls
        return message

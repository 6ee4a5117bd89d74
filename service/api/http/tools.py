"""OpenAI's tool calling on the chat endpoint, the request's side: ``tools``,
``tool_choice`` and ``parallel_tool_calls`` checked, the earlier calls a
conversation carries, and the JSON schema a constraining choice compiles
to (the reply's side is tool_output.py)::

    tool_choice               the prompt        the output
    "none"                    tools rendered    as without tools
    "auto" (the default)      tools rendered    <tool_call> blocks parsed (hermes)
    "required"                tools rendered    constrained: [{"name", "parameters"}, ...]
    {"type": "function",      tools rendered    constrained: that function's parameters
     "function": {"name": N}}

"required" and a named function are vLLM's: the output follows a JSON
schema (llguidance, as ``response_format``), so they work with any model.
Their grammars are compact (no free whitespace: a model cannot ramble in
it) and objects allow only the keys their schema lets them.

Each function's parameters are turned into JSON text once, when the request
is parsed (one C-level pass; a Python walk of a 5 MiB schema took seconds on
the event loop): its size, its nesting and its Unicode are checked on that
text, and the schema a constrained choice compiles is put together from it.
"required"'s schema holds each function's parameters as a schema resource
of its own (``$id``), so their ``$ref``s (pointers from their own root,
anchors) resolve as they do alone, and nothing in them is rewritten::

    {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"properties": {"name": {"const": "f"},
                        "parameters": {"$ref": "urn:slipstream:tool:0"}}, ...},
        ...]},
     "$defs": {"0": {"$id": "urn:slipstream:tool:0", <f's parameters>}, ...}}
"""

from __future__ import annotations

import array
import itertools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from slipstream.service.api.http.errors import invalid, valid_unicode
from slipstream.service.api.http.response_format import NAME
from slipstream.service.api.http.response_format import PARAM as RESPONSE_FORMAT
from slipstream.service.api.wire import utf8_len
from slipstream.service.engine.chat import ToolCall
from slipstream.v1 import inference_pb2 as pb

PARAM = "tools"
CHOICE_PARAM = "tool_choice"
PARALLEL_PARAM = "parallel_tool_calls"
FIELDS = frozenset({PARAM, CHOICE_PARAM, PARALLEL_PARAM})
MAX_TOOLS = 128  # OpenAI's
# Arrays and objects within one another in a function's parameters or an
# earlier call's arguments, at most: far more than schemas need, and far
# below what the chat template's recursive copy of them survives (~490).
MAX_NESTING = 128
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
# llguidance's JSON options: one way to write each value, as json.dumps does.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_GUIDANCE: dict[str, object] = {"x-guidance": _COMPACT}
# The i-th function's parameters as a schema resource in "required"'s.
_RESOURCE = "urn:slipstream:tool:{}"
# A function without parameters takes none.
_NO_PARAMETERS: dict[str, object] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


class ToolChoice(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "function"


@dataclass(frozen=True, slots=True, eq=False)
class Tools:
    """A request's functions (as sent, for the chat template) and what it
    asks of the output. ``named``: the function a NAMED choice calls."""

    definitions: tuple[dict[str, object], ...]
    names: tuple[str, ...]
    # Each function's parameters as JSON text (``_NO_PARAMETERS`` without).
    parameters_texts: tuple[str, ...]
    choice: ToolChoice
    named: str | None = None
    is_parallel: bool = True

    @property
    def is_constrained(self) -> bool:
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def parameters(self, name: str) -> dict[str, object]:
        function = self.definitions[self.names.index(name)]["function"]
        assert isinstance(function, dict)
        parameters = function.get("parameters")
        return _NO_PARAMETERS if parameters is None else parameters  # type: ignore[return-value]

    def schema(self) -> str | None:
        """The JSON schema the output follows (None: not constrained). A
        named function: its parameters. Required: an array of at least one
        (one alone without parallel calls) ``{"name", "parameters"}``, vLLM's
        shape, the name first."""
        if self.choice is ToolChoice.NAMED:
            assert self.named is not None
            i = self.names.index(self.named)
            return _with_keys(self.parameters_texts[i], self.parameters(self.named), _GUIDANCE)
        if self.choice is not ToolChoice.REQUIRED:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "parameters": {"$ref": _RESOURCE.format(i)},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for i, name in enumerate(self.names)
        ]
        schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.is_parallel:
            schema["maxItems"] = 1
        head = _dumps({**schema, **_GUIDANCE})
        resources = ", ".join(
            f'"{i}": {_resource(i, text, self.parameters(name))}'
            for i, (name, text) in enumerate(zip(self.names, self.parameters_texts, strict=True))
        )
        return f'{head[:-1]}, "$defs": {{{resources}}}}}'

    def num_bytes(self, text_len: Callable[[str], int]) -> int:
        """The functions' size as the template is given them, each as JSON
        text measured by ``text_len`` (UTF-8 bytes, characters): their
        parameters' text, and the rest (small) written out."""
        num_bytes = 0
        for tool, text in zip(self.definitions, self.parameters_texts, strict=True):
            function = tool["function"]
            assert isinstance(function, dict)
            rest = {key: value for key, value in function.items() if key != "parameters"}
            num_bytes += text_len(_dumps({"type": "function", "function": rest})) + text_len(text)
        return num_bytes


def parse_tools(body: Mapping[str, object]) -> Tools | None:
    """The request's tools, or None without any; raises ``ApiError`` (400)
    naming the field at fault."""
    tools = body.get(PARAM)
    if tools is None:
        for name in (CHOICE_PARAM, PARALLEL_PARAM):
            if body.get(name) is not None:
                raise invalid(f"{name} is only allowed when tools are given", name)
        return None
    if not isinstance(tools, list) or not tools:
        raise invalid("tools must be a non-empty list of functions", PARAM)
    if len(tools) > MAX_TOOLS:
        raise invalid(f"tools has {len(tools)} functions, more than the {MAX_TOOLS} allowed", PARAM)
    definitions = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = tuple(tool["function"]["name"] for tool in definitions)  # type: ignore[index]
    texts = tuple(_parameters_text(tool, f"tools[{i}]") for i, tool in enumerate(definitions))
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools[{i}].function.name {name!r} is given twice", PARAM)
    parallel = body.get(PARALLEL_PARAM)
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(f"{PARALLEL_PARAM} must be a boolean", PARALLEL_PARAM)
    choice, named = _choice(body.get(CHOICE_PARAM), names)
    return Tools(definitions, names, texts, choice, named, parallel is not False)


def check_tools(tools: Tools, max_schema_bytes: int) -> None:
    """Each function's parameters within the server's limit on a
    constraint's schema (``Limits.max_constraint_bytes``), as
    ``response_format``'s; raises ``ApiError`` (400) naming the first over."""
    for i, text in enumerate(tools.parameters_texts):
        num_bytes = utf8_len(text)
        if num_bytes > max_schema_bytes:
            message = (
                f"tools[{i}].function.parameters is {num_bytes} bytes, over this server's "
                f"limit of {max_schema_bytes}"
            )
            raise invalid(message, PARAM)


def set_tool_constraint(tools: Tools | None, body: Mapping[str, object], submit: pb.Submit) -> None:
    """Sets ``submit.constraint`` where ``tools`` ask for a call; raises
    ``ApiError`` (400) where ``response_format`` asks for another output."""
    schema = None if tools is None else tools.schema()
    if schema is None:
        return
    if submit.HasField("constraint"):
        message = (
            "response_format cannot be combined with tool_choice required or a named "
            "function: the output is the call's JSON"
        )
        raise invalid(message, RESPONSE_FORMAT)
    submit.constraint.json_schema = schema


def _tool(tool: object, where: str) -> dict[str, object]:
    """One function, as given (nulls dropped); checked."""
    if not isinstance(tool, dict):
        raise invalid(f"{where} must be an object", PARAM)
    tool = {key: value for key, value in tool.items() if value is not None}
    unknown = set(tool) - _TOOL_KEYS
    if unknown:
        raise invalid(f"{where}.{sorted(unknown)[0]} is not supported", PARAM)
    if tool.get("type") != "function":
        raise invalid(f"{where}.type must be 'function'", PARAM)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function must be an object", PARAM)
    function = {key: value for key, value in function.items() if value is not None}
    unknown = set(function) - _FUNCTION_KEYS
    if unknown:
        raise invalid(f"{where}.function.{sorted(unknown)[0]} is not supported", PARAM)
    name = function.get("name")
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        message = (
            f"{where}.function.name is required: at most 64 letters, digits, underscores or dashes"
        )
        raise invalid(message, PARAM)
    if not isinstance(function.get("description", ""), str):
        raise invalid(f"{where}.function.description must be a string", PARAM)
    if not isinstance(function.get("strict", False), bool):
        raise invalid(f"{where}.function.strict must be a boolean", PARAM)
    if not isinstance(function.get("parameters", {}), dict):
        raise invalid(f"{where}.function.parameters must be a JSON Schema object", PARAM)
    valid_unicode(function.get("description", ""), f"{where}.function", PARAM)
    return {"type": "function", "function": function}


def _parameters_text(tool: dict[str, object], where: str) -> str:
    """A checked function's parameters as JSON text (no lone surrogate may
    reach the template or the compiler; nested within ``MAX_NESTING``)."""
    function = tool["function"]
    assert isinstance(function, dict)
    parameters = function.get("parameters", _NO_PARAMETERS)
    message = f"{where}.function.parameters nests arrays or objects more than {MAX_NESTING} deep"
    try:
        text = _dumps(parameters)
    except RecursionError:  # near the body parser's own limit (Python's stack)
        raise invalid(message, PARAM) from None
    if nests_deeper(text, MAX_NESTING):
        raise invalid(message, PARAM)
    valid_unicode(text, f"{where}.function", PARAM)
    return text


def _choice(choice: object, names: tuple[str, ...]) -> tuple[ToolChoice, str | None]:
    if choice is None:  # OpenAI's default where tools are given
        return ToolChoice.AUTO, None
    if isinstance(choice, str):
        if choice in ("none", "auto", "required"):
            return ToolChoice(choice), None
        message = (
            f"tool_choice must be none, auto, required or "
            f'{{"type": "function", "function": {{"name": ...}}}}, not {choice[:32]!r}'
        )
        raise invalid(message, CHOICE_PARAM)
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (
        isinstance(choice, dict)
        and set(choice) <= {"type", "function"}
        and choice.get("type") == "function"
        and isinstance(function, dict)
        and set(function) == {"name"}
        and isinstance(function["name"], str)
    ):
        message = 'a named tool_choice is {"type": "function", "function": {"name": ...}}'
        raise invalid(message, CHOICE_PARAM)
    name = function["name"]
    if name not in names:
        raise invalid(
            f"tool_choice names function {name[:64]!r}, which is not in tools", CHOICE_PARAM
        )
    return ToolChoice.NAMED, name


def message_tool_calls(value: object, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``, as OpenAI's replies hold them."""
    if not isinstance(value, list):
        raise invalid(f"{where}.tool_calls must be a list", "messages")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and isinstance(function, dict)):
            raise invalid(f"{at} must be an object with a function", "messages")
        if call.get("type", "function") != "function":
            raise invalid(f"{at}.type must be 'function'", "messages")
        call_id, name = call.get("id"), function.get("name")
        arguments = function.get("arguments", "{}")
        for key, value_ in (
            ("id", call_id),
            ("function.name", name),
            ("function.arguments", arguments),
        ):
            if not isinstance(value_, str):
                raise invalid(f"{at}.{key} must be a string", "messages")
        if nests_deeper(arguments, MAX_NESTING):  # the template is given them decoded
            message = (
                f"{at}.function.arguments nests arrays or objects more than {MAX_NESTING} deep"
            )
            raise invalid(message, "messages")
        calls.append(ToolCall(call_id, name, arguments))  # type: ignore[arg-type]
    return tuple(calls)


def _resource(i: int, text: str, parameters: dict[str, object]) -> str:
    """The i-th function's parameters (``text``) as a schema resource of
    its own: their ``$ref``s resolve against their own root. Parameters with
    an ``$id`` of their own are one already, kept whole inside ours."""
    resource: dict[str, object] = {"$id": _RESOURCE.format(i)}
    if "$id" not in parameters:
        return _with_keys(text, parameters, resource)
    return _with_keys(text, {}, {**resource, "$ref": "#/$defs/parameters"}, inside="parameters")


def _with_keys(
    text: str, value: Mapping[str, object], keys: Mapping[str, object], inside: str | None = None
) -> str:
    """The JSON object ``text`` (of ``value``) with ``keys`` added, which
    take the place of its own; ``inside``: ``{**keys, "$defs": {inside: text}}``
    instead, the object kept whole."""
    if inside is not None:
        return f'{_dumps(keys)[:-1]}, "$defs": {{{_dumps(inside)}: {text}}}}}'
    if keys.keys() & value.keys():  # a key given twice: written out again (rare)
        return _dumps({**value, **keys})
    added = _dumps(keys)[1:-1]
    return f"{{{added}}}" if text == "{}" else f"{{{added}, {text[1:]}"


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 in, -1 out (signed)
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[{]}"))


def nests_deeper(text: str, limit: int) -> bool:
    """Whether the JSON ``text`` nests arrays and objects more than
    ``limit`` deep: the running sum of its brackets' steps (strings and the
    rest dropped first), all of it C-level work (~0.15 s for 5 MiB of
    brackets). Text that is not JSON is measured by its brackets as they
    come."""
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _STRING.sub("", text).encode().translate(_STEPS, _NOT_BRACKETS)
    return max(itertools.accumulate(array.array("b", brackets)), default=0) > limit


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)

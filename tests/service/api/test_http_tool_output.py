"""The tool-call readers on strings: what a whole output holds, and that the
same comes out however the text is split into token events (a stream)."""

from __future__ import annotations

import json

import pytest

from slipstream.service.api.http.tool_output import (
    HermesReader,
    NamedReader,
    Reader,
    RequiredReader,
    ToolCallDelta,
    ToolReply,
)

NAMES = ("weather", "time")


def read(reader: Reader, parts: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of ``parts`` fed in turn."""
    reply = ToolReply(is_call_only=not isinstance(reader, HermesReader))
    for part in parts:
        reply.add(reader.feed(part))
    reply.add(reader.finish())
    message = reply.message()
    calls = message.get("tool_calls", [])
    pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]  # type: ignore[index, union-attr]
    return message["content"], pairs  # type: ignore[return-value]


def splits(text: str) -> list[list[str]]:
    """Every way of cutting ``text`` in two, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


HERMES_CASES = [
    # Qwen2.5's own layout: calls alone, one a line.
    (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>',
        None,
        [("weather", '{"city": "Paris"}'), ("time", "{}")],
    ),
    # Text before, between and after calls stays content, the whitespace
    # around the blocks dropped.
    (
        'Let me look. <tool_call>{"name": "time", "arguments": {"zone": "utc"}}</tool_call>'
        "\n and then  <tool_call>"
        '{"arguments": {"a": "<tool_call>"}, "name": "weather"}</tool_call>\n',
        "Let me look.and then",
        [("time", '{"zone": "utc"}'), ("weather", '{"a": "<tool_call>"}')],
    ),
    # Arguments as JSON text, or under "parameters"; none at all.
    (
        '<tool_call>{"name": "time", "arguments": "{\\"zone\\": \\"utc\\"}"}</tool_call>'
        '<tool_call>{"name": "weather", "parameters": {"d": 1}}</tool_call>'
        '<tool_call>{"name": "time"}</tool_call>',
        None,
        [("time", '{"zone": "utc"}'), ("weather", '{"d": 1}'), ("time", "{}")],
    ),
    # Left open at the end (EOS before the closing tag), its JSON whole.
    ('<tool_call>\n{"name": "time", "arguments": {}}\n', None, [("time", "{}")]),
    # No call: the text as written, whitespace and a near-tag included.
    ("Sunny, 20 degrees. <tool_ \n", "Sunny, 20 degrees. <tool_ \n", []),
    ("ends in <tool_cal", "ends in <tool_cal", []),
    ("", "", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_calls_however_the_text_is_split(
    text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    for parts in splits(text):
        assert read(HermesReader(NAMES), parts) == (content, calls), parts


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "time", "arguments": {</tool_call>',  # malformed JSON
        '<tool_call>{"name": "rain", "arguments": {}}</tool_call>',  # not a tool offered
        '<tool_call>["time", {}]</tool_call>',  # not an object
        '<tool_call>{"name": "time", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "time", "arguments": "{nope"}</tool_call>',
        '<tool_call>{"name": "time", "arguments": {"a": ',  # cut off
        # A name that is not a string, arguments that are not an object.
        '<tool_call>{"name": ["time"], "arguments": {}}</tool_call>',
        '<tool_call>{"name": {"time": 1}}</tool_call>',
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
        '<tool_call>{"name": null, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "time", "arguments": null}</tool_call>',
        '<tool_call>{"name": "time", "arguments": "[1]"}</tool_call>',
        '<tool_call>{"name": "time", "parameters": 3}</tool_call>',
        # Values JSON does not have, which Python's parser takes.
        '<tool_call>{"name": "time", "arguments": {"a": NaN}}</tool_call>',
        '<tool_call>{"name": "time", "arguments": {"a": [-Infinity]}}</tool_call>',
        '<tool_call>{"name": "time", "arguments": "{\\"a\\": Infinity}"}</tool_call>',
        '<tool_call>{"name": "time", "arguments": {"a": 1e999}}</tool_call>',
        '<tool_call>{"name": NaN, "arguments": {}}</tool_call>',
    ],
)
def test_a_block_that_is_no_call_stays_content_as_written(block: str) -> None:
    text = f"Before {block} after"
    good = '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    for parts in splits(text):
        assert read(HermesReader(NAMES), parts) == (text, []), parts
    # After a good call: that one is read, the bad one kept (the whitespace
    # after a call dropped).
    content, calls = read(HermesReader(NAMES), [f"{good} {block}"])
    assert (content, calls) == (block, [("time", "{}")])


def test_hermes_streams_content_at_once_and_a_call_when_it_closes() -> None:
    reader = HermesReader(NAMES)
    assert reader.feed("Hi there") == ["Hi there"]
    assert reader.feed(" \n<tool") == []  # may open a block: held back
    assert reader.feed("_call>") == []
    assert reader.feed('{"name": "time", "arguments": {}}') == []
    (call,) = reader.feed("</tool_call>")
    assert isinstance(call, ToolCallDelta)
    assert (call.index, call.name, call.arguments) == (0, "time", "{}")
    assert call.id is not None and call.id.startswith("call_")
    assert call.wire() == {
        "index": 0,
        "id": call.id,
        "type": "function",
        "function": {"name": "time", "arguments": "{}"},
    }
    assert reader.feed("\n ") == []  # after a call: dropped if nothing follows
    assert reader.feed("ok") == ["ok"]
    assert reader.finish() == []


REQUIRED = (
    '[{"name": "weather", "parameters": {"city": "Pa\\"ris}", "list": [1, {"a": 2}]}}, '
    '{"name": "time", "parameters": {}}, {"name": "weather", "parameters": 12}, '
    '{"name": "time", "parameters": "a\\\\"}, {"name": "time", "parameters": true}]'
)


def test_required_calls_however_the_text_is_split() -> None:
    calls = [
        ("weather", '{"city": "Pa\\"ris}", "list": [1, {"a": 2}]}'),
        ("time", "{}"),
        ("weather", "12"),
        ("time", '"a\\\\"'),  # a backslash, escaped: the string ends after it
        ("time", "true"),
    ]
    for parts in splits(REQUIRED):
        assert read(RequiredReader(), parts) == (None, calls), parts


def test_required_streams_arguments_as_they_come() -> None:
    reader = RequiredReader()
    assert reader.feed('[{"name": "wea') == []
    (opening,) = reader.feed('ther", "parameters": ')
    assert isinstance(opening, ToolCallDelta)
    assert (opening.index, opening.name, opening.arguments) == (0, "weather", "")
    assert reader.feed('{"city"') == [ToolCallDelta(0, '{"city"')]
    end, opening, begun = reader.feed(': "x"}}, {"name": "time", "parameters": {')
    assert (end, begun) == (ToolCallDelta(0, ': "x"}'), ToolCallDelta(1, "{"))
    assert isinstance(opening, ToolCallDelta) and opening.id != end.id  # type: ignore[union-attr]
    assert (opening.index, opening.name, opening.arguments) == (1, "time", "")


def test_a_cut_off_call_keeps_what_it_has() -> None:
    cut = REQUIRED[: REQUIRED.index("Pa")]
    assert read(RequiredReader(), [cut]) == (None, [("weather", '{"city": "')])
    assert read(RequiredReader(), ['[{"name": "wea']) == (None, [])
    assert read(NamedReader("time"), ['{"zone": "u']) == (None, [("time", '{"zone": "u')])


def test_named_reads_the_output_as_the_arguments() -> None:
    reader = NamedReader("time")
    (opening,) = reader.feed("")
    assert isinstance(opening, ToolCallDelta) and opening.name == "time"
    assert reader.feed('{"zone"') == [ToolCallDelta(0, '{"zone"')]
    assert reader.feed("") == []
    assert reader.finish() == []
    args = '{"zone": "utc"}'
    assert read(NamedReader("time"), list(args)) == (None, [("time", args)])
    assert json.loads(read(NamedReader("time"), [args])[1][0][1]) == {"zone": "utc"}


@pytest.mark.parametrize("name", [["time"], {"time": 1}, 7, 1.5, True, None, "", "Time"])
@pytest.mark.parametrize("arguments", [{}, {"a": 1}, [1], "x", 3, None, True])
def test_hermes_reads_only_a_named_call_with_object_arguments(
    name: object, arguments: object
) -> None:
    """Every pairing of a name and arguments of each JSON kind: a call only
    where the name is a tool's and the arguments an object; content, as
    written, otherwise. Never an error."""
    block = "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    is_call = name == "time" and isinstance(arguments, dict)
    expected = (None, [("time", json.dumps(arguments))]) if is_call else (block, [])
    for parts in splits(block):
        assert read(HermesReader(NAMES), parts) == expected, parts


READERS = {
    "named": lambda: NamedReader("time"),
    "required": RequiredReader,
    "auto": lambda: HermesReader(NAMES),
}


@pytest.mark.parametrize(
    ("kind", "output", "is_cut"),
    [
        ("named", '{"zone": "utc"}', False),
        ("named", '{"zone": "utc"', True),  # a stop string took the brace
        ("named", "", True),
        ("required", REQUIRED, False),
        ("required", REQUIRED[:-1], True),  # every call whole, the array not
        ("required", REQUIRED[: REQUIRED.index("Pa")], True),
        ("required", '[{"name": "wea', False),  # no call begun: none to cut
        ("auto", '<tool_call>{"name": "time", "arguments": {', False),  # content
    ],
)
def test_a_constrained_output_is_cut_where_it_is_not_json(
    kind: str, output: str, is_cut: bool
) -> None:
    """Whether the output ended before its grammar's end (a "tool_calls"
    finish, or the request's own), however it was split."""
    for parts in splits(output):
        reader = READERS[kind]()
        for part in parts:
            reader.feed(part)
        reader.finish()
        assert reader.is_cut() is is_cut, parts

"""``slipstream generate``'s prompts file: a bad file or line is refused
before any model loads, naming the file, the line and what is wrong."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from slipstream.service.cli.generate import load_messages, load_prompts


def _args(path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        prompt=None,
        messages_file=None,
        prompts_file=path,
        max_tokens=16,
        temperature=0.0,
        seed=None,
    )


def test_a_good_file_gives_one_spec_a_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('"Hello"\n\n{"prompt_token_ids": [1, 2], "max_tokens": 3, "temperature": 1}\n')
    first, second = load_prompts(_args(path))
    assert first.text == "Hello" and first.max_tokens == 16
    assert second.token_ids == [1, 2] and second.max_tokens == 3 and second.temperature == 1


def test_a_line_may_be_a_conversation(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"messages": [{"role": "system", "content": "Be brief."}, '
        '{"role": "user", "content": "Hi"}], "max_tokens": 4}\n"Hello"\n'
    )
    chat, text = load_prompts(_args(path))
    assert chat.messages == (("system", "Be brief."), ("user", "Hi")) and chat.max_tokens == 4
    assert chat.text is None and chat.token_ids is None
    assert text.text == "Hello" and text.messages is None


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("not json", ":2: not JSON (Expecting value"),
        ('{"prompt": 5}', ":2: prompt must be a string"),
        ('{"prompt_token_ids": [1, "2"]}', ":2: prompt_token_ids must be a list of integers"),
        ('{"prompt_token_ids": 7}', ":2: prompt_token_ids must be a list of integers"),
        ('{"prompt": "x", "max_tokens": "5"}', ":2: max_tokens must be an integer"),
        ('{"prompt": "x", "max_tokens": true}', ":2: max_tokens must be an integer"),
        ('{"prompt": "x", "seed": 1.5}', ":2: seed must be an integer"),
        ('{"prompt": "x", "temperature": "hot"}', ":2: temperature must be a number"),
        ("[1, 2]", ":2: need a string or prompt/prompt_token_ids/messages"),
        ('{"messages": "hi"}', ':2: need a JSON list of {"role"'),
        ('{"messages": [{"role": "user"}]}', ":2: "),
        ('{"messages": [], "prompt": "x"}', ":2: messages or a prompt, not both"),
        ('{"messages": [{"role": "user", "content": "x"}], "seed": "1"}', ":2: seed must be"),
        # --server sent the ids, --local the text
        ('{"prompt": "x", "prompt_token_ids": [1]}', ":2: prompt or prompt_token_ids, not both"),
        # silently ignored: the flag's value was used instead
        ('{"prompt": "x", "max_token": 5}', ":2: unknown key 'max_token' (known: prompt, "),
        ('{"promt": "x"}', ":2: unknown key 'promt'"),
        ('{"max_tokens": 3}', ":2: need a string or prompt/prompt_token_ids/messages"),
        # protobuf's "Value out of range: -2" over the wire, naming no line
        ('{"prompt_token_ids": [1, -2]}', ":2: prompt_token_ids must be a list of integers in [0"),
        ('{"prompt_token_ids": [4294967296]}', ":2: prompt_token_ids must be a list of integers"),
        ('{"prompt": "x", "max_tokens": 0}', ":2: max_tokens must be an integer >= 1"),
        ('{"prompt": "x", "seed": -1}', ":2: seed must be an integer >= 0"),
        ('{"prompt": "x", "temperature": -1}', ":2: temperature must be a number, >= 0"),
        ('{"prompt": "x", "temperature": NaN}', ":2: temperature must be a number, >= 0"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, line: str, complaint: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(f'"fine"\n{line}\n')
    with pytest.raises(SystemExit) as exited:
        load_prompts(_args(path))
    assert str(exited.value).startswith(f"slipstream: error: {path}{complaint}")


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(SystemExit) as exited:
        load_prompts(_args(path))
    assert (
        str(exited.value) == f"slipstream: error: {path}: cannot read it: No such file or directory"
    )


@pytest.mark.parametrize("content", ["", "\n\n", "  \n\t\n"])
def test_a_file_without_prompts_is_refused(tmp_path: Path, content: str) -> None:
    """It exited 0 having printed nothing: an empty file is a script's mistake."""
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(SystemExit) as exited:
        load_prompts(_args(path))
    assert str(exited.value) == f"slipstream: error: {path}: no prompts in it"


def test_a_missing_messages_file_is_named_as_a_prompts_file_is(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(SystemExit) as exited:
        load_messages(path)
    assert (
        str(exited.value) == f"slipstream: error: {path}: cannot read it: No such file or directory"
    )


@pytest.mark.parametrize(
    ("content", "complaint"),
    [("not json", ": not JSON (Expecting value"), ('{"role": "user"}', ": need a JSON list")],
)
def test_a_bad_messages_file_is_named(tmp_path: Path, content: str, complaint: str) -> None:
    path = tmp_path / "chat.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as exited:
        load_messages(path)
    assert str(exited.value).startswith(f"slipstream: error: {path}{complaint}")

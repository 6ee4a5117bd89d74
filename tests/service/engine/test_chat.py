"""service/engine/chat.py: what a chat template is handed. A (role,
content) pair is ``{role, content}`` alone, as it always was (gRPC's
messages); a ``ChatMessage`` adds tool calling's keys as Hugging Face's
templates read them; the functions offered reach the template only where
some are given."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
from transformers import AutoTokenizer

from slipstream.service.engine.chat import (
    ChatError,
    ChatMessage,
    ToolCall,
    render_chat,
    renders_tools,
)


class Recording:
    """A tokenizer that keeps what its template was handed."""

    chat_template = "{{ messages }}{{ tools }}"

    def __init__(self) -> None:
        self.calls: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []

    def apply_chat_template(self, conversation: list[dict[str, Any]], **options: Any) -> str:
        self.calls.append((conversation, options))
        return "rendered"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(text)]


def handed(*args: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    tokenizer = Recording()
    assert render_chat(tokenizer, *args) == [len("rendered")]
    (call,) = tokenizer.calls
    return call


def test_a_pair_is_role_and_content_alone() -> None:
    conversation, options = handed([("developer", "Be brief."), ("user", "hi")])
    assert conversation == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert options == {"add_generation_prompt": True, "tokenize": False}  # no tools key


def test_calls_and_results_as_templates_read_them() -> None:
    calls = (ToolCall("call_1", "time", '{"zone": "utc"}'), ToolCall("call_2", "f", "not json"))
    tools = [{"type": "function", "function": {"name": "time"}}]
    messages = [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "", calls),
        ChatMessage("tool", "12:00", tool_call_id="call_1"),
    ]
    conversation, options = handed(messages, tools)
    assert conversation == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                # Arguments as an object where the JSON holds one (Qwen2.5's
                # template writes them with tojson), else as sent.
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "time", "arguments": {"zone": "utc"}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "f", "arguments": "not json"},
                },
            ],
        },
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
    ]
    assert options["tools"] == tools


def test_a_plain_chat_message_is_the_pairs_prompt(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    pairs = [("system", "Be brief."), ("user", "hi")]
    messages = [ChatMessage(role, content) for role, content in pairs]
    assert render_chat(tokenizer, messages) == render_chat(tokenizer, pairs)
    assert render_chat(tokenizer, pairs, None) == render_chat(tokenizer, pairs)


def test_renders_tools_reads_the_templates_source() -> None:
    class Plain:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    class Named:  # transformers' named templates: "tool_use" takes the tools
        chat_template: ClassVar[dict[str, str]] = {"default": "{{ m }}", "tool_use": "{{ tools }}"}

    assert renders_tools(Recording())
    assert not renders_tools(Plain()) and renders_tools(Named())
    assert not renders_tools(object())


def test_a_bad_message_is_refused() -> None:
    with pytest.raises(ChatError, match=r"messages\[0\].role 'robot'"):
        render_chat(Recording(), [ChatMessage("robot", "hi")])


def test_data_nested_too_deeply_to_render_is_refused(tiny_model_dir: Path) -> None:
    """transformers walks what the template is handed recursively: 600
    levels of arguments (or of a function's parameters) are past Python's
    stack, a refusal of this conversation, not an error of the server."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}"
    deep = "[" * 600 + "]" * 600
    call = ToolCall("call_1", "f", f'{{"a": {deep}}}')
    with pytest.raises(ChatError, match="nest arrays or objects too deeply"):
        render_chat(tokenizer, [ChatMessage("user", "hi"), ChatMessage("assistant", "", (call,))])
    parameters: dict[str, object] = {}
    for _ in range(600):
        parameters = {"a": parameters}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(ChatError, match="nest arrays or objects too deeply"):
        render_chat(tokenizer, [("user", "hi")], tools)

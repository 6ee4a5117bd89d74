"""Chat prompts: a conversation rendered with the model's own chat template.

Used by every front door (gRPC ``Submit.messages``, the HTTP chat endpoint,
the CLI), so a conversation means the same token ids whichever way it came.
Plain data in, token ids out; no wire types.

A message is a (role, content) pair, or a ``ChatMessage`` where it carries
what tool calling adds (the HTTP front's): an assistant's earlier
``tool_calls`` and a tool result's ``tool_call_id``. Both render alike
where they hold the same; the functions offered (``tools``) go to the
template as Hugging Face's ``apply_chat_template(tools=...)`` takes them.

The rendered prompt ends with the template's generation prompt (for ChatML,
``<|im_start|>assistant\\n``); the model's end-of-turn token (its EOS in
``generation_config.json``, ``<|im_end|>`` for SmolLM2) then ends the answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slipstream.service.engine.encoding import token_ids

# Roles a ChatML-style template understands; anything else is a typo the
# template would silently render as text. "developer" is OpenAI's newer name
# for system instructions: it is rendered as "system".
ROLES = frozenset({"system", "user", "assistant", "tool"})
ROLE_ALIASES = {"developer": "system"}


class ChatError(ValueError):
    """A conversation that cannot be rendered (bad role, empty, no template)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call an assistant made earlier in the conversation;
    ``arguments`` is JSON text, as OpenAI's API carries it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message; ``tool_calls`` only on an assistant's, ``tool_call_id``
    only on a tool result's."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


Message = tuple[str, str] | ChatMessage


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template takes the functions offered: its
    source names ``tools`` (Qwen2.5's, Llama 3.1's, Hermes'). A template
    that does not would drop them unseen."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates ("default", "tool_use")
        template = " ".join(str(source) for source in template.values())
    return isinstance(template, str) and "tools" in template


def check_messages(messages: Sequence[Message]) -> None:
    """Cheap checks that need no tokenizer; raise ``ChatError``."""
    if not messages:
        raise ChatError("messages is empty")
    for i, message in enumerate(messages):
        if isinstance(message, ChatMessage):
            role, content = message.role, message.content
        elif isinstance(message, tuple | list) and len(message) == 2:
            role, content = message
        else:
            raise ChatError(f"messages[{i}] is not a (role, content) pair")
        if role not in ROLES and role not in ROLE_ALIASES:
            allowed = ", ".join(sorted(ROLES | ROLE_ALIASES.keys()))
            raise ChatError(f"messages[{i}].role {role!r} is not one of {allowed}")
        if not isinstance(content, str):
            raise ChatError(f"messages[{i}].content is not a string")


def render_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, object]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` with the generation prompt added, exactly
    as the model's template renders them; ``tools``: the functions offered,
    OpenAI's ``{"type": "function", "function": {...}}`` each."""
    check_messages(messages)
    if not has_chat_template(tokenizer):
        raise ChatError("this model has no chat template; send text or token_ids")
    from jinja2 import TemplateError  # transformers renders templates with jinja2

    conversation = [_template_message(message) for message in messages]
    options: dict[str, object] = {} if tools is None else {"tools": list(tools)}
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False, **options
        )
    except TemplateError as exc:  # a template may refuse a conversation ("roles must alternate")
        raise ChatError(f"the chat template refused these messages: {exc}") from None
    except RecursionError:  # transformers copies the data recursively, a frame or two a level
        message = "the messages or tools nest arrays or objects too deeply to render"
        raise ChatError(message) from None
    # The template already holds any special tokens the model wants.
    return token_ids(tokenizer, text, add_special_tokens=False)


def _template_message(message: Message) -> dict[str, object]:
    """A message as chat templates read it: a pair is ``{role, content}``
    alone, whichever front door it came by."""
    if not isinstance(message, ChatMessage):
        role, content = message
        return {"role": ROLE_ALIASES.get(role, role), "content": content}
    out: dict[str, object] = {
        "role": ROLE_ALIASES.get(message.role, message.role),
        "content": message.content,
    }
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(text: str) -> object:
    """A call's arguments as templates expect them: an object (Qwen2.5's
    writes ``arguments | tojson``), where the JSON text holds one; as sent
    otherwise."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text

"""Chat prompts: a conversation rendered with the model's own chat template.

Used by every front door (gRPC ``Submit.messages``, the HTTP chat endpoint,
the CLI), so a conversation means the same token ids whichever way it came.
Plain data in, token ids out; no wire types.

The rendered prompt ends with the template's generation prompt (for ChatML,
``<|im_start|>assistant\\n``); the model's end-of-turn token (its EOS in
``generation_config.json``, ``<|im_end|>`` for SmolLM2) then ends the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slipstream.service.engine.encoding import token_ids

# Roles a ChatML-style template understands; anything else is a typo the
# template would silently render as text. "developer" is OpenAI's newer name
# for system instructions: it is rendered as "system".
ROLES = frozenset({"system", "user", "assistant", "tool"})
ROLE_ALIASES = {"developer": "system"}


class ChatError(ValueError):
    """A conversation that cannot be rendered (bad role, empty, no template)."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_messages(messages: Sequence[tuple[str, str]]) -> None:
    """Cheap checks that need no tokenizer; raise ``ChatError``."""
    if not messages:
        raise ChatError("messages is empty")
    for i, message in enumerate(messages):
        if not (isinstance(message, tuple | list) and len(message) == 2):
            raise ChatError(f"messages[{i}] is not a (role, content) pair")
        role, content = message
        if role not in ROLES and role not in ROLE_ALIASES:
            allowed = ", ".join(sorted(ROLES | ROLE_ALIASES.keys()))
            raise ChatError(f"messages[{i}].role {role!r} is not one of {allowed}")
        if not isinstance(content, str):
            raise ChatError(f"messages[{i}].content is not a string")


def render_chat(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of ``messages`` (role, content) with the generation prompt
    added, exactly as the model's template renders them."""
    check_messages(messages)
    if not has_chat_template(tokenizer):
        raise ChatError("this model has no chat template; send text or token_ids")
    from jinja2 import TemplateError  # transformers renders templates with jinja2

    conversation = [
        {"role": ROLE_ALIASES.get(role, role), "content": content} for role, content in messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    except TemplateError as exc:  # a template may refuse a conversation ("roles must alternate")
        raise ChatError(f"the chat template refused these messages: {exc}") from None
    # The template already holds any special tokens the model wants.
    return token_ids(tokenizer, text, add_special_tokens=False)

"""Text to token ids, for every front door: ``tokenizer.encode(text)``'s ids,
through the Rust tokenizer's batch call without offsets where it can.

That call lets the interpreter go while it works, and with no offsets to
keep it has less to build and to free again: 4 MB of text for SmolLM2's
tokenizer took 2.3 s through ``encode_batch`` (then 20 ms to read the ids
and 60 ms to free the encoding, both holding the interpreter, so every
stream's tokens waited) and 1.3 s through ``encode_batch_fast``, the
longest hold 17 ms (AMD EPYC Zen 5; docs/operations.md, "Large prompts").
A tokenizer that truncates or pads, or a tokenizers release without the
call, takes ``tokenizer.encode`` as before.
"""

from __future__ import annotations

from typing import Any


def token_ids(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """The ids ``tokenizer.encode(text, add_special_tokens=...)`` gives."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None or backend.truncation is not None or backend.padding is not None:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    ids: list[int] = fast([text], add_special_tokens=add_special_tokens)[0].ids
    return ids

"""``encoding.token_ids``: the ids ``tokenizer.encode`` gives, whichever way
they are made (the Rust batch call without offsets, or ``encode`` itself
where the tokenizer truncates, pads or has no such call)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from slipstream.service.engine.encoding import token_ids

TEXTS = [
    "Hello",
    "",
    "  two leading spaces, and a trailing one ",
    "a\nb\tc\r\n",
    "naïve café, 東京, 🙂",
    "<|im_start|>user\nhi<|im_end|>",  # special tokens' text
    "The quick brown fox. " * 400,
]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_ids_tokenizer_encode_gives(tiny_model_dir: Path, add_special_tokens: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in TEXTS:
        want = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert token_ids(tokenizer, text, add_special_tokens) == want, text[:40]


def test_a_truncating_tokenizer_keeps_encodes_meaning(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.backend_tokenizer.enable_truncation(8)
    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference.backend_tokenizer.enable_truncation(8)
    got = token_ids(tokenizer, TEXTS[-1])
    assert got == reference.encode(TEXTS[-1]) and len(got) > 8  # encode lifts the truncation


def test_a_tokenizer_without_a_rust_backend_is_asked_to_encode() -> None:
    class Plain:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [len(text), int(add_special_tokens)]

    assert token_ids(Plain(), "abc", add_special_tokens=False) == [3, 0]

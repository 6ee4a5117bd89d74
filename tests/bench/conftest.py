"""Seeded random Llama checkpoints whose config a test controls (the
embedded ``tiny`` model comes from the session's ``tiny_model_dir``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def make_random_llama(path: Path, eos_token_id: int = 2) -> Path:
    """A seeded random 2-layer Llama saved in Hugging Face format at ``path``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=1, eos_token_id=eos_token_id, pad_token_id=0
    )
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def random_llama() -> Callable[..., Path]:
    """``make_random_llama`` for test modules (test folders are not packages)."""
    return make_random_llama

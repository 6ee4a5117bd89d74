"""Greedy tokens of the engine equal transformers' generate(), token for token.

Runs on the tiny default model in fp32, 32 prompts of 1-600 tokens at once,
with a per-step token budget small enough that long prompts are prefilled in
several chunks that share steps with other sequences' decodes.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from slipstream.kernels import linear
from slipstream.scheduler.request import FinishReason
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.engine import Engine
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_parts

NUM_PROMPTS = 32


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 600, 599, 17] + [rng.randint(1, 600) for _ in range(NUM_PROMPTS - 5)]
    return [[rng.randrange(4, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


_EXPECTED: dict[int, list[int]] = {}


def _expected(model, i: int, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' tokens, computed once for both engine modes."""
    if i not in _EXPECTED:
        _EXPECTED[i] = _hf_greedy(model, prompt, max_new_tokens)
    return _EXPECTED[i]


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_greedy_matches_transformers(tiny_model_dir, hf_model, compile):
    parts = load_parts(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            max_num_batched_tokens=96,
            block_size=16,
            compile=compile,
        )
    )
    engine = Engine(parts.scheduler(), parts.runner, parts.tokenizer, parts.info)
    assert engine.info.compiled is compile
    # Compiled float32 on an AVX2 CPU: the projections run in the panel kernel too.
    uses_panels = parts.model.layers[0].qkv.uses_panels
    assert uses_panels is (compile and linear.panels_available())
    prompts = _prompts(engine.info.vocab_size)
    max_tokens = [8 + (i * 5) % 17 for i in range(NUM_PROMPTS)]
    requests = [
        RequestSpec(req_id=f"p{i}", prompt_token_ids=p, max_new_tokens=n)
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    try:
        results = engine.generate(requests)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.step > max(max_tokens), "prompts were not chunked across steps"
    for i, (prompt, n, result) in enumerate(zip(prompts, max_tokens, results, strict=True)):
        expected = _expected(hf_model, i, prompt, n)
        assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        want = (
            FinishReason.EOS
            if len(expected) < n or expected[-1] in engine.info.eos_token_ids
            else FinishReason.MAX_TOKENS
        )
        assert result.finish.reason == want
    assert stats.device_blocks.used == 0
    assert stats.waiting == stats.running == 0

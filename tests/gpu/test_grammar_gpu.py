"""Structured output on a CUDA GPU: the mask uploaded from pinned memory and
applied on the device, behind a decode graph's replay, as on the host; the
engine planning ahead (the GPU's default) waits for a step with a
constrained row before planning the next, and its constrained outputs
match while its other rows give the tokens they give without them.

Skipped where torch sees no CUDA device or the Triton interpreter is on;
run them as ``make test-gpu`` (``TRITON_INTERPRET=0``).
"""

from __future__ import annotations

import json
import re

import torch
from gpu_marks import GPU_ONLY
from transformers import AutoTokenizer

from slipstream.scheduler.request import FinishReason
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import (
    ConstraintKind,
    OutputConstraint,
    RequestSpec,
    SamplingParams,
)
from slipstream.service.engine.grammar import GrammarCompiler, mask_logits
from slipstream.service.engine.loader import load_engine
from slipstream.service.models.store import resolve_model

pytestmark = GPU_ONLY

DIGITS = OutputConstraint(ConstraintKind.REGEX, "[0-9]{3}")
YES_NO = OutputConstraint(ConstraintKind.JSON_SCHEMA, '{"enum": ["yes", "no"]}')


def test_the_device_mask_equals_the_hosts():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    grammar = GrammarCompiler(tokenizer, [tokenizer.eos_token_id]).compile(YES_NO)
    vocab = len(tokenizer)
    logits = torch.randn(5, vocab)
    req_ids = ["a", "b", "c", "d", "e"]
    on_host, on_device = logits.clone(), logits.cuda()
    mask_logits(on_host, req_ids, {"b": grammar.start(), "d": grammar.start()})
    mask_logits(on_device, req_ids, {"b": grammar.start(), "d": grammar.start()})
    assert torch.equal(on_device.cpu(), on_host)
    mask_logits(on_device, req_ids, {r: grammar.start() for r in req_ids})  # every row
    assert torch.isinf(on_device).sum().item() == 5 * (vocab - 1)  # only '"' may start


def test_constrained_rows_beside_graph_decodes_on_the_gpu():
    engine = load_engine(
        EngineConfig(
            model=str(resolve_model("tiny")), device="cuda", dtype="float32", block_size=16,
            max_num_batched_tokens=128,
        )
    )  # fmt: skip
    engine.start()
    try:
        assert engine.plan_ahead and engine.info.device["cuda_graphs"]["enabled"]
        encode = engine.tokenizer.encode
        plain = [
            RequestSpec(req_id=f"p{i}", prompt_token_ids=encode(f"story {i}:"),
                        max_new_tokens=24, ignore_eos=True)
            for i in range(8)
        ]  # fmt: skip
        alone = [r.token_ids for r in engine.generate(plain)]
        constrained = [
            RequestSpec(req_id="yes_no", prompt_token_ids=encode("Answer:"), max_new_tokens=16,
                        constraint=YES_NO),
            RequestSpec(req_id="digits", prompt_token_ids=encode("Pick:"), max_new_tokens=16,
                        constraint=DIGITS, sampling=SamplingParams(1.0, seed=3)),
        ]  # fmt: skip
        results = engine.generate(plain + constrained)
    finally:
        engine.shutdown()
    assert [r.token_ids for r in results[:8]] == alone
    yes_no, digits = results[8:]
    assert json.loads(yes_no.text) in ("yes", "no")
    assert re.fullmatch("[0-9]{3}", digits.text)
    assert {yes_no.finish.reason, digits.finish.reason} == {FinishReason.STOP_SEQUENCE}

"""The engine planning step N+1 before step N's results (``plan_ahead``, the
GPU's default) gives what it gives planning after them, on the CPU: the same
greedy tokens, EOS, stop sequences and limits (one step late inside, not in
what callers see), cancellation and deadlines freeing every block."""

from __future__ import annotations

import pytest
from engine_checks import check_cancel_and_deadline_free_every_block

from slipstream.scheduler.request import FinishReason
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.engine import Engine, FinishedResult
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_engine
from slipstream.service.engine.runner import ModelRunner

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def main():"]


def _engine(tiny_model_dir, plan_ahead: bool) -> Engine:
    engine = load_engine(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", block_size=16, plan_ahead=plan_ahead
        )
    )
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    behind, ahead = _engine(tiny_model_dir, False), _engine(tiny_model_dir, True)
    yield behind, ahead
    behind.shutdown()
    ahead.shutdown()


def _requests(engine: Engine) -> list[RequestSpec]:
    """Greedy requests ending every way: EOS, a stop sequence, max tokens,
    the model's length, one token."""
    encode = engine.tokenizer.encode
    out = []
    for i, text in enumerate(PROMPTS * 3):
        kind = i % 4
        out.append(
            RequestSpec(
                req_id=f"r{i}",
                prompt_token_ids=encode(text),
                max_new_tokens=(1, 40, 17, 64)[kind],
                ignore_eos=kind == 2,
                stop_sequences=(" the", "e") if kind == 3 else (),
            )
        )
    return out


def _summary(results: list[FinishedResult]) -> list[tuple[list[int], FinishReason, str]]:
    return [(r.token_ids, r.finish.reason, r.text) for r in results]


def test_same_tokens_and_finishes_as_planning_behind(engines):
    behind, ahead = engines
    assert ahead.plan_ahead and not behind.plan_ahead
    requests = _requests(behind)
    expected = _summary(behind.generate(requests))
    got = _summary(ahead.generate(requests))
    assert got == expected
    reasons = {reason for _, reason, _ in expected}
    assert FinishReason.MAX_TOKENS in reasons
    assert reasons & {FinishReason.EOS, FinishReason.STOP_SEQUENCE}
    for r, (tokens, _, _) in zip(requests, got, strict=True):
        assert 1 <= len(tokens) <= r.max_new_tokens
    assert ahead.wait_idle(5.0)
    stats = ahead.stats()
    assert (stats.device_blocks.used, stats.host_blocks.used, stats.running) == (0, 0, 0)


def test_cancel_and_deadline_free_every_block(engines):
    check_cancel_and_deadline_free_every_block(engines[1])


def test_the_cpu_plans_behind_unless_asked(tiny_model_dir):
    engine = load_engine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    assert not engine.plan_ahead
    assert isinstance(engine._runner, ModelRunner)

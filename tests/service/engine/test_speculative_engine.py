"""Speculative decoding on the CPU engine: greedy float32 tokens, text and
finishes are exactly those without it (the batch-invariance promise), with
stop sequences cutting inside an accepted run; drafts are counted."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from slipstream.scheduler.request import SamplingParams
from slipstream.scheduler.scheduler import Scheduler
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.engine import Engine, FinishedResult
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_parts

NUM_REQUESTS = 10


def _engine(speculative_tokens: int) -> Engine:
    parts = load_parts(
        EngineConfig(
            model="tiny",
            dtype="float32",
            block_size=16,
            max_num_batched_tokens=64,  # prompts chunked beside decodes and drafts
            speculative_tokens=speculative_tokens,
        )
    )
    # No step-cost model: every draft found is made (none priced out), the
    # most verifying these tests can get.
    return Engine(Scheduler(parts.scheduler_config), parts.runner, parts.tokenizer, parts.info)


def _requests(vocab_size: int, stops: dict[str, tuple[str, ...]]) -> list[RequestSpec]:
    """Prompts that repeat themselves (something for prompt lookup to find),
    greedy, with one asking for log-probabilities (it never drafts)."""
    rng = random.Random(0)
    requests = []
    for i in range(NUM_REQUESTS):
        base = [rng.randrange(4, vocab_size) for _ in range(rng.randint(3, 24))]
        req_id = f"r{i}"
        requests.append(
            RequestSpec(
                req_id=req_id,
                prompt_token_ids=base * rng.randint(1, 4),
                max_new_tokens=40 + 4 * i,
                ignore_eos=i % 2 == 0,
                stop_sequences=stops.get(req_id, ()),
                sampling=SamplingParams(logprobs=2 if i == 3 else None),
            )
        )
    return requests


def _run(engine: Engine, requests: list[RequestSpec]) -> list[FinishedResult]:
    try:
        return engine.generate(requests)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain() -> tuple[Engine, list[FinishedResult]]:
    engine = _engine(0)
    engine.start()
    return engine, engine.generate(_requests(engine.info.vocab_size, {}))


def _stops(results: list[FinishedResult]) -> dict[str, tuple[str, ...]]:
    """A stop sequence for every third request: a few characters from the
    middle of its output without one."""
    stops = {}
    for result in results[::3]:
        middle = len(result.text) // 2
        if result.text[middle : middle + 3].strip():
            stops[result.req_id] = (result.text[middle : middle + 3],)
    return stops


def test_greedy_float32_tokens_are_those_without_drafts(plain) -> None:
    engine, results = plain
    stops = _stops(results)
    assert stops
    with_stops = _requests(engine.info.vocab_size, stops)
    expected = _run(engine, with_stops)
    speculative = _engine(4)
    torch.manual_seed(0)
    got = _run(speculative, with_stops)
    for want, result in zip(expected, got, strict=True):
        assert result.token_ids == want.token_ids, result.req_id
        assert result.text == want.text, result.req_id
        assert result.finish.reason == want.finish.reason, result.req_id
        assert result.finish.num_output_tokens == want.finish.num_output_tokens
    assert any(r.finish.reason.name == "STOP_SEQUENCE" for r in got)
    stats = speculative.stats()
    assert stats.spec_accepted_tokens > 10, stats
    assert stats.spec_draft_tokens >= stats.spec_accepted_tokens
    assert stats.device_blocks.used == 0 and stats.running == 0


def test_planning_ahead_is_one_clear_error() -> None:
    """A plan made ahead follows tokens still in flight: nothing to look up."""
    with pytest.raises(ValueError, match="with --plan-ahead on"):
        load_parts(EngineConfig(speculative_tokens=4, plan_ahead=True))


def test_seeded_sampling_gives_the_tokens_it_gives_without_drafts() -> None:
    """A sampled row accepts a draft where its seeded draw picks it, so a
    seeded request is as reproducible as without drafts and, in float32,
    has the same tokens; unseeded ones finish their tokens as asked."""
    results = {}
    for k in (0, 4, 4):
        engine = _engine(k)
        requests = [
            dataclasses.replace(
                r,
                sampling=SamplingParams(
                    temperature=0.01 if i % 3 else 0.7,  # mostly sharp: tiny's logits are flat
                    top_p=0.9,
                    top_k=40 * (i % 2),
                    seed=None if i == 1 else i,
                ),
            )
            for i, r in enumerate(_requests(engine.info.vocab_size, {}))
        ]
        got = _run(engine, requests)
        if k:
            assert engine.stats().spec_accepted_tokens >= 5
        results.setdefault(k, []).append(got)
    plain, [first, second] = results[0][0], results[4]
    for want, a, b in zip(plain, first, second, strict=True):
        assert a.finish.num_output_tokens == len(a.token_ids)
        if a.req_id == "r1":
            continue  # unseeded
        assert a.token_ids == b.token_ids == want.token_ids, a.req_id


def test_on_cuda_it_is_one_clear_error() -> None:
    """The CUDA runner samples one token a sequence: it refuses the flag
    before touching the device."""
    from slipstream.service.engine.loader import _load_on_cuda

    with pytest.raises(ValueError, match="--speculative-tokens runs on the CPU only"):
        _load_on_cuda(EngineConfig(speculative_tokens=4), torch.device("cuda"))


def test_serve_takes_the_flag_off_by_default() -> None:
    from slipstream.service.cli import build_parser
    from slipstream.service.cli.serve import engine_config

    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).speculative_tokens == 0
    config = engine_config(parse(["serve", "--speculative-tokens", "4"]))
    assert config.speculative_tokens == 4
    assert config.scheduler_config(64, 0, 1024).num_speculative_tokens == 4
    with pytest.raises(SystemExit):
        parse(["serve", "--speculative-tokens", "-1"])


def test_serve_refuses_drafts_with_plan_ahead_before_it_listens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The combination was refused when the engine loaded: after the HTTP
    front had started and said where it listened."""
    from slipstream.service.cli import main

    serve = ["serve", "--model", "tiny", "--port", "0", "--http-port", "0", "--no-calibrate"]
    for extra in (["--plan-ahead", "on"], ["--device", "cuda"]):
        assert main([*serve, "--speculative-tokens", "4", *extra]) == 2
        out = capsys.readouterr()
        assert "--speculative-tokens" in out.err
        assert "listening" not in out.out + out.err and "http://" not in out.out

"""Prefix caching changes no token: greedy output with the cache on equals
the output with it off, bit for bit, over many requests sharing a long
common prefix — with a roomy pool, with chunked prefill, and with a pool so
tight that shared and unshared blocks are preempted (swap and recompute)."""

from __future__ import annotations

import random

import pytest

from slipstream.scheduler.request import FinishReason
from slipstream.scheduler.scheduler import Scheduler
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.engine import Engine, FinishedResult
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_engine, load_parts

BLOCK = 16
PREFIX_LEN = 200  # 12 full blocks and a partial one
NUM_REQUESTS = 24


def _workload(vocab: int) -> list[RequestSpec]:
    rng = random.Random(14)
    prefix = [rng.randrange(4, vocab) for _ in range(PREFIX_LEN)]
    requests = []
    for i in range(NUM_REQUESTS):
        tail = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 24))]
        requests.append(
            RequestSpec(
                req_id=f"p{i}",
                prompt_token_ids=prefix[: _shared_len(i)] + tail,
                max_new_tokens=rng.randint(6, 20),
                ignore_eos=True,
                priority=i % 3,
            )
        )
    return requests


def _shared_len(index: int) -> int:
    """How much of the common prefix request ``index`` starts with: all of
    it, except every sixth request from the fourth, which may stop part way."""
    return min(40 + 9 * index, PREFIX_LEN) if index % 6 == 3 else PREFIX_LEN


def _run(
    config: EngineConfig, workload: list[RequestSpec]
) -> tuple[list[FinishedResult], Scheduler]:
    """The first request alone (it fills the cache), then the rest at once."""
    parts = load_parts(config)
    scheduler = parts.scheduler()
    engine = Engine(scheduler, parts.runner, parts.tokenizer, parts.info)
    try:
        results = engine.generate(workload[:1]) + engine.generate(workload[1:])
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.device_blocks.used == stats.host_blocks.used == 0
    for result in results:
        assert result.finish.reason is FinishReason.MAX_TOKENS, result.finish
    return results, scheduler


@pytest.fixture(scope="module")
def reference(tiny_model_dir: object) -> tuple[list[RequestSpec], list[FinishedResult]]:
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        block_size=BLOCK,
        max_num_batched_tokens=1024,
        num_device_blocks=512,
        num_host_blocks=0,
        prefix_cache=False,
    )
    engine = load_engine(config)
    vocab = engine.info.vocab_size
    engine.shutdown()
    workload = _workload(vocab)
    results, _ = _run(config, workload)
    assert all(r.finish.num_cached_tokens == 0 for r in results)
    return workload, results


@pytest.mark.parametrize(
    "knobs",
    [
        pytest.param(dict(max_num_batched_tokens=1024, num_device_blocks=512), id="roomy"),
        pytest.param(dict(max_num_batched_tokens=48, num_device_blocks=512), id="chunked"),
        pytest.param(
            dict(
                max_num_batched_tokens=48,
                num_device_blocks=24,
                num_host_blocks=8,
                max_num_seqs=6,
                policy="deadline",
            ),
            id="tight-pool-swap",
        ),
        pytest.param(
            dict(max_num_batched_tokens=48, num_device_blocks=24, num_host_blocks=0, policy="fcfs"),
            id="tight-pool-recompute",
        ),
    ],
)
def test_prefix_cache_on_matches_off_bit_for_bit(
    tiny_model_dir: object,
    reference: tuple[list[RequestSpec], list[FinishedResult]],
    knobs: dict[str, object],
) -> None:
    workload, expected = reference
    config = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", block_size=BLOCK, prefix_cache=True, **knobs
    )
    got, scheduler = _run(config, workload)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    cached = [r.finish.num_cached_tokens for r in got]
    assert cached[0] == 0
    for request, num_cached in zip(workload, cached, strict=True):
        assert num_cached % BLOCK == 0 and num_cached < len(request.prompt_token_ids)
    if knobs["num_device_blocks"] == 512:  # nothing is evicted: every later request hits
        shared = [_shared_len(i) // BLOCK * BLOCK for i in range(1, NUM_REQUESTS)]
        assert all(c >= s for c, s in zip(cached[1:], shared, strict=True)), str((cached, shared))
    else:
        # The tight pools preempt: by swap with a host pool, else by recompute.
        if knobs["num_host_blocks"]:
            assert scheduler.num_swap_preemptions > 0
        else:
            assert scheduler.num_recompute_preemptions > 0
        assert sum(cached) >= (PREFIX_LEN // BLOCK) * BLOCK * (NUM_REQUESTS // 2), cached


def test_requests_queued_with_one_prompt_wait_for_it_and_the_stats_count_the_waits(
    tiny_model_dir: object,
) -> None:
    """Three requests with one prompt, queued before the engine's first step:
    the first computes the prefix, the others sit that step out and start
    from it cached. ``EngineStats.prefix_cache`` reports the waits beside
    the hits they bought."""
    config = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", block_size=BLOCK, num_device_blocks=64
    )
    parts = load_parts(config)
    engine = Engine(parts.scheduler(), parts.runner, parts.tokenizer, parts.info)
    prompt = list(range(10, 11 + 3 * BLOCK))  # three full blocks and a token
    try:
        for i in range(3):  # the engine thread is not running: one step sees them all
            engine.submit(RequestSpec(f"w{i}", prompt, 2, ignore_eos=True), lambda event: None)
        engine.start()
        assert engine.wait_idle(timeout=60)
        stats = engine.stats().prefix_cache
    finally:
        engine.shutdown()
    assert stats.waits == 2
    assert stats.hit_tokens == 2 * 3 * BLOCK

"""Preempted requests (swapped to the host pool and back, or dropped and
recomputed) produce exactly the greedy tokens of an unpreempted run.

Tiny model in fp32; a device pool of a few blocks forces many preemptions
under the deadline policy with mixed priorities; urgent requests arrive
while less urgent ones run, so admission preemption happens too.
"""

from __future__ import annotations

import random
import time

import pytest

from slipstream.scheduler.request import FinishReason
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.engine import Engine
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_engine

BLOCK = 16


def _requests(vocab: int, first: int, count: int, deadline: float) -> list[RequestSpec]:
    rng = random.Random(first)
    return [
        RequestSpec(
            req_id=f"q{i}",
            prompt_token_ids=[rng.randrange(4, vocab) for _ in range(rng.randint(8, 56))],
            max_new_tokens=rng.randint(40, 64)
            if i < first + 4 and first == 0
            else rng.randint(12, 28),
            ignore_eos=True,
            priority=(2, 1, 0)[i % 3] if i >= first + 4 else 2,
            deadline=deadline,
        )
        for i in range(first, first + count)
    ]


def _run(engine: Engine, early: list[RequestSpec], late: list[RequestSpec]) -> dict[str, list[int]]:
    from slipstream.service.engine.engine import _Collector

    collectors = {r.req_id: _Collector() for r in early + late}
    engine.start()
    for r in early:
        engine.submit(r, collectors[r.req_id].on_event)
    # The background class must be running (and holding blocks) when the
    # urgent ones arrive; waiting for its tokens, not for a fixed time, keeps
    # that true on a slow or loaded machine.
    give_up = time.monotonic() + 60.0
    while sum(len(collectors[r.req_id].token_ids) for r in early) < 8:
        assert time.monotonic() < give_up, "the early requests never started"
        time.sleep(0.005)
    for r in late:
        engine.submit(r, collectors[r.req_id].on_event)
    results = {r.req_id: collectors[r.req_id].wait(r.req_id) for r in early + late}
    for result in results.values():
        assert result.finish.reason is FinishReason.MAX_TOKENS, result.finish
    return {req_id: result.token_ids for req_id, result in results.items()}


COMMON = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=64)


def _workload(tiny_model_dir, kv_cache_dtype: str = "auto"):
    """The requests and the greedy tokens of an unpreempted run of them."""
    deadline = time.monotonic() + 600.0
    reference = load_engine(
        EngineConfig(
            model=str(tiny_model_dir),
            **COMMON,
            kv_cache_dtype=kv_cache_dtype,
            num_device_blocks=256,
            num_host_blocks=0,
            policy="fcfs",
        )
    )
    vocab = reference.info.vocab_size
    early, late = _requests(vocab, 0, 4, deadline), _requests(vocab, 4, 8, deadline)
    try:
        expected = _run(reference, early, late)
        stats = reference.stats()
        assert stats.swap_preemptions == stats.recompute_preemptions == 0
    finally:
        reference.shutdown()
    return early, late, expected


@pytest.fixture(scope="module")
def workload(tiny_model_dir):
    return _workload(tiny_model_dir)


def _run_tight(
    tiny_model_dir,
    workload,
    num_host_blocks: int,
    plan_ahead: bool = False,
    kv_cache_dtype: str = "auto",
):
    early, late, expected = workload
    tight = load_engine(
        EngineConfig(
            model=str(tiny_model_dir),
            **COMMON,
            kv_cache_dtype=kv_cache_dtype,
            num_device_blocks=8,
            num_host_blocks=num_host_blocks,
            max_num_seqs=3,
            policy="deadline",
            plan_ahead=plan_ahead,
        )
    )
    assert tight.plan_ahead is plan_ahead
    try:
        got = _run(tight, early, late)
        stats = tight.stats()
    finally:
        tight.shutdown()
    assert got == expected
    assert stats.device_blocks.used == 0 and stats.host_blocks.used == 0
    return stats


def test_swapped_requests_match_the_unpreempted_run(tiny_model_dir, workload):
    # A small host pool: most preemptions swap; when it is full, the rest
    # recompute (how many of each depends on the timing of the arrivals).
    stats = _run_tight(tiny_model_dir, workload, num_host_blocks=10)
    assert stats.swap_preemptions >= 3, "the tiny pools must force swaps"


def test_recomputed_requests_match_the_unpreempted_run(tiny_model_dir, workload):
    # No host pool: every preemption drops the cache and recomputes it.
    stats = _run_tight(tiny_model_dir, workload, num_host_blocks=0)
    assert stats.swap_preemptions == 0
    assert stats.recompute_preemptions >= 3, "the tiny pool must force recomputes"


@pytest.mark.parametrize("num_host_blocks", [10, 0], ids=["swap", "recompute"])
def test_planning_ahead_preempts_exactly(tiny_model_dir, workload, num_host_blocks):
    """Step N+1 planned while step N runs, its decodes' tokens pending: the
    same tokens through swaps and recomputes."""
    stats = _run_tight(tiny_model_dir, workload, num_host_blocks, plan_ahead=True)
    assert stats.swap_preemptions + stats.recompute_preemptions >= 3
    # The CPU runs a step when it is launched: its forward is in the launch, not
    # in the wait for a step launched ahead.
    host = stats.host_times
    assert host.planning > 0 and host.update > 0 and host.publish > 0
    assert host.launch > 10 * host.device_wait


def test_int8_kv_cache_preempts_exactly(tiny_model_dir):
    """Quantized rows travel with their scales: swapped out and in, or
    recomputed (and quantized again), they give the tokens of an unpreempted
    run with the same int8 cache."""
    workload = _workload(tiny_model_dir, "int8")
    stats = _run_tight(tiny_model_dir, workload, num_host_blocks=6, kv_cache_dtype="int8")
    assert stats.swap_preemptions >= 1 and stats.recompute_preemptions >= 1

"""Preempted requests (swapped to the host pool and back, or dropped and
recomputed) produce exactly the greedy tokens of an unpreempted run.

Tiny model in fp32; a device pool of a few blocks forces many preemptions
under the deadline policy with mixed priorities; urgent requests arrive
while less urgent ones run, so admission preemption happens too.
"""

from __future__ import annotations

import random
import time

from slipstream.scheduler.request import FinishReason
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.engine import Engine
from slipstream.service.engine.events import GenerationRequest

BLOCK = 16


def _requests(vocab: int, first: int, count: int, deadline: float) -> list[GenerationRequest]:
    rng = random.Random(first)
    return [
        GenerationRequest(
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


def _run(
    engine: Engine, early: list[GenerationRequest], late: list[GenerationRequest]
) -> dict[str, list[int]]:
    from slipstream.service.engine.engine import _Collector

    collectors = {r.req_id: _Collector() for r in early + late}
    engine.start()
    for r in early:
        engine.submit(r, collectors[r.req_id].on_event)
    time.sleep(0.1)  # let the background class start running
    for r in late:
        engine.submit(r, collectors[r.req_id].on_event)
    results = {r.req_id: collectors[r.req_id].wait(r.req_id) for r in early + late}
    for result in results.values():
        assert result.finish.reason is FinishReason.MAX_TOKENS, result.finish
    return {req_id: result.token_ids for req_id, result in results.items()}


def test_swapped_and_recomputed_requests_match_the_unpreempted_run(tiny_model_dir):
    deadline = time.monotonic() + 600.0
    common = dict(
        model=str(tiny_model_dir), dtype="float32", block_size=BLOCK, max_num_batched_tokens=64
    )
    reference = Engine(
        EngineConfig(**common, num_device_blocks=256, num_host_blocks=0, policy="fcfs")
    )
    vocab = reference.info.vocab_size
    early, late = _requests(vocab, 0, 4, deadline), _requests(vocab, 4, 8, deadline)
    try:
        expected = _run(reference, early, late)
        assert (
            reference.scheduler.num_swap_preemptions
            == reference.scheduler.num_recompute_preemptions
            == 0
        )
    finally:
        reference.shutdown()

    tight = Engine(
        EngineConfig(
            **common, num_device_blocks=8, num_host_blocks=10, max_num_seqs=3, policy="deadline"
        )
    )
    try:
        got = _run(tight, early, late)
        sched = tight.scheduler
        stats = tight.stats()
    finally:
        tight.shutdown()
    assert sched.num_swap_preemptions >= 3, "the tiny pools must force swaps"
    assert sched.num_recompute_preemptions >= 1, "and, with the host pool full, recomputes"
    assert got == expected
    assert stats.device_blocks.used == 0 and stats.host_blocks.used == 0

"""Prefix caching: chained block hashes, sharing by reference count, LRU
eviction of released cached blocks, and how the scheduler uses them
(admission past the cached prefix, preemption of a sharer, accounting)."""

from __future__ import annotations

import pytest
from sched_fakes import Driver, SwapPolicy, check_pools, reference_outputs

from slipstream.scheduler import (
    BlockAccountingError,
    BlockPool,
    CostModel,
    DeadlinePolicy,
    FinishReason,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)
from slipstream.scheduler.block_manager import extend_block_hashes, hash_block
from slipstream.scheduler.policy_base import FcfsPolicy

BLOCK = 4
SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # three full blocks


def _request(req_id: str, prompt: list[int], max_new: int = 3, **kwargs: object) -> Request:
    return Request(req_id=req_id, prompt_token_ids=prompt, max_new_tokens=max_new, **kwargs)  # type: ignore[arg-type]


def _scheduler(num_blocks: int = 32, *, enable_prefix_cache: bool = True) -> Scheduler:
    config = SchedulerConfig(
        num_device_blocks=num_blocks,
        block_size=BLOCK,
        max_model_len=64,
        enable_prefix_cache=enable_prefix_cache,
    )
    return Scheduler(config, FcfsPolicy())


# -- hashes ----------------------------------------------------------------


def test_block_hash_depends_on_tokens_and_whole_prefix() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    # Same block tokens after a different prefix: a different block.
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    # Token ids are not confused by their byte encoding (large and negative ids).
    assert hash_block(None, [1, 256]) != hash_block(None, [256, 1])


def test_block_hashes_extend_incrementally_and_only_over_full_blocks() -> None:
    tokens = list(range(10))
    whole: list[bytes] = []
    extend_block_hashes(whole, tokens, BLOCK, 2)
    step: list[bytes] = []
    extend_block_hashes(step, tokens, BLOCK, 1)
    extend_block_hashes(step, tokens, BLOCK, 2)
    assert whole == step and len(whole) == 2
    with pytest.raises(ValueError):
        extend_block_hashes(step, tokens, BLOCK, 3)  # 10 tokens fill only two blocks


# -- the pool ----------------------------------------------------------------


def test_released_cached_blocks_stay_findable_and_count_as_free() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    blocks = pool.allocate(2)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(8)), BLOCK, 2)
    assert pool.cache(blocks[0], hashes[0]) and pool.cache(blocks[1], hashes[1])
    assert pool.lookup(hashes) == blocks
    pool.free(blocks)
    assert (pool.num_free, pool.num_used, pool.num_evictable) == (4, 0, 2)
    assert pool.lookup(hashes) == blocks  # K/V kept until evicted
    assert pool.num_free_taken_by_share(blocks) == 2
    pool.share(blocks[:1])  # a hit takes an evictable block back
    assert (pool.num_free, pool.num_used, pool.ref_count(blocks[0])) == (3, 1, 1)
    pool.check()


def test_allocate_takes_never_cached_blocks_first_then_evicts_least_recent() -> None:
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    old, new = pool.allocate(2), pool.allocate(1)
    for block, token in ((old[0], 1), (old[1], 2), (new[0], 3)):
        pool.cache(block, hash_block(None, [token] * BLOCK))
    pool.free(old)  # released first: evicted first; within one call, the tail first
    pool.free(new)
    assert pool.allocate(1) == [3]  # the never-cached block
    assert pool.num_cached == 3
    assert pool.allocate(1) == [old[1]]  # the tail of the first release
    assert pool.lookup([hash_block(None, [2] * BLOCK)]) == []  # evicted: gone from the cache
    assert pool.allocate(2) == [old[0], new[0]]
    assert (pool.num_evictions, pool.num_cached, pool.num_free) == (3, 0, 0)
    pool.check()


def test_a_hash_names_one_block_and_only_used_blocks_are_cached() -> None:
    pool = BlockPool(num_blocks=3, block_size=BLOCK)
    a, b = pool.allocate(2)
    h = hash_block(None, [7] * BLOCK)
    assert pool.cache(a, h)
    assert not pool.cache(b, h)  # a duplicate computed side by side stays private
    assert not pool.cache(a, hash_block(None, [8] * BLOCK))  # already registered
    pool.free([b])
    assert pool.num_evictable == 0  # b was never cached: plainly free
    with pytest.raises(BlockAccountingError):
        pool.cache(b, hash_block(None, [9] * BLOCK))
    with pytest.raises(BlockAccountingError):
        pool.share([b])
    pool.check()


# -- the scheduler -----------------------------------------------------------


def _run_alone(sched: Scheduler, driver: Driver, req: Request) -> None:
    sched.add_request(req, driver.now)
    driver.run_until_idle()
    assert driver.outputs[req.req_id] == reference_outputs(req)


def test_a_request_skips_the_prefill_of_the_cached_prefix() -> None:
    sched = _scheduler()
    driver = Driver(sched)
    _run_alone(sched, driver, _request("a", [*SYSTEM, 1, 2]))
    assert sched.num_used_device_blocks == 0 and sched.num_cached_device_blocks >= 3

    b = _request("b", [*SYSTEM, 3, 4, 5])
    sched.add_request(b, driver.now)
    plan = sched.schedule(driver.now + 1)
    [seq] = plan.seqs
    assert seq.start_pos == len(SYSTEM) and seq.token_ids == [3, 4, 5]
    assert b.num_cached_tokens == len(SYSTEM)
    driver.record(sched.update(plan, driver.runner.execute(plan), driver.now + 1))
    driver.run_until_idle()
    assert driver.outputs["b"] == reference_outputs(b)
    assert sched.num_prefix_hit_tokens == len(SYSTEM)
    assert sched.num_prefix_queried_tokens == 14 + 15
    check_pools(sched)


def test_running_requests_share_prefix_blocks_by_reference_count() -> None:
    sched = _scheduler()
    driver = Driver(sched)
    first = _request("first", [*SYSTEM, 1], max_new=8)
    sched.add_request(first, driver.now)
    driver.step()  # prefilled: its full blocks are cached while it still runs
    others = [_request(f"o{i}", [*SYSTEM, 2 + i, 3], max_new=5) for i in range(3)]
    for req in others:
        sched.add_request(req, driver.now)
    driver.step()
    shared = first.block_ids[:3]
    for req in others:
        assert req.block_ids[:3] == shared and req.num_cached_tokens == len(SYSTEM)
    assert [sched.device_pool.ref_count(b) for b in shared] == [4, 4, 4]
    check_pools(sched)
    driver.run_until_idle()
    for req in [first, *others]:
        assert driver.outputs[req.req_id] == reference_outputs(req)
    assert sched.num_used_device_blocks == 0
    check_pools(sched)


def test_a_wholly_cached_prompt_still_computes_its_last_block() -> None:
    sched = _scheduler()
    driver = Driver(sched)
    _run_alone(sched, driver, _request("a", list(SYSTEM)))
    again = _request("again", list(SYSTEM))
    sched.add_request(again, driver.now)
    plan = sched.schedule(driver.now + 1)
    [seq] = plan.seqs
    # The last token must be computed for logits, and its block is not shared.
    assert seq.start_pos == len(SYSTEM) - BLOCK and seq.sample
    assert again.num_cached_tokens == len(SYSTEM) - BLOCK
    assert sched.device_pool.ref_count(seq.block_ids[-1]) == 1


def test_without_the_prefix_cache_nothing_is_shared() -> None:
    sched = _scheduler(enable_prefix_cache=False)
    driver = Driver(sched)
    _run_alone(sched, driver, _request("a", [*SYSTEM, 1]))
    b = _request("b", [*SYSTEM, 1])
    sched.add_request(b, driver.now)
    plan = sched.schedule(driver.now + 1)
    assert plan.seqs[0].start_pos == 0 and b.num_cached_tokens == 0
    assert sched.num_cached_device_blocks == 0 and sched.num_prefix_queried_tokens == 0


def test_cached_blocks_are_evicted_when_free_blocks_run_out() -> None:
    sched = _scheduler(num_blocks=5)
    driver = Driver(sched)
    _run_alone(sched, driver, _request("a", [*SYSTEM, 1], max_new=2))
    assert sched.num_free_device_blocks == 5  # the cached blocks count as free
    # A different 18-token request needs all five blocks: the cache gives way.
    other = _request("other", list(range(40, 58)), max_new=2)
    _run_alone(sched, driver, other)
    assert sched.device_pool.num_evictions >= 3
    b = _request("b", [*SYSTEM, 1])
    sched.add_request(b, driver.now)
    driver.step()
    assert b.num_cached_tokens == 0  # the system prompt was evicted
    check_pools(sched)


def test_recompute_preemption_finds_its_own_prefix_again() -> None:
    sched = _scheduler(num_blocks=8)
    driver = Driver(sched)
    a = _request("a", [*SYSTEM, 1], max_new=8)
    b = _request("b", list(range(40, 49)), max_new=8)
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    driver.run_until_idle()
    assert sched.num_recompute_preemptions > 0
    # The re-admission found blocks it computed before it was pushed out ...
    [pushed_out] = [p.step for p in driver.plans if p.preempted_req_ids == ["b"]]
    readmission = next(s for p in driver.plans[pushed_out:] for s in p.seqs if s.req_id == "b")
    assert readmission.start_pos > 0 and readmission.output_index > 0
    # ... which is no reuse: the hit counters and the requests' cached tokens agree.
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert sched.num_prefix_hit_tokens == 0
    assert sched.num_prefix_queried_tokens == a.num_prompt_tokens + b.num_prompt_tokens
    for req in (a, b):
        assert driver.outputs[req.req_id] == reference_outputs(req)
    check_pools(sched)


def _swap_scene() -> tuple[Scheduler, Driver, Request, Request]:
    """``holder`` and ``sharer`` share SYSTEM's three blocks; the device pool
    runs out while both decode, and the later arrival, ``sharer``, is swapped."""
    config = SchedulerConfig(
        num_device_blocks=14,
        block_size=BLOCK,
        max_model_len=64,
        num_host_blocks=16,
        enable_prefix_cache=True,
    )
    sched = Scheduler(config, SwapPolicy())
    driver = Driver(sched)
    holder = _request("holder", [*SYSTEM, 1], max_new=30)
    sharer = _request("sharer", [*SYSTEM, 2, 3, 4, 5, 6], max_new=20)
    sched.add_request(holder, 0.0)
    driver.step()
    sched.add_request(sharer, driver.now)
    while sharer.status is not RequestStatus.SWAPPED:
        driver.step()
        check_pools(sched)
    assert sharer.num_cached_tokens == len(SYSTEM) and sharer.num_released_blocks == 3
    return sched, driver, holder, sharer


def test_swap_out_copies_only_owned_blocks_and_swap_in_shares_the_prefix_again() -> None:
    sched, driver, holder, sharer = _swap_scene()
    [plan] = [p for p in driver.plans if p.swap_out]
    prefix = holder.block_ids[:3]
    assert not {device for device, _ in plan.swap_out} & set(prefix)
    assert len(plan.swap_out) == len(sharer.host_block_ids)
    assert [sched.device_pool.ref_count(b) for b in prefix] == [1, 1, 1]  # released
    driver.run_until_idle()
    assert sched.num_swap_preemptions == 1 and sched.num_lost_swaps == 0
    [swap_in] = [p for p in driver.plans if p.swap_in]
    [seq] = [s for s in swap_in.seqs if s.req_id == "sharer"]
    assert seq.block_ids[:3] == prefix  # the same cached blocks, shared again
    for req in (holder, sharer):
        assert driver.outputs[req.req_id] == reference_outputs(req)
    check_pools(sched)


def test_a_swapped_request_whose_prefix_was_evicted_is_recomputed() -> None:
    sched, driver, holder, sharer = _swap_scene()
    sched.abort_request(holder.req_id)
    # Evict everything cached: take the whole pool, then give it back.
    pool = sched.device_pool
    pool.free(pool.allocate(pool.num_free))
    assert pool.num_cached == 0
    driver.run_until_idle()
    assert sched.num_lost_swaps == 1
    assert driver.outputs["sharer"] == reference_outputs(sharer)
    assert sharer.finish_reason is FinishReason.MAX_TOKENS
    assert sched.num_used_host_blocks == sched.num_used_device_blocks == 0
    check_pools(sched)


def test_the_deadline_policy_charges_nothing_for_cached_tokens() -> None:
    config = SchedulerConfig(
        num_device_blocks=32, block_size=BLOCK, max_model_len=64, enable_prefix_cache=True
    )
    policy = DeadlinePolicy(config, CostModel())
    sched = Scheduler(config, policy)
    driver = Driver(sched)
    _run_alone(sched, driver, _request("a", [*SYSTEM, 1]))
    cached = _request("cached", [*SYSTEM, 2], deadline=driver.now + 100)
    cold = _request("cold", [*range(40, 52), 2], deadline=driver.now + 100)
    sched.add_request(cached, driver.now)
    sched.add_request(cold, driver.now)
    assert cached.status is RequestStatus.WAITING and cached.num_known_kv_tokens == len(SYSTEM)
    assert policy.remaining_seconds(cached) < policy.remaining_seconds(cold)


def test_cancel_and_expiry_release_only_the_requests_own_references() -> None:
    sched = _scheduler()
    driver = Driver(sched)
    holder = _request("holder", [*SYSTEM, 1], max_new=20)
    sched.add_request(holder, 0.0)
    driver.step()
    cancelled = _request("cancelled", [*SYSTEM, 2], max_new=20)
    expiring = _request("expiring", [*SYSTEM, 3], max_new=20, deadline=driver.now + 2.5)
    sched.add_request(cancelled, driver.now)
    sched.add_request(expiring, driver.now)
    driver.step()
    prefix = holder.block_ids[:3]
    assert [sched.device_pool.ref_count(b) for b in prefix] == [3, 3, 3]
    driver.abort("cancelled")
    assert [sched.device_pool.ref_count(b) for b in prefix] == [2, 2, 2]
    while "expiring" not in driver.finishes:
        driver.step()
    assert driver.finishes["expiring"] == [FinishReason.DEADLINE_EXCEEDED]
    assert [sched.device_pool.ref_count(b) for b in prefix] == [1, 1, 1]
    assert holder.block_ids[:3] == prefix
    check_pools(sched)
    driver.run_until_idle()
    assert driver.outputs["holder"] == reference_outputs(holder)
    assert sched.num_used_device_blocks == 0 and sched.device_pool.num_evictable > 0
    check_pools(sched)

from __future__ import annotations

import pytest

from slipstream.scheduler import BlockAccountingError, BlockPool, SchedulerConfig


def test_allocate_append_free_keep_free_plus_used_equal_total() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    table = pool.allocate(pool.blocks_for(6))
    assert table == [0, 1]
    assert (pool.num_free, pool.num_used) == (3, 2)

    assert pool.append(table, 8) == []  # 8 tokens still fit two blocks
    assert pool.num_blocks_to_append(table, 9) == 1
    table += pool.append(table, 9)
    assert len(table) == 3 and pool.num_free + pool.num_used == 5

    assert not pool.can_append(table, 4 * 6)  # needs 3 more, 2 free
    with pytest.raises(BlockAccountingError):
        pool.append(table, 4 * 6)
    assert pool.num_used == 3  # the failed commit changed nothing

    pool.free(table)
    assert (pool.num_free, pool.num_used) == (5, 0)
    pool.check()


def test_reference_counts_free_a_block_only_when_the_last_holder_lets_go() -> None:
    pool = BlockPool(num_blocks=2, block_size=1)
    [block] = pool.allocate(1)
    pool.share([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.num_used == 1 and pool.ref_count(block) == 1
    pool.free([block])
    assert pool.num_used == 0
    with pytest.raises(BlockAccountingError):
        pool.free([block])
    with pytest.raises(BlockAccountingError):
        pool.share([block])
    pool.check()


def test_empty_pool_serves_nothing() -> None:
    pool = BlockPool(num_blocks=0, block_size=16)
    assert pool.can_allocate(0) and not pool.can_allocate(1)
    assert pool.allocate(0) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_device_blocks": 0},
        {"block_size": 0},
        {"max_model_len": 0},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"num_host_blocks": -1},
        {"max_queue_len": 0},
    ],
)
def test_config_rejects_nonsense(kwargs: dict[str, int]) -> None:
    base = {"num_device_blocks": 8, "block_size": 4, "max_model_len": 32}
    with pytest.raises(ValueError):
        SchedulerConfig(**{**base, **kwargs})

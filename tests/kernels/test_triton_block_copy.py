"""Triton block copy (under the interpreter) against ``reference_copy_blocks``."""

from __future__ import annotations

import pytest
import torch
from paged_fixtures import to_head_major
from triton_modules import interpreted

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def block_copy():
    return interpreted("triton_block_copy")


def _pool(num_layers, num_blocks, dtype, seed, shape=(16, 2, 64), head_major=False):
    generator = torch.Generator().manual_seed(seed)
    layout = to_head_major if head_major else (lambda cache: cache)
    return [
        tuple(
            layout(torch.randn((num_blocks, *shape), generator=generator).to(dtype))
            for _ in range(2)
        )
        for _ in range(num_layers)
    ]


def _clone(pool):
    return [tuple(t.clone() for t in layer) for layer in pool]


def _assert_pools_equal(actual, expected):
    for layer_a, layer_e in zip(actual, expected, strict=True):
        for a, e in zip(layer_a, layer_e, strict=True):
            assert torch.equal(a, e)


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "pairs", "dtype", "layouts"),
    [
        # swap out to a bigger host pool, both head-major as the engine allocates them
        (6, 10, [(0, 9), (5, 0), (2, 3)], torch.float32, (True, True)),
        (10, 6, [(9, 1)], torch.bfloat16, (False, False)),  # swap in
        (8, 8, [(i, 7 - i) for i in range(8)], torch.bfloat16, (True, False)),  # every block
    ],
)
def test_copy_between_pools(block_copy, src_blocks, dst_blocks, pairs, dtype, layouts):
    src = _pool(3, src_blocks, dtype, 1, head_major=layouts[0])
    dst = _pool(3, dst_blocks, dtype, 2, head_major=layouts[1])
    expected = _clone(dst)
    block_copy.reference_copy_blocks(src, expected, pairs)
    block_copy.triton_copy_blocks(src, dst, pairs)
    _assert_pools_equal(dst, expected)


@pytest.mark.parametrize(
    "pairs",
    [
        [(0, 4), (1, 5)],  # copy-on-write: fresh destinations
        [(0, 1), (1, 2), (2, 0)],  # a rotation: every source is also a destination
    ],
)
def test_copy_within_one_pool_reads_before_writing(block_copy, pairs):
    pool = _pool(2, 6, torch.float32, 3, shape=(32, 4, 128), head_major=True)
    expected = _clone(pool)
    block_copy.reference_copy_blocks(expected, expected, pairs)
    block_copy.triton_copy_blocks(pool, pool, pairs)
    _assert_pools_equal(pool, expected)


def test_rejects_bad_pairs(block_copy):
    src, dst = _pool(1, 4, torch.float32, 0), _pool(1, 4, torch.float32, 1)
    with pytest.raises(ValueError, match="distinct"):
        block_copy.triton_copy_blocks(src, dst, [(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="out of range"):
        block_copy.triton_copy_blocks(src, dst, [(4, 0)])
    with pytest.raises(ValueError, match="block shapes"):
        block_copy.triton_copy_blocks(src, _pool(1, 4, torch.float32, 1, (16, 2, 32)), [(0, 0)])

"""KV pools on the CPU come from an anonymous memory map: zero, writable,
page-aligned, head-major, and cheap to allocate however large."""

from __future__ import annotations

import mmap
import time

import pytest
import torch

from slipstream.kernels.kv_layout import allocate_kv_cache, head_major


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_pool_is_zero_writable_aligned_and_head_major(dtype: torch.dtype) -> None:
    cache = allocate_kv_cache(7, 16, 3, 64, dtype)
    assert cache.shape == (7, 16, 3, 64) and cache.dtype == dtype
    storage = head_major(cache)
    assert storage is not None and storage.data_ptr() % mmap.PAGESIZE == 0
    assert not cache.any()
    cache[3, 5] = 1.5
    assert cache.sum().item() == 1.5 * 3 * 64
    again = allocate_kv_cache(7, 16, 3, 64, dtype)
    assert not again.any(), "a fresh pool never sees another pool's values"


def test_a_large_pool_is_not_written_at_allocation() -> None:
    start = time.perf_counter()
    caches = [allocate_kv_cache(4096, 32, 4, 64, torch.float32) for _ in range(8)]  # 1 GiB
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"{elapsed:.2f} s: the pages were touched"
    assert not caches[-1][-1].any()


def test_empty_pool() -> None:
    assert allocate_kv_cache(0, 16, 2, 8, torch.float32).numel() == 0

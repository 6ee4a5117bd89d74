"""KV pools on the CPU come from an anonymous memory map: zero, writable,
page-aligned, head-major, and cheap to allocate however large."""

from __future__ import annotations

import mmap
import time

import pytest
import torch

from slipstream.kernels.kv_layout import (
    INT8_SCALE_BYTES,
    allocate_kv_cache,
    cache_head_dim,
    dequantize_rows,
    fill_normal_,
    head_major,
    quantize_rows,
    row_width,
)


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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(not hasattr(mmap.mmap, "madvise"), reason="needs mmap.madvise")
def test_a_committed_pool_is_resident_at_once_and_zero() -> None:
    """``commit``: the memory is taken at allocation, not as blocks are first
    used, so a server's RSS does not creep up as the prefix cache fills."""
    pool_bytes = 4096 * 32 * 4 * 32 * 4  # 64 MiB
    before = _rss_bytes()
    lazy = allocate_kv_cache(4096, 32, 4, 32, torch.float32)
    after_lazy = _rss_bytes()
    committed = allocate_kv_cache(4096, 32, 4, 32, torch.float32, commit=True)
    after_commit = _rss_bytes()
    assert after_lazy - before < pool_bytes // 8
    assert after_commit - after_lazy > pool_bytes * 9 // 10
    # Now reading every page costs nothing more: it is all resident already
    # (a lazy pool would add its 64 MiB; the margin is for what the rest of a
    # busy test process allocates meanwhile: 8.8 MB was seen once). Read by a
    # sum: ``any()`` of a float tensor makes a bool copy of it (16 MiB here),
    # resident after it is freed once glibc's mmap threshold has risen.
    assert committed.sum().item() == 0.0
    assert _rss_bytes() - after_commit < pool_bytes // 4
    assert not committed.any() and lazy.shape == committed.shape


def test_committing_falls_back_to_writing_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older kernel refuses MADV_POPULATE_WRITE: the pages are written instead."""
    from slipstream.kernels import kv_layout

    def refuse(self: object, option: int, *args: object) -> None:
        raise OSError(22, "Invalid argument")

    class OldKernelMap(mmap.mmap):
        madvise = refuse  # type: ignore[assignment]

    monkeypatch.setattr(kv_layout.mmap, "mmap", OldKernelMap)
    before = _rss_bytes()
    cache = allocate_kv_cache(1024, 32, 4, 32, torch.float32, commit=True)  # 16 MiB
    assert _rss_bytes() - before > 14 * 2**20
    assert not cache.any()


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_a_pool_asks_for_huge_pages_and_does_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every CPU pool is advised MADV_HUGEPAGE; a kernel that refuses the
    advice leaves a working, zeroed, uncommitted pool."""
    from slipstream.kernels import kv_layout

    advised: list[int] = []

    class RecordingMap(mmap.mmap):
        def madvise(self, option: int, *args: int) -> None:
            advised.append(option)
            if option == mmap.MADV_HUGEPAGE:
                raise OSError(22, "Invalid argument")
            super().madvise(option, *args)

    monkeypatch.setattr(kv_layout.mmap, "mmap", RecordingMap)
    before = _rss_bytes()
    cache = allocate_kv_cache(1024, 32, 4, 32, torch.float32)  # 16 MiB
    assert advised == [mmap.MADV_HUGEPAGE]
    assert _rss_bytes() - before < 4 * 2**20
    cache[5].fill_(1.0)
    assert cache[5].eq(1.0).all() and not cache[6].any()


def test_int8_rows_hold_values_within_half_a_step_and_their_scale() -> None:
    """Each row: head_dim int8 values, then its float32 scale (max |x| / 127,
    with a floor);
    dequantized, every value is within half a step of what was written, the
    largest exactly at +-127 steps; a row of zeros stays zeros."""
    x = (
        torch.randn(5, 3, 64, dtype=torch.float64).float()
        * torch.tensor([0.01, 1.0, 300.0])[:, None]
    )
    x[4, 2] = 0.0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 64 + INT8_SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(
        scale[..., 0], x.abs().amax(-1).clamp_min(1e-30) / 127, rtol=1e-6, atol=0
    )
    back = dequantize_rows(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert rows[..., :64].abs().amax(-1)[:4].eq(127).all() and not back[4, 2].any()


def test_an_int8_cache_has_rows_of_values_and_scale() -> None:
    cache = allocate_kv_cache(7, 16, 3, 64, torch.int8)
    assert cache.shape == (7, 16, 3, 68) and head_major(cache) is not None
    assert cache_head_dim(cache) == 64 and row_width(64, torch.float32) == 64
    with pytest.raises(ValueError, match="head_dim % 4"):
        allocate_kv_cache(7, 16, 3, 66, torch.int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_fill_normal_fills_every_row_with_standard_normal_values(dtype: torch.dtype) -> None:
    cache = allocate_kv_cache(4, 16, 2, 64, dtype)
    fill_normal_(cache, torch.Generator().manual_seed(0))
    values = dequantize_rows(cache, torch.float32) if dtype == torch.int8 else cache
    assert values.shape == (4, 16, 2, 64) and values.abs().amax(dim=-1).gt(0).all()
    assert abs(values.mean().item()) < 0.05 and abs(values.std().item() - 1) < 0.05
    if dtype == torch.int8:  # each row quantized on its own: its largest value at 127
        assert cache[..., :64].abs().amax(dim=-1).eq(127).all()

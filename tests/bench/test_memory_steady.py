"""Ten benchmark runs in one process leave memory where the first ones left it:
engines, KV pools and per-run buffers are released (issue: no memory growth)."""

from __future__ import annotations

import gc
import resource
from pathlib import Path

import pytest

from slipstream.service.bench.offline import OfflineOptions, run_slipstream
from slipstream.service.bench.workload import make_workload


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


@pytest.mark.slow
def test_ten_runs_in_one_process_do_not_grow_memory(tiny_model_dir: Path) -> None:
    options = OfflineOptions(
        model=str(tiny_model_dir), num_requests=24, seed=0, engines=("slipstream",),
        dtype="float32", num_threads=2, prompt_len=(8, 64), output_len=(4, 32), kv_memory="lazy",
    )  # fmt: skip
    workload = make_workload(24, 0, 1024, prompt_len=(8, 64), output_len=(4, 32))
    rss = []
    for _ in range(10):
        run = run_slipstream(str(tiny_model_dir), workload, options)
        assert sum(t.num_output_tokens for t in run.timings) == sum(r.max_tokens for r in workload)
        del run
        gc.collect()
        rss.append(_rss_mb())
    print("RSS after each run (MB):", [round(r) for r in rss])
    # The first runs warm allocator arenas and caches; after them RSS is flat.
    growth = rss[-1] - rss[2]
    assert growth < 0.05 * rss[2] + 16, f"RSS per run (MB): {[round(r) for r in rss]}"

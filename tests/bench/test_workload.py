from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from slipstream.service.bench.workload import (
    NUM_SPECIAL_IDS,
    WorkloadRequest,
    load_workload,
    make_workload,
    save_workload,
    workload_summary,
)


def test_same_seed_same_workload_other_seed_differs() -> None:
    first = make_workload(32, seed=7, vocab_size=8192)
    assert first == make_workload(32, seed=7, vocab_size=8192)
    assert first != make_workload(32, seed=8, vocab_size=8192)


def test_lengths_and_ids_stay_in_range() -> None:
    reqs = make_workload(500, seed=0, vocab_size=300, prompt_len=(16, 512), output_len=(8, 256))
    assert len(reqs) == 500
    for req in reqs:
        assert 16 <= len(req.prompt_token_ids) <= 512
        assert 8 <= req.max_tokens <= 256
        assert all(NUM_SPECIAL_IDS <= t < 300 for t in req.prompt_token_ids)


def test_lengths_are_log_uniform_not_uniform() -> None:
    # Log-uniform over [8, 256]: the median sits near the geometric mean (~45),
    # far below the arithmetic midpoint (132) a uniform draw would give.
    lens = sorted(r.max_tokens for r in make_workload(2000, seed=1, vocab_size=100))
    median = lens[len(lens) // 2]
    assert math.isclose(median, math.sqrt(8 * 257), rel_tol=0.2)
    # And both ends of the range are reached.
    assert lens[0] <= 9 and lens[-1] >= 240


def test_save_load_round_trip(tmp_path: Path) -> None:
    reqs = make_workload(10, seed=3, vocab_size=1000)
    path = tmp_path / "w.jsonl"
    save_workload(path, reqs)
    lines = path.read_text().splitlines()
    assert len(lines) == 10
    assert set(json.loads(lines[0])) == {"prompt_token_ids", "max_tokens"}
    assert load_workload(path) == reqs


def test_load_rejects_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_token_ids": [5, 6], "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        load_workload(path)
    path.write_text('{"prompt_token_ids": [], "max_tokens": 3}\n')
    with pytest.raises(ValueError, match="prompt_token_ids"):
        load_workload(path)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        make_workload(4, seed=0, vocab_size=NUM_SPECIAL_IDS)
    with pytest.raises(ValueError):
        make_workload(4, seed=0, vocab_size=100, prompt_len=(10, 5))


def test_summary_counts() -> None:
    reqs = [WorkloadRequest([5, 6, 7], 4), WorkloadRequest([8], 10)]
    summary = workload_summary(reqs)
    assert summary["num_prompt_tokens"] == 4
    assert summary["num_output_tokens"] == 14
    assert (summary["min_prompt_len"], summary["max_output_len"]) == (1, 10)

"""``slipstream bench prefix`` end to end on the ``tiny`` model: both modes
run on one workload, the cache hits only when on, the report carries the
CPU, and bad options fail with a usage error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.service.bench.prefix import (
    PrefixBenchError,
    PrefixOptions,
    make_prefix_workload,
)
from slipstream.service.cli import main


def test_caching_on_and_off_on_one_workload(tmp_path: Path, tiny_model_dir: Path) -> None:
    report_path, plot_path = tmp_path / "prefix.json", tmp_path / "prefix.png"
    argv = ["bench", "prefix", "--model", str(tiny_model_dir), "--requests", "6"]
    argv += ["--system-len", "160", "--max-tokens", "3", "--dtype", "float32"]
    argv += ["--block-size", "16", "--json", str(report_path), "--plot", str(plot_path)]
    argv += ["--kv-memory", "lazy"]  # times nothing; committing 2 GiB can take seconds
    assert main(argv) == 0
    report = json.loads(report_path.read_text())
    assert report["environment"]["kv_memory"] == "lazy"
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on, off = report["modes"]["on"], report["modes"]["off"]
    for mode in (on, off):
        assert mode["num_output_tokens"] == 6 * 3
        assert mode["ttft_p50_s"] > 0 and mode["output_tokens_per_s"] > 0
    assert off["hit_rate"] == 0 and off["num_cached_prompt_tokens"] == 0
    assert on["settings"]["prefix_cache"] and not off["settings"]["prefix_cache"]
    # Cold at t0: at least the first request computes the 10 shared blocks;
    # most of the others find them.
    assert 0 < on["num_cached_prompt_tokens"] <= 5 * 160
    assert 0 < on["hit_rate"] < 1
    assert set(report["ratios"]) == {"ttft_p50_off/on", "throughput_on/off"}
    assert "flags" in report["environment"]["cpu"]


def test_workload_shares_one_system_prompt_and_is_seeded() -> None:
    options = PrefixOptions(num_requests=5, system_len=30, question_len=(2, 4), seed=3)
    first = make_prefix_workload(options, vocab_size=100)
    assert first == make_prefix_workload(options, vocab_size=100)
    assert len({tuple(r.prompt_token_ids[:30]) for r in first}) == 1
    assert len({tuple(r.prompt_token_ids[30:]) for r in first}) == 5
    assert all(4 <= t < 100 for r in first for t in r.prompt_token_ids)


@pytest.mark.parametrize(
    "bad", [dict(num_requests=0), dict(system_len=0), dict(question_len=(5, 2)), dict(max_tokens=0)]
)
def test_bad_options_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(PrefixBenchError):
        PrefixOptions(**bad)  # type: ignore[arg-type]


def test_bad_options_are_a_usage_error(tiny_model_dir: Path, capsys) -> None:
    assert main(["bench", "prefix", "--model", str(tiny_model_dir), "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err


def test_a_warm_cache_serves_every_request_its_system_prompt(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from slipstream.service.bench.prefix import run_prefix

    options = PrefixOptions(
        model=str(tiny_model_dir),
        num_requests=4,
        system_len=100,
        max_tokens=2,
        block_size=16,
        warm=True,
        kv_memory="lazy",
    )
    report = run_prefix(options)
    assert report["workload"]["cache_at_t0"] == "warm"  # type: ignore[index]
    on = report["modes"]["on"]  # type: ignore[index]
    assert on["num_cached_prompt_tokens"] == 4 * 96  # six full blocks each


def test_the_engines_commit_their_kv_pools_as_serve_does() -> None:
    """Lazily mapped, a cold request's fresh blocks would fault their pages in
    inside its TTFT while a cached prefix's blocks would not."""
    from slipstream.service.bench.prefix import engine_config

    assert engine_config("tiny", PrefixOptions(), prefix_cache=True).commit_kv_memory
    lazy = PrefixOptions(kv_memory="lazy")
    assert not engine_config("tiny", lazy, prefix_cache=False).commit_kv_memory

"""Smoke test of ``slipstream bench offline`` end to end on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest

from slipstream.service.bench.workload import load_workload
from slipstream.service.cli import main

ENGINE_KEYS = {"output_tokens_per_s", "wall_s", "p50_s", "p95_s", "ttft_p50_s", "num_output_tokens"}
SMALL_WORKLOAD = ["--requests", "5", "--prompt-len", "4", "40", "--output-len", "2", "12"]


def _bench(tmp_path: Path, model_dir: Path, engines: str, *extra: str) -> dict:
    report_path = tmp_path / "report.json"
    argv = ["bench", "offline", "--model", str(model_dir), "--engines", engines, "--threads", "2"]
    # Lazy KV pools: these runs time nothing, and committing a 2 GiB pool can
    # take seconds on a machine whose free memory the hypervisor took back.
    argv += [*SMALL_WORKLOAD, "--json", str(report_path), "--kv-memory", "lazy", *extra]
    assert main(argv) == 0
    return json.loads(report_path.read_text())


def test_peers_on_one_workload(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    workload_path = tmp_path / "w.jsonl"
    plot_path = tmp_path / "offline.png"
    report = _bench(
        tmp_path,
        tiny_model_dir,
        "hf_static,hf_cb",
        "--save-workload",
        str(workload_path),
        "--plot",
        str(plot_path),
    )
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    expected_tokens = sum(r.max_tokens for r in load_workload(workload_path))
    assert set(report) >= {"engines", "workload", "ratios"}
    assert set(report["engines"]) == {"hf_static", "hf_cb"}
    assert report["workload"]["num_output_tokens"] == expected_tokens
    for metrics in report["engines"].values():
        assert set(metrics) >= ENGINE_KEYS
        assert metrics["num_output_tokens"] == expected_tokens
        assert metrics["output_tokens_per_s"] > 0
        assert metrics["settings"]["num_threads"] == 2
    assert report["ratios"] == {}
    assert "hf_cb" in capsys.readouterr().out


def test_replayed_workload_is_the_saved_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    saved = tmp_path / "saved.jsonl"
    saved.write_text('{"prompt_token_ids": [5, 6, 7], "max_tokens": 3}\n')
    report = _bench(tmp_path, tiny_model_dir, "hf_cb", "--workload", str(saved))
    assert report["workload"]["num_requests"] == 1
    assert report["engines"]["hf_cb"]["num_output_tokens"] == 3


def test_unknown_engine_is_a_usage_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["bench", "offline", "--model", str(tiny_model_dir), "--engines", "tgi"]
    assert main(argv) == 2


@pytest.mark.skipif(
    importlib.util.find_spec("slipstream.service.engine.engine") is None,
    reason="the Slipstream engine is not built yet",
)
def test_slipstream_against_peers(tmp_path: Path, tiny_model_dir: Path) -> None:
    report = _bench(tmp_path, tiny_model_dir, "slipstream,hf_static,hf_cb", "--block-size", "16")
    engines = report["engines"]
    assert engines["slipstream"]["num_output_tokens"] == engines["hf_cb"]["num_output_tokens"]
    assert set(engines["slipstream"]) >= ENGINE_KEYS
    assert engines["slipstream"]["settings"]["block_size"] == 16
    assert engines["slipstream"]["settings"]["max_num_batched_tokens"] == 512  # the CPU's budget
    assert set(report["ratios"]) == {"slipstream/hf_static", "slipstream/hf_cb"}


def test_a_peer_that_raises_fails_alone(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    """transformers' API moves between versions: a peer's own error is its
    report entry, and the other engines' figures are still measured."""
    from slipstream.service.bench import hf_peers

    def broken(*args: object, **kwargs: object) -> None:
        raise AttributeError("'ContinuousBatchingConfig' object has no attribute 'page_size'")

    monkeypatch.setattr(hf_peers, "run_hf_cb", broken)
    report = _bench(tmp_path, tiny_model_dir, "hf_cb,hf_static")
    assert "page_size" in report["engines"]["hf_cb"]["error"]
    assert report["engines"]["hf_static"]["output_tokens_per_s"] > 0


def test_the_report_carries_the_floor_of_this_cpu(tmp_path: Path, tiny_model_dir: Path) -> None:
    report = _bench(tmp_path, tiny_model_dir, "slipstream")
    floor = report["floor"]
    assert floor["matmul_flop_per_s"] > 0 and floor["read_bytes_per_s"] > 0
    assert floor["wall_s"] == pytest.approx(
        floor["projections_s"] + floor["kv_read_s"] + floor["prefill_attention_s"]
    )
    tokens = report["workload"]["num_output_tokens"]
    assert floor["output_tokens_per_s"] == pytest.approx(tokens / floor["wall_s"])
    ours = report["engines"]["slipstream"]["output_tokens_per_s"]
    assert floor["slipstream_fraction"] == pytest.approx(ours / floor["output_tokens_per_s"])
    assert "floor" not in _bench(tmp_path, tiny_model_dir, "slipstream", "--no-floor")


def test_slipstream_runs_with_its_kv_pools_committed_as_serve_does(tmp_path: Path) -> None:
    """The first write to a lazily mapped block faults its pages in inside the
    timed run (on a VM whose free memory went back to the host, ~250 MB/s),
    which a server, committed at start-up, never pays."""
    from slipstream.service.bench.offline import _engine_config, _options_from_args
    from slipstream.service.cli import build_parser

    def commits(*extra: str) -> bool:
        args = build_parser().parse_args(["bench", "offline", "--model", "tiny", *extra])
        return _engine_config("tiny", _options_from_args(args, {})).commit_kv_memory

    assert commits() is True
    assert commits("--kv-memory", "commit") is True
    assert commits("--kv-memory", "lazy") is False


def test_transformers_continuous_batching_settings_follow_the_device() -> None:
    """CPU-tuned page and step sizes on the CPU; on a GPU transformers' own
    sizes with its CUDA graphs on (asked for, not its sdpa heuristic)."""
    from slipstream.service.bench.hf_peers import CBSettings

    cpu = CBSettings().for_device("cpu")
    assert (cpu.page_size, cpu.max_batch_tokens, cpu.use_cuda_graph) == (64, 512, False)
    gpu = CBSettings().for_device("cuda:0")
    assert (gpu.page_size, gpu.max_batch_tokens, gpu.use_cuda_graph) == (None, None, True)
    asked = CBSettings(page_size=32, use_cuda_graph=False).for_device("cuda")
    assert (asked.page_size, asked.use_cuda_graph) == (32, False)


def test_the_floor_and_in_process_peers_run_off_the_callers_thread(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch
) -> None:
    """Their matmuls leave no OpenMP team on the thread Slipstream's engine
    is loaded from, so its own thread keeps the only one (compute_thread.py)."""
    from slipstream.service.bench import hf_peers, roofline

    threads: dict[str, threading.Thread] = {}
    measure = roofline.measure_rates

    def measured(*args: object, **kwargs: object) -> object:
        threads["floor"] = threading.current_thread()
        return measure(*args, **kwargs)

    def peer(*args: object, **kwargs: object) -> None:
        threads["hf_cb"] = threading.current_thread()
        raise RuntimeError("where it ran is recorded")

    monkeypatch.setattr(roofline, "measure_rates", measured)
    monkeypatch.setattr(hf_peers, "run_hf_cb", peer)
    report = _bench(tmp_path, tiny_model_dir, "hf_cb")
    assert "recorded" in report["engines"]["hf_cb"]["error"]
    assert threads["floor"] is not threading.current_thread()
    assert threads["hf_cb"] is not threading.current_thread()

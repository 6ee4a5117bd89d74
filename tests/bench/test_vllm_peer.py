"""vLLM as a ``bench offline`` peer, driven through a fake "Python with
vLLM": the test interpreter with the stand-in package under ``fake_vllm/``,
so the replay script, the subprocess driver and the CLI wiring run for real
without vLLM. One slow test runs real vLLM when ``SLIPSTREAM_VLLM_PYTHON``
names it."""

from __future__ import annotations

import ast
import json
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from slipstream.service.bench import vllm_peer
from slipstream.service.bench.report import engine_metrics, format_table, throughput_ratios
from slipstream.service.bench.vllm_peer import (
    VllmPeerError,
    VllmSettings,
    parse_log,
    parse_result,
    replay_spec,
    run_vllm,
)
from slipstream.service.bench.workload import WARMUP_WORKLOAD, WorkloadRequest
from slipstream.service.cli import main

FAKE_VLLM_DIR = Path(__file__).resolve().parent / "fake_vllm"
WORKLOAD = [
    WorkloadRequest(prompt_token_ids=[5, 6, 7, 8], max_tokens=6),
    WorkloadRequest(prompt_token_ids=[9, 10], max_tokens=2),
    WorkloadRequest(prompt_token_ids=[11, 12, 13], max_tokens=4),
]


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_python(tmp_path: Path) -> Callable[[str], str]:
    """A "Python with vLLM" misbehaving as ``mode`` says (see ``fake_vllm``).
    It drops the driver's ``-I`` so that ``PYTHONPATH`` can bring in the fake."""

    def make(mode: str = "ok") -> str:
        script = f"""#!/bin/sh
[ "$1" = "-I" ] && shift
PYTHONPATH={FAKE_VLLM_DIR} FAKE_VLLM_MODE={mode} exec {sys.executable} "$@"
"""
        return str(_executable(tmp_path / f"python-{mode}", script))

    return make


def _settings(python: str, **overrides: object) -> VllmSettings:
    return VllmSettings(python=python, dtype="float32", num_threads=2, **overrides)  # type: ignore[arg-type]


def test_spec_carries_the_workload_and_the_engine_knobs() -> None:
    settings = _settings("py", kv_cache_gib=0.5, max_num_seqs=8)
    spec = replay_spec("/models/m", WORKLOAD, settings)
    assert spec["model"] == "/models/m"
    assert spec["dtype"] == "float32"
    assert spec["requests"] == [
        {"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens} for r in WORKLOAD
    ]
    assert len(spec["warmup"]) == len(WARMUP_WORKLOAD)
    assert spec["engine_args"]["kv_cache_memory_bytes"] == 2**29
    assert spec["engine_args"]["max_num_seqs"] == 8
    assert "max_num_batched_tokens" not in spec["engine_args"]
    assert spec["env"]["VLLM_CPU_OMP_THREADS_BIND"] == vllm_peer.cpu_bind(2)
    json.dumps(spec)  # crosses to the other process as JSON


def test_cpu_bind_names_allowed_cpus() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert vllm_peer.cpu_bind(1) == str(allowed[0])
    assert vllm_peer.cpu_bind(len(allowed) + 5).split(",") == [str(c) for c in allowed]


def test_replay_through_fake_vllm(fake_python: Callable[[str], str], tmp_path: Path) -> None:
    log_path = tmp_path / "kept.log"
    run = run_vllm("/models/m", WORKLOAD, _settings(fake_python("ok"), log_path=str(log_path)))
    assert run.engine == "vllm"
    assert [t.num_output_tokens for t in run.timings] == [6, 2, 4]
    for timing in run.timings:
        assert timing.ttft_s is not None
        assert 0 <= timing.ttft_s <= timing.latency_s <= run.wall_s
    # The fake makes one token per request per step: longer requests finish later.
    assert run.timings[1].latency_s < run.timings[2].latency_s < run.timings[0].latency_s
    settings = run.settings
    assert settings["dtype"] == "float32"
    assert settings["vllm"] == "0.0.fake"
    assert settings["weights_load_s"] == 0.25
    assert settings["engine_init_s"] == 1.5
    assert settings["max_num_seqs"] == 256
    assert settings["load_s"] >= 0 and settings["warmup_s"] >= 0
    assert "Loading weights took" in log_path.read_text()


def test_crash_reports_the_log_tail(fake_python: Callable[[str], str]) -> None:
    with pytest.raises(VllmPeerError, match="exited with 3") as info:
        run_vllm("/models/m", WORKLOAD, _settings(fake_python("crash")))
    assert any("Engine core initialization failed" in line for line in info.value.log_tail)
    entry = info.value.report_entry({"dtype": "float32"})
    assert entry["error"].startswith("vLLM exited with 3")
    assert entry["log_tail"] == info.value.log_tail


def test_hang_times_out(fake_python: Callable[[str], str]) -> None:
    with pytest.raises(VllmPeerError, match="did not finish within 2 s") as info:
        run_vllm("/models/m", WORKLOAD, _settings(fake_python("hang"), timeout_s=2.0))
    assert any("Loading weights took" in line for line in info.value.log_tail)


def test_a_miscounted_run_is_a_failure(fake_python: Callable[[str], str]) -> None:
    with pytest.raises(VllmPeerError, match="token counts differ at indices \\[0\\]"):
        run_vllm("/models/m", WORKLOAD, _settings(fake_python("short")))


def test_exit_zero_without_result(tmp_path: Path) -> None:
    python = _executable(tmp_path / "python", "#!/bin/sh\necho started\nexit 0\n")
    with pytest.raises(VllmPeerError, match="without writing its result") as info:
        run_vllm("/models/m", WORKLOAD, _settings(str(python)))
    assert info.value.log_tail == ["started"]


def test_missing_interpreter(tmp_path: Path) -> None:
    with pytest.raises(VllmPeerError, match="cannot start"):
        run_vllm("/models/m", WORKLOAD, _settings(str(tmp_path / "nope")))


def test_result_latencies_must_fit_the_wall_time() -> None:
    result = {
        "wall_s": 1.0,
        "load_s": 2.0,
        "warmup_s": 0.5,
        "requests": [{"num_output_tokens": 3, "latency_s": 1.5, "ttft_s": 0.1}],
    }
    with pytest.raises(ValueError, match="wall time"):
        parse_result(result, _settings("py"))
    result["requests"][0]["latency_s"] = 0.9
    run = parse_result(result, _settings("py"))
    assert run.timings[0].ttft_s == 0.1
    # With no engine record, the dtype asked for stands in for the one used.
    assert run.settings["dtype"] == "float32"


def test_log_parsing() -> None:
    log = (
        "(Worker pid=1) INFO [default_loader.py:501] Loading weights took 0.97 seconds\n"
        "(Worker pid=1) WARNING [decorators.py:333] [backbone] Compiling model again due to"
        " a load failure from /cache, reason: x\n"
        "(Worker pid=1) INFO [decorators.py:743] [backbone] saved AOT compiled function to /c\n"
        "(EngineCore pid=2) INFO [core.py:402] init engine (profile, create kv cache, warmup"
        " model) took 127.54 s\n"
    )
    assert parse_log(log) == {
        "weights_load_s": 0.97,
        "engine_init_s": 127.54,
        "compile_cache": "load failed, compiled",
    }
    assert parse_log("")["engine_init_s"] is None


def test_replay_script_imports_only_vllm_and_the_stdlib() -> None:
    # It runs under vLLM's Python, where Slipstream and its dependencies are absent.
    tree = ast.parse(Path(vllm_peer.REPLAY_SCRIPT).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    foreign = roots - set(sys.stdlib_module_names) - {"vllm", "torch"}
    assert not foreign, foreign


def test_failed_engine_in_table_and_ratios() -> None:
    from slipstream.service.bench.report import EngineRun, RequestTiming

    ok = engine_metrics(EngineRun("slipstream", 1.0, [RequestTiming(5, 1.0, 0.5)]))
    engines = {"slipstream": ok, "vllm": {"error": "vLLM exited with 1", "log_tail": []}}
    assert throughput_ratios(engines) == {}
    table = format_table(engines)
    assert "vllm         failed: vLLM exited with 1" in table
    assert vllm_peer.summary_line(engines["vllm"]) == "vllm: failed: vLLM exited with 1"


# --- the CLI -----------------------------------------------------------------

SMALL = ["--requests", "3", "--prompt-len", "4", "20", "--output-len", "2", "6"]


def _bench(tmp_path: Path, model_dir: Path, engines: str, *extra: str) -> tuple[int, dict]:
    report_path = tmp_path / "report.json"
    argv = ["bench", "offline", "--model", str(model_dir), "--engines", engines, *SMALL]
    argv += ["--dtype", "float32", "--json", str(report_path), *extra]
    code = main(argv)
    return code, json.loads(report_path.read_text()) if report_path.exists() else {}


def test_cli_runs_vllm(
    tmp_path: Path, tiny_model_dir: Path, fake_python: Callable[[str], str], capsys
) -> None:
    code, report = _bench(tmp_path, tiny_model_dir, "vllm", "--vllm-python", fake_python("ok"))
    assert code == 0
    metrics = report["engines"]["vllm"]
    assert metrics["num_output_tokens"] == report["workload"]["num_output_tokens"]
    assert metrics["output_tokens_per_s"] > 0
    assert metrics["ttft_p50_s"] is not None
    assert metrics["settings"]["dtype"] == "float32"
    assert metrics["settings"]["engine_init_s"] == 1.5
    assert len(metrics["load_avg_1m"]) == 2
    assert set(report["environment"]["cpu"]["has_flags"]) == {
        "avx2",
        "avx512f",
        "avx512_bf16",
        "amx_bf16",
    }
    out = capsys.readouterr().out
    assert "vllm: dtype float32, start-up" in out
    assert "engine init incl. compile 1.5 s" in out


def test_cli_takes_the_python_from_the_environment(
    tmp_path: Path, tiny_model_dir: Path, fake_python: Callable[[str], str], monkeypatch
) -> None:
    monkeypatch.setenv(vllm_peer.ENV_PYTHON, fake_python("ok"))
    code, report = _bench(tmp_path, tiny_model_dir, "vllm")
    assert code == 0
    assert report["engines"]["vllm"]["settings"]["python_path"] == fake_python("ok")


def test_cli_keeps_other_engines_when_vllm_fails(
    tmp_path: Path, tiny_model_dir: Path, fake_python: Callable[[str], str], capsys
) -> None:
    code, report = _bench(
        tmp_path, tiny_model_dir, "hf_cb,vllm", "--vllm-python", fake_python("crash")
    )
    assert code == 0
    engines = report["engines"]
    assert engines["hf_cb"]["num_output_tokens"] == report["workload"]["num_output_tokens"]
    assert engines["vllm"]["error"].startswith("vLLM exited with 3")
    assert any("initialization failed" in line for line in engines["vllm"]["log_tail"])
    assert engines["vllm"]["settings"]["python_path"] == fake_python("crash")
    captured = capsys.readouterr()
    assert "vllm         failed: vLLM exited with 3" in captured.out
    assert "Engine core initialization failed" in captured.err


def test_cli_vllm_needs_a_python(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv(vllm_peer.ENV_PYTHON, raising=False)
    assert _bench(tmp_path, tiny_model_dir, "vllm")[0] == 2
    missing = str(tmp_path / "no-python")
    assert _bench(tmp_path, tiny_model_dir, "vllm", "--vllm-python", missing)[0] == 2


@pytest.mark.slow
def test_real_vllm(tmp_path: Path) -> None:
    """Real vLLM on the ``small`` model (minutes: it compiles at start-up)."""
    python = os.environ.get(vllm_peer.ENV_PYTHON)
    if not python:
        pytest.skip(f"{vllm_peer.ENV_PYTHON} names no Python with vLLM")
    from slipstream.service.models.store import resolve_model

    run = run_vllm(str(resolve_model("small")), WORKLOAD, _settings(python, kv_cache_gib=1.0))
    assert [t.num_output_tokens for t in run.timings] == [r.max_tokens for r in WORKLOAD]
    assert run.settings["dtype"] == "float32"
    assert all(t.ttft_s is not None and t.ttft_s <= t.latency_s for t in run.timings)


def test_cli_resolves_auto_dtype_for_vllm(
    tmp_path: Path, tiny_model_dir: Path, fake_python: Callable[[str], str]
) -> None:
    # vLLM's own "auto" would read the checkpoint's dtype; the peer runs the one
    # Slipstream picks for this CPU, so both engines compute in the same dtype.
    report_path = tmp_path / "report.json"
    argv = ["bench", "offline", "--model", str(tiny_model_dir), "--engines", "vllm", *SMALL]
    argv += ["--dtype", "auto", "--json", str(report_path), "--vllm-python", fake_python("ok")]
    assert main(argv) == 0
    report = json.loads(report_path.read_text())
    expected = report["environment"]["dtype"]
    assert expected in ("float32", "bfloat16")
    assert report["engines"]["vllm"]["settings"]["dtype_requested"] == expected

"""Start-up on any CPU: the engine follows the CPU's answer (forced here both
ways), and a failed start ends the process with one line, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slipstream.kernels.cpu_features import CpuFeatures, detect
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.engine import Engine
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_engine

NATIVE = CpuFeatures("forced native bf16", ("amx_bf16", "avx2"), "AVX512", False, False)
EMULATED = CpuFeatures("forced avx2", ("avx2",), "AVX2", can_pack_bf16=False, can_pack_fp32=False)
CLAIMS_PACKING = CpuFeatures("forced packing", ("amx_bf16",), "AVX512", True, True)


def _generate(engine: Engine) -> list[int]:
    request = RequestSpec(req_id="a", prompt_token_ids=[5, 6, 7], max_new_tokens=4)
    (result,) = engine.generate([request])
    engine.shutdown()
    return result.token_ids


@pytest.mark.parametrize(
    ("cpu", "dtype"), [(NATIVE, "bfloat16"), (EMULATED, "float32")], ids=["native", "emulated"]
)
def test_auto_dtype_follows_the_cpu(cpu: CpuFeatures, dtype: str) -> None:
    engine = load_engine(
        EngineConfig(model="tiny", num_device_blocks=16, num_host_blocks=0), cpu=cpu
    )
    assert (engine.info.dtype, engine.info.requested_dtype) == (dtype, "auto")
    assert not engine.info.weights_packed
    assert engine.info.cpu["model"] == cpu.model_name
    assert len(_generate(engine)) == 4


def test_packed_start_where_the_cpu_allows_it_else_a_clear_error() -> None:
    config = EngineConfig(model="tiny", num_device_blocks=16, num_host_blocks=0)
    if detect().can_pack_bf16:
        engine = load_engine(config, cpu=CLAIMS_PACKING)
        assert engine.info.weights_packed and engine.info.dtype == "bfloat16"
        assert len(_generate(engine)) == 4
    else:
        with pytest.raises(ValueError, match="cannot pack bfloat16 weights"):
            load_engine(config, cpu=CLAIMS_PACKING)


def _serve(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLIPSTREAM_LOG_FORMAT": "json"}
    command = [sys.executable, "-m", "slipstream.service.cli", "serve", "--port", "0"]
    command += ["--http-port", "0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def _broken_checkpoint(root: Path, config: dict[str, object]) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "gpt2"},  # an architecture Slipstream does not run
        {"model_type": "llama", "vocab_size": 8},  # config keys missing
    ],
    ids=["unsupported", "incomplete"],
)
def test_failed_start_prints_one_line_and_no_traceback(
    tmp_path: Path, config: dict[str, object]
) -> None:
    model = _broken_checkpoint(tmp_path / "model", config)
    proc = _serve(["--model", str(model), "--no-calibrate"])
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slipstream: error:")]
    assert len(errors) == 1 and "cannot load the model" in errors[0]
    assert "serving" not in proc.stdout  # never announced SERVING


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_that_is_not_there_is_one_error_line() -> None:
    proc = _serve(["--model", "tiny", "--no-calibrate", "--device", "cuda"])
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slipstream: error:")]
    assert len(errors) == 1 and "no CUDA device" in errors[0], proc.stderr[-2000:]


def test_the_cpu_is_said_as_the_device() -> None:
    engine = load_engine(EngineConfig(model="tiny", num_device_blocks=16, device="cpu"))
    assert engine.info.device["type"] == "cpu" and engine.info.device["name"]
    engine.shutdown()


def test_an_int8_kv_cache_is_said_and_holds_four_times_the_blocks() -> None:
    """The pool is sized in bytes: int8 rows (values and a 4-byte scale) fit
    about four times the float32 blocks; the choice is in the model info."""
    from slipstream.service.models.llama import LlamaConfig

    sizes = {}
    for kv in ("auto", "int8"):
        config = EngineConfig(
            model="tiny", dtype="float32", kv_cache_dtype=kv, kv_cache_memory_gb=0.01
        )
        engine = load_engine(config)
        sizes[kv] = engine.info.kv_bytes_per_block, engine.stats().device_blocks.free
        head_dim = LlamaConfig.from_dir(Path(engine.info.path)).head_dim
        assert engine.info.kv_cache_dtype == ("float32" if kv == "auto" else "int8")
        assert len(_generate(engine)) == 4
    (fp32_bytes, fp32_blocks), (int8_bytes, int8_blocks) = sizes["auto"], sizes["int8"]
    assert int8_bytes * 4 * head_dim == fp32_bytes * (head_dim + 4)  # a row: 4 d vs d + 4 bytes
    assert int8_blocks > 3 * fp32_blocks


def test_an_int8_kv_cache_on_cuda_is_one_clear_error() -> None:
    from slipstream.service.engine.loader import _load_on_cuda

    with pytest.raises(ValueError, match="runs on the CPU only"):
        _load_on_cuda(EngineConfig(kv_cache_dtype="int8"), torch.device("cuda"))


def test_serve_takes_the_kv_cache_dtype_flag() -> None:
    from slipstream.service.cli import build_parser
    from slipstream.service.cli.serve import engine_config

    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).kv_cache_dtype == "auto"
    assert engine_config(parse(["serve", "--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parse(["serve", "--kv-cache-dtype", "fp8"])


@pytest.mark.parametrize(
    "flag",
    [
        ["--max-num-seqs", "0"],
        ["--block-size", "-16"],
        ["--max-num-batched-tokens", "0"],
        ["--max-queue-len", "-1"],
        ["--threads", "0"],
        ["--prefill-graph-tokens", "-5"],
        ["--num-host-blocks", "-1"],
        ["--max-model-len", "ten"],
    ],
)
def test_a_bad_engine_size_flag_is_a_usage_error_before_anything_loads(flag, capsys) -> None:
    """Sizes and counts are refused where they are parsed: one usage line
    naming the flag, exit status 2, no model loaded (before, a negative
    block size surfaced as a tensor shape error and -5 prefill graph tokens
    or 0 threads were taken)."""
    from slipstream.service.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *flag])
    assert exit_info.value.code == 2
    assert flag[0] in capsys.readouterr().err


@pytest.mark.parametrize("command", [["bench", "offline"], ["bench", "slo"]])
def test_the_benchmarks_refuse_a_negative_prefill_graph_size(command, capsys) -> None:
    """The benchmarks' engine flag is parsed as serve's is."""
    from slipstream.service.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--prefill-graph-tokens", "-1"])
    assert exit_info.value.code == 2
    assert "--prefill-graph-tokens" in capsys.readouterr().err
    args = build_parser().parse_args([*command, "--prefill-graph-tokens", "0"])
    assert args.prefill_graph_tokens == 0


def test_zero_is_a_value_where_it_means_something() -> None:
    """0 turns the per-layer graphs off, keeps no host pool, sizes the device pool."""
    from slipstream.service.cli import build_parser
    from slipstream.service.cli.serve import engine_config

    args = ["serve", "--prefill-graph-tokens", "0", "--num-host-blocks", "0"]
    config = engine_config(build_parser().parse_args([*args, "--num-device-blocks", "0"]))
    assert (config.prefill_graph_tokens, config.num_host_blocks, config.num_device_blocks) == (
        0,
        0,
        0,
    )


def test_a_max_model_len_past_the_models_context_is_cut_and_said(monkeypatch) -> None:
    from slipstream.service.engine import loader

    warned: list[dict[str, object]] = []
    monkeypatch.setattr(loader.log, "warning", lambda event, **fields: warned.append(fields))
    engine = load_engine(
        EngineConfig(model="tiny", num_device_blocks=64, device="cpu", max_model_len=99_999_999)
    )
    engine.shutdown()
    limit = engine.info.max_model_len
    assert [(w["requested"], w["max_model_len"]) for w in warned] == [(99_999_999, limit)]


def test_a_max_model_len_past_the_kv_pool_is_cut_to_it_and_said(monkeypatch) -> None:
    """A 16-block pool of 32-token blocks holds 512 tokens of tiny's 1,024:
    the model info says 512 (what a client can send), not a context no
    request could use."""
    from slipstream.service.engine import loader

    warned: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(loader.log, "warning", lambda event, **f: warned.append((event, f)))
    engine = load_engine(
        EngineConfig(model="tiny", num_device_blocks=16, block_size=32, device="cpu")
    )
    engine.shutdown()
    assert engine.info.max_model_len == 512
    assert [(e, f["requested"], f["max_model_len"]) for e, f in warned] == [
        ("max_model_len_above_the_pool", 1024, 512)
    ]


def test_a_kv_cache_smaller_than_one_sequence_is_raised_to_one_and_said(monkeypatch) -> None:
    """--kv-cache-gb below one full-length sequence was raised silently."""
    from slipstream.service.engine import loader

    warned: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(loader.log, "warning", lambda event, **f: warned.append((event, f)))
    engine = load_engine(
        EngineConfig(model="tiny", kv_cache_memory_gb=1e-6, block_size=32, device="cpu")
    )
    engine.shutdown()
    one_sequence = -(-engine.info.max_model_len // 32)
    assert [(e, f["blocks"]) for e, f in warned] == [
        ("kv_cache_raised_to_one_sequence", one_sequence)
    ]

"""``slipstream bench step`` end to end on the tiny model, and its parts."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from slipstream.kernels.cpu_features import choose_dtype, detect
from slipstream.service.bench import step, step_timing
from slipstream.service.cli import main

CONTEXT = 40
ROW_KEYS = {"batch", "mode", "dtype", "status", "step_ms", "weight_read_floor_ms",
            "kv_read_floor_ms"}  # fmt: skip
PARTS = ("attention_ms", "linears_ms", "other_ms", "host_ms")


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("step")
    # One thread: two OpenMP threads on a busy 2-core machine wait out whole time
    # slices at every barrier (tens of ms per tiny matmul); this test checks shape, not speed.
    argv = ["bench", "step", "--model", str(tiny_model_dir), "--batch", "1,2",
            "--context", str(CONTEXT), "--steps", "7", "--warmup", "2", "--threads", "1",
            "--block-size", "16", "--modes", "eager,compiled,python-loop",
            "--json", str(out / "step.json"), "--plot", str(out / "step.png")]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return json.loads((out / "step.json").read_text()), out / "step.png", printed.getvalue()


def test_report_names_the_cpu_and_the_run(run: tuple[dict, Path, str]) -> None:
    report, _, _ = run
    cpu = report["cpu"]
    assert set(cpu["has_flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert cpu["model"]
    params = report["parameters"]
    assert params["context"] == CONTEXT and params["steps"] == 7 and params["threads"] == 1
    assert params["block_size"] == 16 and params["dtype"] in ("float32", "bfloat16")
    assert set(report["passes"]) >= {"step_ms", "breakdown", "floors"}
    load = report["load"]
    assert load["cpus"] >= 1 and load["load_avg_1m_start"] >= 0 and load["load_avg_1m_end"] >= 0


def test_eager_rows_have_floors_and_an_honest_split(run: tuple[dict, Path, str]) -> None:
    rows = [r for r in run[0]["rows"] if r["mode"] == "eager"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r) >= ROW_KEYS and r["status"] == "ok" and r["breakdown_pass"] == "hooked"
        assert r["step_ms"] > 0 and r["weight_read_floor_ms"] > 0 and r["kv_read_floor_ms"] > 0
        assert all(r[p] >= 0 for p in PARTS), {p: r[p] for p in PARTS}
        # The hooks saw the calls they wrap.
        assert r["attention_ms"] > 0 and r["linears_ms"] > 0
        assert 0 <= r["sampling_ms"] <= r["other_ms"]
        # Parts are medians of their own; they may exceed the median step by noise only.
        assert sum(r[p] for p in PARTS) <= 1.25 * r["hooked_step_ms"] + 0.5
        assert r["step_over_weight_floor"] == pytest.approx(
            r["step_ms"] / r["weight_read_floor_ms"]
        )
        assert r["step_over_linears_plus_kv_floor"] == pytest.approx(
            r["step_ms"] / (r["linears_ms"] + r["kv_read_floor_ms"])
        )


def test_byte_counts_match_the_checkpoint(
    run: tuple[dict, Path, str], tiny_model_dir: Path
) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    with safe_open(tiny_model_dir / "model.safetensors", framework="pt") as f:
        numel = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    has_lm_head = "lm_head.weight" in numel and not config.get("tie_word_embeddings")
    params = sum(
        torch.Size(shape).numel()
        for name, shape in numel.items()
        if not (has_lm_head and name == "model.embed_tokens.weight")
    )
    # --dtype auto: float32 on AVX2-only CPUs, bf16 where bf16 is native.
    dtype = choose_dtype("auto", detect()).dtype
    assert run[0]["parameters"]["dtype"] == dtype
    element_size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for r in run[0]["rows"]:
        if r["status"] != "ok":
            continue
        assert r["weight_read_bytes"] == element_size * params
        per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim * element_size
        assert r["kv_read_bytes"] == r["batch"] * (CONTEXT + 1) * per_token


def test_compiled_rows_run_beside_eager(run: tuple[dict, Path, str]) -> None:
    rows = [r for r in run[0]["rows"] if r["mode"] == "compiled"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["status"] == "ok" and r["step_ms"] > 0 and r["breakdown_pass"] == "hooked"
        assert r["weight_read_floor_ms"] > 0 and r["kv_read_floor_ms"] > 0


def test_python_loop_rows_run_the_compiled_kernels_from_python(run: tuple[dict, Path, str]) -> None:
    rows = {(r["mode"], r["batch"]): r for r in run[0]["rows"]}
    for batch in (1, 2):
        assert rows[("compiled", batch)]["layer_loop"] == "native"
        assert rows[("python-loop", batch)]["layer_loop"] == "python"
        assert rows[("eager", batch)]["layer_loop"] == "python"
        assert rows[("python-loop", batch)]["status"] == "ok"
        # The native loop times its own attention and projections for the split.
        native = rows[("compiled", batch)]
        assert native["attention_ms"] > 0 and native["linears_ms"] > 0
        assert native["attention_ms"] + native["linears_ms"] < native["hooked_step_ms"]


def test_table_and_plot(run: tuple[dict, Path, str]) -> None:
    _, png, printed = run
    # Log lines may come first, depending on how earlier tests left logging.
    assert any(line.startswith("cpu: ") for line in printed.splitlines())
    assert "step/(lin+kv)" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mode_options_follow_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(frozen=True)
    class WithCompile:
        compile: bool = False

    @dataclasses.dataclass(frozen=True)
    class Without:
        model: str = "tiny"

    monkeypatch.setattr(step, "EngineConfig", WithCompile)
    assert step.mode_options("compiled") == ({"compile": True}, None)
    assert step.mode_options("eager") == ({"compile": False}, None)
    monkeypatch.setattr(step, "EngineConfig", Without)
    options, reason = step.mode_options("compiled")
    assert options is None and "compile" in str(reason)


def test_hooks_are_removed_after_the_hooked_pass(tiny_model_dir: Path) -> None:
    from slipstream.kernels.linear import Linear
    from slipstream.service.engine import runner as runner_module
    from slipstream.service.engine.runner import ModelRunner
    from slipstream.service.models.llama import LlamaModel

    model = LlamaModel(tiny_model_dir, torch.float32)
    runner = ModelRunner(model, step_timing.blocks_per_seq(CONTEXT, 16) * 2, 0, 16)
    before = (Linear.__call__, model._paged_attention, runner_module.sample)
    parts = step_timing.time_hooked(runner, step_timing.decode_plan(2, CONTEXT, 16), 2, 1)
    assert parts["linears_ms"] > 0
    assert (Linear.__call__, model._paged_attention, runner_module.sample) == before
    assert "forward" not in vars(model)
    assert model.layer_part_ns is None


def test_decode_plan_gives_each_sequence_its_own_blocks() -> None:
    plan = step_timing.decode_plan(3, CONTEXT, 16)
    blocks = [b for seq in plan.seqs for b in seq.block_ids]
    assert len(blocks) == len(set(blocks)) == 3 * step_timing.blocks_per_seq(CONTEXT, 16)
    assert all(s.start_pos == CONTEXT and len(s.token_ids) == 1 for s in plan.seqs)
    assert all(s.sample and s.sampling.is_greedy for s in plan.seqs)


def test_a_prefill_chunk_makes_sequence_0_a_mixed_steps_chunk(tiny_model_dir: Path) -> None:
    plan = step_timing.decode_plan(3, CONTEXT, 16, prefill=9)
    assert [(s.start_pos, len(s.token_ids)) for s in plan.seqs] == [(CONTEXT - 8, 9)] + [
        (CONTEXT, 1)
    ] * 2
    assert plan.seqs[0].block_ids == step_timing.decode_plan(3, CONTEXT, 16).seqs[0].block_ids
    with pytest.raises(ValueError, match="does not fit"):
        step_timing.decode_plan(1, CONTEXT, 16, prefill=CONTEXT + 2)
    argv = ["bench", "step", "--model", str(tiny_model_dir), "--batch", "2", "--prefill", "9",
            "--context", str(CONTEXT), "--steps", "3", "--warmup", "1", "--threads", "1",
            "--block-size", "16", "--modes", "compiled"]  # fmt: skip
    report = step.run_step_bench(step.options_from_args(_parse(argv)))
    assert report["parameters"]["prefill"] == 9
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["prefill_tokens"] == 9
    assert row["step_ms"] > 0 and row["attention_ms"] > 0


def test_a_sampled_step_samples_every_sequence(tiny_model_dir: Path) -> None:
    """``--temperature`` (with top-k and top-p) makes every sequence sample:
    the step's time holds the sampler's, and the report says how it drew."""
    from slipstream.scheduler.request import SamplingParams

    sampling = SamplingParams(0.8, 40, 0.9)
    plan = step_timing.decode_plan(3, CONTEXT, 16, sampling=sampling)
    assert all(s.sampling == sampling for s in plan.seqs)
    argv = ["bench", "step", "--model", str(tiny_model_dir), "--batch", "2",
            "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--context", str(CONTEXT),
            "--steps", "3", "--warmup", "1", "--threads", "1", "--block-size", "16",
            "--modes", "eager"]  # fmt: skip
    report = step.run_step_bench(step.options_from_args(_parse(argv)))
    assert report["parameters"]["sampling"] == {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["step_ms"] > 0
    from slipstream.service.bench.step_report import format_table

    assert "sampling at temperature 0.8, top-k 40, top-p 0.9" in format_table(report)


def _parse(argv: list[str]):
    from slipstream.service.cli import build_parser

    return build_parser().parse_args(argv)


@pytest.mark.parametrize(
    "flags",
    [
        ["--modes", "eager,jit"],
        ["--batch", "0"],
        ["--steps", "0"],
        ["--prefill", "302"],
        ["--temperature", "-1"],
        ["--top-p", "0"],
        ["--top-k", "-2"],
    ],
)
def test_bad_flags_are_usage_errors(flags: list[str], tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step", "--model", str(tiny_model_dir), *flags])
    assert exc.value.code == 2


def test_cuda_modes_and_devices_are_refused_where_they_cannot_run() -> None:
    from slipstream.service.cli import build_parser

    parser = build_parser()
    with pytest.raises(ValueError, match="CUDA modes"):
        step.options_from_args(parser.parse_args(["bench", "step", "--modes", "graphs"]))
    # The default device is the CPU, whose modes are the default ones.
    assert step.options_from_args(parser.parse_args(["bench", "step"])).modes == (
        "eager",
        "compiled",
    )
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            step.options_from_args(parser.parse_args(["bench", "step", "--device", "cuda"]))


def test_time_launches_keeps_the_host_one_step_ahead() -> None:
    """Each timed launch comes before the previous step's result is taken."""
    from slipstream.scheduler.plan import StepPlan
    from slipstream.service.bench import step_timing

    events: list[tuple[str, int]] = []

    class Handle:
        def __init__(self, index: int) -> None:
            self.index = index

        def result(self) -> None:
            events.append(("result", self.index))

    class Runner:
        launched = 0

        def launch(self, plan: StepPlan) -> Handle:
            self.launched += 1
            events.append(("launch", self.launched))
            return Handle(self.launched)

    launches, paces = step_timing.time_launches(Runner(), StepPlan(step=0), 3)
    assert len(launches) == len(paces) == 3
    assert all(0 <= launch <= pace for launch, pace in zip(launches, paces, strict=True))
    assert events == [
        ("launch", 1), ("result", 1), ("launch", 2),
        ("launch", 3), ("result", 2), ("launch", 4), ("result", 3), ("launch", 5), ("result", 4),
        ("result", 5),
    ]  # fmt: skip


def test_bench_host_times_the_scheduler_and_the_engine_step(tiny_model_dir: Path) -> None:
    from slipstream.service.bench import host

    report = host.run_host_bench([4], ["deadline"], 16, str(tiny_model_dir), deadlines=True)
    assert [row["deadlines"] for row in report["rows"]] == [False, True]
    for row in report["rows"]:
        assert row["batch"] == 4 and row["policy"] == "deadline"
        assert 0 < row["schedule_ms"] < 1000 and 0 < row["update_ms"] < 1000
        assert 0 < row["stage_ms"] < 1000 and 0 < row["engine_step_ms"] < 1000
    assert "engine step" in host.format_table(report)


def test_runner_switches_set_device_runner_properties() -> None:
    """A mode's runner switch names a settable DeviceRunner property (a
    misspelt one would set a new attribute and change nothing)."""
    from slipstream.service.engine.cuda_runner import DeviceRunner

    assert step.RUNNER_SWITCHES
    for mode, switches in step.RUNNER_SWITCHES.items():
        assert mode in step.CUDA_MODES and mode in step.MODES
        for name in switches:
            attribute = getattr(DeviceRunner, name)
            assert isinstance(attribute, property) and attribute.fset is not None

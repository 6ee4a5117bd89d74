"""``slipstream bench spec`` end to end on the ``tiny`` model: every K runs
both tasks at every batch size, the report carries the hardware, and bad
options are a usage error."""

from __future__ import annotations

import json
from pathlib import Path

from slipstream.service.bench.spec import TASKS, task_messages
from slipstream.service.cli import main


def test_each_k_runs_every_task_and_batch(tmp_path: Path, tiny_model_dir: Path) -> None:
    report_path, plot_path = tmp_path / "spec.json", tmp_path / "spec.png"
    argv = ["bench", "spec", "--model", str(tiny_model_dir), "--speculative-tokens", "0,3"]
    argv += ["--batch", "1,2", "--max-tokens", "4", "--repeats", "1", "--dtype", "float32"]
    argv += ["--kv-memory", "lazy", "--json", str(report_path), "--plot", str(plot_path)]
    assert main(argv) == 0
    report = json.loads(report_path.read_text())
    assert report["benchmark"] == "spec" and report["hardware"]["dtype"] == "float32"
    cases = {(r["task"], r["batch"], r["speculative_tokens"]) for r in report["rows"]}
    assert cases == {(t, b, k) for t in TASKS for b in (1, 2) for k in (0, 3)}
    for row in report["rows"]:
        assert row["output_tokens_per_s"] > 0 and row["tokens_per_decode_step"] >= 1
        if row["speculative_tokens"] == 0:
            assert row["draft_tokens"] == 0
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_repeat_task_asks_for_code_back() -> None:
    [(role, content)] = task_messages("repeat", 0)
    assert role == "user" and "def dedent" in content
    assert task_messages("repeat", 1) != task_messages("repeat", 0)


def test_bad_options_are_a_usage_error(tiny_model_dir: Path) -> None:
    assert main(["bench", "spec", "--model", str(tiny_model_dir), "--repeats", "0"]) == 2

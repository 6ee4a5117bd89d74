"""``python -m slipstream.kernels.bench_linear`` runs and reports every row
count it was asked for, both paths timed (where the CPU runs bf16 panels and
oneDNN packs bf16 weights; skipped, and said so, elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.kernels import bench_linear, cpu_features, linear


def test_reports_each_row_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not (linear.bf16_panels_available() and cpu_features.detect().can_pack_bf16):
        pytest.skip("needs bf16 panels (AVX512-BF16) and oneDNN's bf16 packing (as reported)")
    out = tmp_path / "linear.json"
    bench_linear.main(["--rows", "1,9", "--rounds", "1", "--layers", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [row["rows"] for row in report["rows"]] == [1, 9]
    for row in report["rows"]:
        assert row["onednn_ms"] > 0 and row["panels_ms"] > 0
        assert row["panels_over_onednn"] == pytest.approx(row["panels_ms"] / row["onednn_ms"], 1e-2)
    assert report["parameters"]["layers"] == 1 and "flags" in report["hardware"]
    printed = capsys.readouterr().out
    # One layer's four projections (7.1 MB) and the LM head (56.6 MB), not 30 layers' 269 MB.
    assert "| 64 MB of bf16 weights | panels serve <=" in printed

"""``slipstream kernels build`` builds (or finds) both native kernels in the home."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from slipstream.service.cli import main


def test_kernels_build_reports_both_kernels_ready(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    assert main(["kernels", "build"]) == 0
    out = capsys.readouterr().out
    assert "fused attention: ready" in out and "fused elementwise ops: ready" in out
    home = Path(os.environ["SLIPSTREAM_HOME"])
    built = {p.name.rsplit("-", 1)[0] for p in (home / "cache" / "extensions").iterdir()}
    assert {"paged_attention_cpu", "fused_ops_cpu"} <= built

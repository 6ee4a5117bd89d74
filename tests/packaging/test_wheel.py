"""The wheel a user installs: stubs inside, and a base install that is only the
client — no torch, no transformers — yet drives a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUBS = ("slipstream/v1/inference_pb2.py", "slipstream/v1/inference_pb2_grpc.py")


def _run(*command: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    # Build isolation, as a user's `pip wheel .` or `python -m build` gets it.
    built = _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, REPO)
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("slipstream-*.whl")
    return path


@pytest.fixture(scope="module")
def client_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("client-venv")
    assert _run(sys.executable, "-m", "venv", venv).returncode == 0
    installed = _run(venv / "bin/python", "-m", "pip", "install", "-q", wheel)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv


def test_wheel_carries_generated_stubs_and_every_room(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(STUBS) <= names
    for room in ("engine", "models", "api", "telemetry", "cli", "bench"):
        assert f"slipstream/service/{room}/__init__.py" in names, room
    assert "slipstream/service/models/assets/corpus.txt.xz" in names
    # The native kernels' sources, built where they run (a container's install too).
    sources = {p.name for p in (REPO / "kernels" / "csrc").iterdir()}
    assert {f"slipstream/kernels/csrc/{name}" for name in sources} <= names
    # PEP 561 markers: without them mypy skips the installed client and stubs.
    assert {"slipstream/clients/py.typed", "slipstream/v1/py.typed"} <= names


def test_base_install_is_a_client_without_torch(client_venv: Path) -> None:
    probe = (
        "import importlib.util as u; print([m for m in ('torch','transformers') if u.find_spec(m)])"
    )
    assert _run(client_venv / "bin/python", "-c", probe).stdout.strip() == "[]"
    served = _run(client_venv / "bin/slipstream", "serve", "--model", "tiny")
    assert served.returncode == 2
    assert "needs the server extra" in served.stderr and "Traceback" not in served.stderr


def test_light_client_generates_against_a_full_server(
    client_venv: Path, spawn_server: Callable[..., tuple[subprocess.Popen[str], str]]
) -> None:
    _, target = spawn_server("--model", "tiny", "--no-calibrate")
    cli = client_venv / "bin/slipstream"
    generated = _run(
        cli, "generate", "--server", target, "--prompt", "Hello", "--max-tokens", "4", "--json"
    )
    assert generated.returncode == 0, generated.stderr[-3000:]
    (line,) = generated.stdout.splitlines()
    result = json.loads(line)
    assert len(result["token_ids"]) == 4 and result["finish_reason"] == "max_tokens"
    stats = _run(cli, "stats", "--server", target, "--json")
    assert stats.returncode == 0 and "kv_blocks" in stats.stdout

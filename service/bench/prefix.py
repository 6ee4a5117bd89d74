"""``slipstream bench prefix``: many requests sharing one long system prompt,
run with automatic prefix caching on and then off, in one process on the
identical seeded workload.

Every request is a ``--system-len``-token system prompt followed by a short
question of its own (random token ids, seeded), and makes exactly
``--max-tokens`` tokens (EOS ignored). All requests are submitted at once at
``t0``. By default the cache is cold then (the untimed warm-up shares
nothing with them): the first requests compute the system prompt and the
rest find it cached. ``--warm`` first runs, untimed, one request made of the
system prompt alone, as earlier traffic would have (in both modes).
Reports TTFT p50/p95, output throughput and the hit rate per mode, the
on/off ratios, and writes JSON (``{"modes", "ratios", "workload",
"environment"}``) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slipstream.scheduler.request import FinishReason
from slipstream.service.bench.offline import submit_workload
from slipstream.service.bench.report import add_kv_memory_argument, hardware, resolved_dtype
from slipstream.service.bench.workload import NUM_SPECIAL_IDS, WARMUP_WORKLOAD, WorkloadRequest
from slipstream.service.engine.config import DTYPE_CHOICES, EngineConfig
from slipstream.service.engine.events import Event, FinishEvent

MODES = {"on": True, "off": False}


class PrefixBenchError(Exception):
    """A benchmark that cannot run as asked."""


@dataclass(frozen=True, slots=True)
class PrefixOptions:
    model: str = "small"
    num_requests: int = 64
    system_len: int = 1000
    question_len: tuple[int, int] = (8, 24)
    max_tokens: int = 16
    seed: int = 0
    dtype: str = "float32"  # concrete
    requested_dtype: str = "auto"
    num_threads: int = 2
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    warm: bool = False
    # commit: the KV pools backed before the clock starts, as `serve` does; lazy:
    # a cold request's fresh blocks fault their pages in inside its TTFT, which a
    # cached prefix's blocks, already written, do not (flattering the cache).
    kv_memory: str = "commit"
    json_path: str | None = None
    plot_path: str | None = None

    def __post_init__(self) -> None:
        low, high = self.question_len
        checks = (
            (self.num_requests < 1, "--requests must be >= 1"),
            (self.system_len < 1, "--system-len must be >= 1"),
            (not 1 <= low <= high, "--question-len needs 1 <= MIN <= MAX"),
            (self.max_tokens < 1, "--max-tokens must be >= 1"),
            (self.num_threads < 1, "--threads must be >= 1"),
        )
        for failed, message in checks:
            if failed:
                raise PrefixBenchError(message)


def make_prefix_workload(options: PrefixOptions, vocab_size: int) -> list[WorkloadRequest]:
    """One seeded system prompt, then a distinct seeded question per request."""
    if vocab_size <= NUM_SPECIAL_IDS + 1:
        raise PrefixBenchError(f"vocabulary of {vocab_size} ids is too small")
    rng = random.Random(options.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(n)]

    system = tokens(options.system_len)
    low, high = options.question_len
    return [
        WorkloadRequest(system + tokens(rng.randint(low, high)), options.max_tokens)
        for _ in range(options.num_requests)
    ]


# -- one mode ------------------------------------------------------------------


class _Collector:
    """First-token stamps and finish events, written on the engine thread."""

    def __init__(self, num_requests: int) -> None:
        self.first_token: dict[str, float] = {}
        self.finished: dict[str, tuple[float, FinishEvent]] = {}
        self._remaining = num_requests
        self._lock = threading.Lock()
        self.done = threading.Event()
        if num_requests == 0:
            self.done.set()

    def on_event(self, event: Event) -> None:
        now = time.monotonic()
        if not isinstance(event, FinishEvent):
            self.first_token.setdefault(event.req_id, now)
            return
        self.finished[event.req_id] = (now, event)
        with self._lock:
            self._remaining -= 1
            if self._remaining == 0:
                self.done.set()


def _submit_and_wait(
    engine: Any, workload: Sequence[WorkloadRequest], tag: str
) -> tuple[float, list[tuple[float, float, FinishEvent]]]:
    """Submits every request at one ``t0``; returns the wall time and, per
    request, (TTFT, latency, finish event)."""
    ids = [f"{tag}-{i}" for i in range(len(workload))]
    collector = _Collector(len(ids))
    t0 = time.monotonic()
    submit_workload(engine, workload, ids, t0, collector.on_event)
    collector.done.wait()
    wall_s = max(at for at, _ in collector.finished.values()) - t0
    rows = []
    for req_id, req in zip(ids, workload, strict=True):
        finished_at, event = collector.finished[req_id]
        if event.reason is not FinishReason.MAX_TOKENS or event.num_output_tokens != req.max_tokens:
            raise PrefixBenchError(f"{req_id} ended {event.reason.name}: {event.message}")
        rows.append((collector.first_token[req_id] - t0, finished_at - t0, event))
    return wall_s, rows


def engine_config(model_dir: str, options: PrefixOptions, prefix_cache: bool) -> EngineConfig:
    knobs = {
        "block_size": options.block_size,
        "max_num_batched_tokens": options.max_num_batched_tokens,
    }
    return EngineConfig(
        model=model_dir,
        dtype=options.dtype,
        num_threads=options.num_threads,
        prefix_cache=prefix_cache,
        commit_kv_memory=options.kv_memory == "commit",
        **{k: v for k, v in knobs.items() if v is not None},  # type: ignore[arg-type]
    )


def run_mode(
    model_dir: str, workload: Sequence[WorkloadRequest], options: PrefixOptions, prefix_cache: bool
) -> dict[str, object]:
    """One engine, prefix caching on or off, over the whole workload."""
    import numpy as np

    from slipstream.service.engine.loader import load_engine

    config = engine_config(model_dir, options, prefix_cache)
    engine = load_engine(config)
    engine.start()
    load_before = os.getloadavg()[0]
    try:
        _submit_and_wait(engine, WARMUP_WORKLOAD, "warmup")
        if options.warm:
            system = workload[0].prompt_token_ids[: options.system_len]
            _submit_and_wait(engine, [WorkloadRequest([*system, NUM_SPECIAL_IDS], 1)], "seed")
        before = engine.stats().prefix_cache
        wall_s, rows = _submit_and_wait(engine, workload, "req")
        after = engine.stats().prefix_cache
    finally:
        engine.shutdown()
    ttfts = [ttft for ttft, _, _ in rows]
    latencies = [latency for _, latency, _ in rows]
    num_output = sum(event.num_output_tokens for _, _, event in rows)
    num_prompt = sum(event.num_prompt_tokens for _, _, event in rows)
    num_cached = sum(event.num_cached_tokens for _, _, event in rows)
    queried = after.queried_tokens - before.queried_tokens
    hits = after.hit_tokens - before.hit_tokens
    return {
        "prefix_cache": prefix_cache,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p95_s": float(np.percentile(ttfts, 95)),
        "latency_p50_s": float(np.percentile(latencies, 50)),
        "wall_s": wall_s,
        "output_tokens_per_s": num_output / wall_s,
        "total_tokens_per_s": (num_output + num_prompt) / wall_s,
        "num_output_tokens": num_output,
        "num_prompt_tokens": num_prompt,
        # Prompt tokens reported cached per request (Usage.cached_tokens), and
        # the engine's own look-ups (admissions, preemptions included).
        "num_cached_prompt_tokens": num_cached,
        "cached_prompt_fraction": num_cached / num_prompt if num_prompt else 0.0,
        "hit_rate": hits / queried if queried else 0.0,
        "num_preemptions": sum(event.num_preemptions for _, _, event in rows),
        "load_avg_1m": [load_before, os.getloadavg()[0]],
        "settings": {**asdict(config), "engine_info": asdict(engine.info)},
    }


# -- the run -------------------------------------------------------------------


def run_prefix(options: PrefixOptions) -> dict[str, object]:
    import torch

    from slipstream.service.models.store import resolve_model

    torch.set_num_threads(options.num_threads)
    try:
        model_dir = str(resolve_model(options.model))
    except ValueError as exc:
        raise PrefixBenchError(str(exc)) from exc
    config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
    workload = make_prefix_workload(options, int(config.get("text_config", config)["vocab_size"]))
    report: dict[str, Any] = {
        "workload": {
            "num_requests": options.num_requests,
            "system_len": options.system_len,
            "question_len": list(options.question_len),
            "max_tokens": options.max_tokens,
            "seed": options.seed,
            "cache_at_t0": "warm" if options.warm else "cold",
        },
        "environment": _environment(options, model_dir),
    }
    modes: dict[str, dict[str, object]] = {}
    for name, prefix_cache in MODES.items():
        print(f"prefix cache {name} ...", flush=True)
        modes[name] = run_mode(model_dir, workload, options, prefix_cache)
    report["environment"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    report = {"modes": modes, **report, "ratios": prefix_ratios(modes)}
    print(format_prefix_table(modes))
    for key, value in report["ratios"].items():
        print(f"{key}: {value:.2f}x")
    if options.json_path:
        Path(options.json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if options.plot_path:
        plot_prefix(report, options.plot_path)
    return report


def prefix_ratios(modes: dict[str, dict[str, Any]]) -> dict[str, float]:
    """How much caching helps: TTFT p50 off/on (higher is better) and
    output throughput on/off."""
    on, off = modes["on"], modes["off"]
    return {
        "ttft_p50_off/on": off["ttft_p50_s"] / on["ttft_p50_s"],
        "throughput_on/off": on["output_tokens_per_s"] / off["output_tokens_per_s"],
    }


def format_prefix_table(modes: dict[str, dict[str, Any]]) -> str:
    header = f"{'prefix cache':<13} {'TTFT p50 s':>10} {'TTFT p95 s':>10} {'out tok/s':>10}"
    header += f" {'wall s':>8} {'hit rate':>9}"
    rows = [header, "-" * len(header)]
    for name, m in modes.items():
        row = f"{name:<13} {m['ttft_p50_s']:>10.3f} {m['ttft_p95_s']:>10.3f}"
        row += f" {m['output_tokens_per_s']:>10.1f} {m['wall_s']:>8.2f} {m['hit_rate']:>9.1%}"
        rows.append(row)
    return "\n".join(rows)


def plot_prefix(report: dict[str, Any], path: str) -> None:
    """PNG: TTFT p50 and output tokens/s with caching on and off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = report["modes"]
    names = [f"cache {name}" for name in modes]
    colors = ["tab:green", "tab:gray"]
    fig, (ttft_ax, tps_ax) = plt.subplots(1, 2, figsize=(9, 4))
    ttft_ax.bar(names, [m["ttft_p50_s"] for m in modes.values()], color=colors)
    ttft_ax.set_ylabel("TTFT p50, s (lower is better)")
    tps_ax.bar(names, [m["output_tokens_per_s"] for m in modes.values()], color=colors)
    tps_ax.set_ylabel("output tokens/s (higher is better)")
    for ax in (ttft_ax, tps_ax):
        ax.grid(axis="y", alpha=0.3)
    env, work = report["environment"], report["workload"]
    cpu = env.get("cpu", {})
    fig.suptitle(
        f"{env['model']} · {work['num_requests']} requests sharing a {work['system_len']}-token "
        f"prompt ({work['cache_at_t0']} at t0) · hit rate {modes['on']['hit_rate']:.0%} · "
        f"{env['dtype']} · "
        f"{env['num_threads']} threads · {cpu.get('model')} "
        f"({', '.join(cpu.get('flags', [])) or 'no listed flags'})",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _environment(options: PrefixOptions, model_dir: str) -> dict[str, object]:
    import torch

    return {
        "model": options.model,
        "model_dir": model_dir,
        **hardware(options.requested_dtype),
        "num_threads": options.num_threads,
        "kv_memory": options.kv_memory,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "num_cpus": os.cpu_count(),
        # Other processes on a shared machine skew both modes; this shows how busy it was.
        "load_avg_1m_at_start": os.getloadavg()[0],
    }


# -- the command ---------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "prefix",
        help="requests sharing a long system prompt, prefix caching on vs off",
        description=__doc__,
    )
    parser.add_argument("--model", default="small", help="model name (tiny, small, ...) or path")
    parser.add_argument("--requests", type=int, default=64, dest="num_requests")
    parser.add_argument("--system-len", type=int, default=1000, help="shared prompt tokens")
    parser.add_argument(
        "--question-len", type=int, nargs=2, default=(8, 24), metavar=("MIN", "MAX")
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--threads", type=int, default=2, dest="num_threads")
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument(
        "--warm", action="store_true", help="run the system prompt once, untimed, before t0"
    )
    add_kv_memory_argument(parser)
    parser.add_argument("--json", dest="json_path", help="write the report here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG here (needs matplotlib)")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        options = PrefixOptions(
            model=args.model,
            num_requests=args.num_requests,
            system_len=args.system_len,
            question_len=tuple(args.question_len),
            max_tokens=args.max_tokens,
            seed=args.seed,
            dtype=resolved_dtype(args.dtype),
            requested_dtype=args.dtype,
            num_threads=args.num_threads,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            warm=args.warm,
            kv_memory=args.kv_memory,
            json_path=args.json_path,
            plot_path=args.plot_path,
        )
        run_prefix(options)
    except PrefixBenchError as exc:
        print(f"slipstream bench prefix: {exc}", file=sys.stderr)
        return 2
    return 0

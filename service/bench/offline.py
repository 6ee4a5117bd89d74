"""``slipstream bench offline``: Slipstream and its peers, one after another
in one process, on the identical seeded workload; prints a table and writes
JSON ``{"engines": {...}, "workload": {...}, "ratios": {...}}``.

All requests are submitted at once at ``t0``; every engine ignores EOS, so
each request makes exactly its ``max_tokens`` (checked). Engines share one
dtype and one torch thread count; each has an untimed warm-up first.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slipstream.kernels.compute_thread import on_own_thread
from slipstream.scheduler.request import FinishReason
from slipstream.service.bench import roofline
from slipstream.service.bench.peer_process import PeerError
from slipstream.service.bench.peers import PEERS, failure_entry
from slipstream.service.bench.report import (
    EngineRun,
    RequestTiming,
    add_kv_memory_argument,
    check_token_counts,
    engine_metrics,
    format_table,
    hardware,
    plot_engines,
    resolved_dtype,
    throughput_ratios,
)
from slipstream.service.bench.workload import (
    WARMUP_WORKLOAD,
    WorkloadRequest,
    load_workload,
    make_workload,
    save_workload,
    workload_summary,
)
from slipstream.service.cli.arg_types import non_negative_int
from slipstream.service.engine.config import (
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    PREFILL_GRAPH_TOKENS,
    SWITCH_CHOICES,
    EngineConfig,
    switch,
)
from slipstream.service.engine.device import resolve_device
from slipstream.service.engine.events import Event, FinishEvent, RequestSpec

# Slipstream and every peer; the peers that are not ``by_default`` run only
# when asked for (vLLM needs an environment of its own, llama.cpp a binary).
ENGINES = ("slipstream", *PEERS)
DEFAULT_ENGINES = ("slipstream", *(name for name, peer in PEERS.items() if peer.by_default))


class BenchError(Exception):
    """A benchmark that cannot run as asked (bad flags, missing engine)."""


@dataclass(frozen=True, slots=True)
class OfflineOptions:
    """Everything one offline benchmark run depends on."""

    model: str
    num_requests: int
    seed: int
    engines: tuple[str, ...]
    dtype: str  # concrete (float32 | bfloat16): every engine of the run uses it
    num_threads: int
    requested_dtype: str = "auto"
    prompt_len: tuple[int, int] = (16, 512)
    output_len: tuple[int, int] = (8, 256)
    workload_path: str | None = None
    save_workload_path: str | None = None
    json_path: str | None = None
    plot_path: str | None = None
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    prefix_cache: bool = True
    floor: bool = True
    device: str = "cpu"  # --device as given: cpu, cuda, cuda:N (auto resolved)
    plan_ahead: bool | None = None  # None: the engine's default (on a GPU only)
    prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS
    kv_cache_dtype: str = "auto"  # Slipstream's KV cache (EngineConfig.kv_cache_dtype)
    # commit: Slipstream's KV pools backed at start-up, as `serve` does by
    # default (EngineConfig.commit_kv_memory); lazy: faulted in as first used.
    kv_memory: str = "commit"
    # Each peer's settings by peer name (``Peer.settings``), for the peers asked for.
    peers: Mapping[str, object] = field(default_factory=dict)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "offline",
        help="throughput/latency of Slipstream vs transformers on one seeded workload",
        description=__doc__,
    )
    parser.add_argument("--model", default="small", help="model name (tiny, small) or path")
    parser.add_argument("--requests", type=int, default=64, dest="num_requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", help="write the report here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG here (needs matplotlib)")
    parser.add_argument(
        "--engines",
        default=",".join(DEFAULT_ENGINES),
        help=f"comma-separated subset of {','.join(ENGINES)}",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bf16 only with native bf16"
    )
    parser.add_argument("--threads", type=int, default=2, dest="num_threads")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N (auto: the GPU when torch sees one): where Slipstream and "
        "the in-process transformers peers run",
    )
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(16, 512), metavar=("MIN", "MAX")
    )
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--workload", dest="workload_path", help="replay this JSONL workload")
    parser.add_argument("--save-workload", dest="save_workload_path", help="write workload JSONL")
    engine = parser.add_argument_group("Slipstream engine (EngineConfig; unset = its default)")
    engine.add_argument("--block-size", type=int)
    engine.add_argument("--max-num-batched-tokens", type=int)
    engine.add_argument("--max-num-seqs", type=int)
    engine.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_false", help="prefix caching off"
    )
    engine.add_argument(
        "--plan-ahead",
        default="auto",
        choices=SWITCH_CHOICES,
        help="plan step N+1 while the device runs step N (auto: on a GPU only)",
    )
    engine.add_argument(
        "--prefill-graph-tokens",
        type=non_negative_int,
        default=PREFILL_GRAPH_TOKENS,
        help="on CUDA: steps with a prefill of up to N tokens replay CUDA graphs (0: off)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPE_CHOICES,
        help="Slipstream's KV cache: the model's dtype, or int8 rows (the peers keep theirs)",
    )
    add_kv_memory_argument(engine)
    parser.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip measuring the workload's floor on this CPU (bench/roofline.py)",
    )
    for peer in PEERS.values():
        peer.add_arguments(parser)
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        options = _options_from_args(args, os.environ)
        run_offline(options)
    except BenchError as exc:
        print(f"slipstream bench offline: {exc}", file=sys.stderr)
        return 2
    return 0


def _options_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> OfflineOptions:
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise BenchError(f"--engines takes a subset of {','.join(ENGINES)}, got {args.engines!r}")
    if args.num_requests < 1 or args.num_threads < 1:
        raise BenchError("--requests and --threads must be >= 1")
    try:
        device = str(resolve_device(args.device))
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    peers = {}
    for name in engines:
        if name in PEERS:
            try:
                peers[name] = PEERS[name].settings(args, environ)
            except ValueError as exc:
                raise BenchError(str(exc)) from exc
    return OfflineOptions(
        model=args.model,
        num_requests=args.num_requests,
        seed=args.seed,
        engines=engines,
        dtype=resolved_dtype(args.dtype, device),
        requested_dtype=args.dtype,
        device=device,
        num_threads=args.num_threads,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        workload_path=args.workload_path,
        save_workload_path=args.save_workload_path,
        json_path=args.json_path,
        plot_path=args.plot_path,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        prefix_cache=args.prefix_cache,
        plan_ahead=switch(args.plan_ahead),
        prefill_graph_tokens=args.prefill_graph_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_memory=args.kv_memory,
        floor=args.floor and device == "cpu",  # the floor is a CPU roofline
        peers=peers,
    )


def run_offline(options: OfflineOptions) -> dict[str, object]:
    """Run every chosen engine on one workload; returns (and maybe writes) the report."""
    # torch and transformers load here, not at import: the CLI imports every
    # subcommand module to build its parser.
    import torch

    torch.set_num_threads(options.num_threads)
    model_dir = resolve_model_dir(options.model)
    workload = _workload(options, model_dir)
    if options.save_workload_path:
        save_workload(options.save_workload_path, workload)
    report: dict[str, object] = {
        "workload": _workload_info(options, workload),
        "environment": _environment(options, model_dir),
    }
    _print_parameters(report)
    # The floor's matmuls and the in-process peers run on threads of their
    # own, so that the engine's thread keeps the process's only OpenMP team
    # (kernels/compute_thread.py).
    floor = (
        on_own_thread(lambda: _floor(model_dir, workload, options), "slipstream-floor")
        if options.floor
        else None
    )
    if floor is not None:
        report["floor"] = floor.as_dict()
        print(floor.describe(), flush=True)
    engines: dict[str, dict[str, object]] = {}
    for name in options.engines:
        print(f"running {name} ...", flush=True)
        load_before = os.getloadavg()[0]
        try:
            run = _run_engine(name, model_dir, workload, options)
        except PeerError as exc:
            # A peer in another process fails alone: the others' figures still count.
            engines[name] = failure_entry(PEERS[name], exc, options)
            continue
        check_token_counts(run, [r.max_tokens for r in workload])
        engines[name] = engine_metrics(run)
        # Per engine, since engines run one after another: other work on a
        # shared machine can slow one engine and not the next.
        engines[name]["load_avg_1m"] = [load_before, os.getloadavg()[0]]
        gc.collect()
    report["environment"]["load_avg_1m_at_end"] = os.getloadavg()[0]  # type: ignore[index]
    report = {"engines": engines, **report, "ratios": throughput_ratios(engines)}
    print(format_table(engines))
    if floor is not None and "output_tokens_per_s" in engines.get("slipstream", {}):
        ours = float(engines["slipstream"]["output_tokens_per_s"])  # type: ignore[arg-type]
        fraction = ours / floor.output_tokens_per_s
        report["floor"] = {**floor.as_dict(), "slipstream_fraction": fraction}
        print(f"slipstream ran at {fraction:.2f}x the floor's rate")
    for name, peer in PEERS.items():
        line = peer.summary(engines[name]) if name in engines else None
        if line:
            print(line)
    for key, value in report["ratios"].items():  # type: ignore[attr-defined]
        print(f"{key}: {value:.2f}x")
    if options.json_path:
        Path(options.json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if options.plot_path:
        plot_engines(report, options.plot_path)
    return report


def _floor(
    model_dir: str, workload: Sequence[WorkloadRequest], options: OfflineOptions
) -> roofline.Floor:
    shape = roofline.ModelShape.from_dir(model_dir)
    kv_bytes = 4 if options.dtype == "float32" else 2
    work = roofline.workload_work(shape, workload, kv_bytes)
    rates = roofline.measure_rates(shape, options.dtype)
    return roofline.Floor.of(work, rates, sum(r.max_tokens for r in workload))


def resolve_model_dir(model: str) -> str:
    """A model name (created on first use) or checkpoint path as a directory."""
    from slipstream.service.models.store import resolve_model

    try:
        return str(resolve_model(model))
    except ValueError as exc:
        raise BenchError(str(exc)) from exc


def _workload(options: OfflineOptions, model_dir: str) -> list[WorkloadRequest]:
    if options.workload_path:
        return load_workload(options.workload_path)
    return make_workload(
        options.num_requests,
        options.seed,
        _vocab_size(model_dir),
        prompt_len=options.prompt_len,
        output_len=options.output_len,
    )


def _vocab_size(model_dir: str) -> int:
    config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
    text_config = config.get("text_config", config)
    return int(text_config["vocab_size"])


def _run_engine(
    name: str, model_dir: str, workload: Sequence[WorkloadRequest], options: OfflineOptions
) -> EngineRun:
    if name == "slipstream":
        return run_slipstream(model_dir, workload, options)
    try:
        peer = PEERS[name]
        if options.device != "cpu":
            return peer.run(model_dir, workload, options)
        return on_own_thread(lambda: peer.run(model_dir, workload, options), name)
    except PeerError:
        raise
    except Exception as exc:  # an in-process peer's own error (say, another transformers)
        raise PeerError(f"{type(exc).__name__}: {exc}") from exc


def run_slipstream(
    model_dir: str, workload: Sequence[WorkloadRequest], options: OfflineOptions
) -> EngineRun:
    """Slipstream's in-process engine: every request submitted at ``t0``;
    latency is the engine thread's finish callback, TTFT its first token."""
    try:
        from slipstream.service.engine.loader import load_engine
    except ModuleNotFoundError as exc:
        if exc.name != "slipstream.service.engine.engine":
            raise
        raise BenchError(
            "the Slipstream engine (slipstream.service.engine.engine) is missing"
        ) from exc
    config = _engine_config(model_dir, options)
    engine = load_engine(config)
    engine.start()
    try:
        _submit_and_wait(engine, WARMUP_WORKLOAD, "warmup", time.monotonic())
        t0 = time.monotonic()
        timings = _submit_and_wait(engine, workload, "req", t0)
        wall_s = time.monotonic() - t0
    finally:
        engine.shutdown()
    settings = {**asdict(config), "engine_info": asdict(engine.info)}
    # The budget the engine ran with (unset, the device's: config.step_token_budget).
    on_gpu = engine.info.device.get("type") == "cuda"
    settings["max_num_batched_tokens"] = config.step_token_budget(on_gpu=on_gpu)
    return EngineRun("slipstream", wall_s, timings, settings)


def _engine_config(model_dir: str, options: OfflineOptions) -> EngineConfig:
    knobs = {
        "block_size": options.block_size,
        "max_num_batched_tokens": options.max_num_batched_tokens,
        "max_num_seqs": options.max_num_seqs,
    }
    set_knobs = {k: v for k, v in knobs.items() if v is not None}
    return EngineConfig(
        model=model_dir,
        device=options.device,
        dtype=options.dtype,
        num_threads=options.num_threads,
        prefix_cache=options.prefix_cache,
        plan_ahead=options.plan_ahead,
        prefill_graph_tokens=options.prefill_graph_tokens,
        kv_cache_dtype=options.kv_cache_dtype,
        commit_kv_memory=options.kv_memory == "commit",
        **set_knobs,
    )


class _Collector:
    """Per-request stamps and delivered token counts, written on the engine
    thread; ``done`` is set once every request has finished."""

    def __init__(self, req_ids: Sequence[str]) -> None:
        self.first_token: dict[str, float] = {}
        self.num_tokens = dict.fromkeys(req_ids, 0)
        self.finished: dict[str, tuple[float, FinishEvent]] = {}
        self._remaining = len(req_ids)
        self.done = threading.Event()
        if not req_ids:
            self.done.set()

    def on_event(self, event: Event) -> None:
        # Called only on the engine thread, so no lock is needed.
        now = time.monotonic()
        if not isinstance(event, FinishEvent):
            self.first_token.setdefault(event.req_id, now)
            self.num_tokens[event.req_id] += len(event.token_ids)
            return
        self.finished[event.req_id] = (now, event)
        self._remaining -= 1
        if self._remaining == 0:
            self.done.set()


def submit_workload(
    engine: Any,
    workload: Sequence[WorkloadRequest],
    ids: Sequence[str],
    t0: float,
    on_event: Callable[[Event], None],
) -> None:
    """Submit every request of ``workload`` (EOS ignored) as arriving at ``t0``."""
    for req_id, req in zip(ids, workload, strict=True):
        request = RequestSpec(
            req_id=req_id,
            prompt_token_ids=list(req.prompt_token_ids),
            max_new_tokens=req.max_tokens,
            ignore_eos=True,
            arrival_time=t0,
        )
        engine.submit(request, on_event)


def _submit_and_wait(
    engine: Any, workload: Sequence[WorkloadRequest], prefix: str, t0: float
) -> list[RequestTiming]:
    """Submit every request stamped as arriving at ``t0``; wait for all.
    A request's token count is what its token events delivered."""
    ids = [f"{prefix}-{i}" for i in range(len(workload))]
    collector = _Collector(ids)
    submit_workload(engine, workload, ids, t0, collector.on_event)
    collector.done.wait()
    timings = []
    for req_id in ids:
        finished_at, event = collector.finished[req_id]
        if event.reason != FinishReason.MAX_TOKENS:
            raise BenchError(
                f"slipstream {req_id} finished with {event.reason.name}: {event.message}"
            )
        first = collector.first_token.get(req_id)
        ttft = None if first is None else first - t0
        timings.append(RequestTiming(collector.num_tokens[req_id], finished_at - t0, ttft))
    return timings


def _workload_info(
    options: OfflineOptions, workload: Sequence[WorkloadRequest]
) -> dict[str, object]:
    source = (
        {"file": options.workload_path}
        if options.workload_path
        else {
            "seed": options.seed,
            "prompt_len": list(options.prompt_len),
            "output_len": list(options.output_len),
            "distribution": "log-uniform",
        }
    )
    return {**workload_summary(workload), **source, "eos": "ignored"}


def _environment(options: OfflineOptions, model_dir: str) -> dict[str, object]:
    import torch
    import transformers

    return {
        "model": options.model,
        "model_dir": model_dir,
        **hardware(options.requested_dtype, options.device),
        "num_threads": options.num_threads,
        "slipstream_kv_cache_dtype": options.kv_cache_dtype,
        "slipstream_kv_memory": options.kv_memory,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "num_cpus": os.cpu_count(),
        # Other processes on a shared machine skew every engine; this shows how busy it was.
        "load_avg_1m_at_start": os.getloadavg()[0],
    }


def _print_parameters(report: dict[str, object]) -> None:
    for section in ("environment", "workload"):
        fields = report[section]
        print(f"{section}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))  # type: ignore[attr-defined]

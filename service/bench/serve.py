"""``slipstream bench serve``: a load generator in the style of vLLM's serving
benchmark. A seeded workload (EOS ignored, so request i makes exactly its
``max_tokens``) is sent over gRPC with Poisson/Gamma arrivals at ``--rate``
(or all at once) under a ``--concurrency`` cap; it reports TTFT, TPOT, ITL
and end-to-end latency percentiles, request and token throughput, and the
same workload run through an in-process engine for comparison.

With ``--model`` and no ``--server`` it starts ``slipstream serve`` itself
(a separate process, as in production) and stops it before the in-process
run, so the two never share the CPU.

``--protocol http`` sends the same workload through the OpenAI-compatible
HTTP front (streamed ``/v1/completions``); ``both`` runs gRPC then HTTP on
the same server, side by side, and reports their ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from slipstream.service.bench.report import hardware
from slipstream.service.bench.serve_load import LoadShape, Trace, metrics, run_local, run_remote
from slipstream.service.bench.serve_process import spawned_serve
from slipstream.service.bench.workload import WorkloadRequest, make_workload, workload_summary
from slipstream.service.cli.arg_types import non_negative_int, positive_float, positive_int
from slipstream.service.engine.config import DTYPE_CHOICES

# ---------------------------------------------------------------- the server


def remote_vocab_size(target: str) -> int:
    return remote_model(target)[1]


def remote_model(target: str) -> tuple[str, int]:
    """The served model's name and vocabulary size."""
    from slipstream.clients import Client

    with Client(target) as client:
        info = client.model_info()
        return info.name, info.vocab_size


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@contextmanager
def spawned_server(
    args: argparse.Namespace, env: Mapping[str, str] | None = None, http_port: int = 0
) -> Iterator[str]:
    """``slipstream serve`` on a free loopback port, stopped (SIGTERM) on exit;
    ``env`` replaces the inherited environment when given; the HTTP front
    listens on ``http_port`` (0: off)."""
    flags = ["--http-port", str(http_port), "--model", args.model, "--dtype", args.dtype]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if not args.prefix_cache:
        flags += ["--no-prefix-cache"]
    with spawned_serve(flags, env) as (_, target):
        yield target


def local_engine(args: argparse.Namespace) -> object:
    from slipstream.service.engine.config import EngineConfig
    from slipstream.service.engine.loader import load_engine

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        prefix_cache=args.prefix_cache,
    )
    engine = load_engine(config)
    engine.start()
    return engine


# ---------------------------------------------------------------- command


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = bench_subparsers.add_parser("serve", help="load-test a gRPC server")
    parser.add_argument(
        "--server",
        "--target",
        metavar="HOST:PORT",
        help="an already running server, or a balancer in front of several",
    )
    parser.add_argument("--model", default=None, help="serve (and run in-process) this model")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument(
        "--no-prefix-cache", dest="prefix_cache", action="store_false", help="prefix caching off"
    )
    parser.add_argument("--requests", type=positive_int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rate", type=positive_float, default=math.inf, help="requests/s; inf = all at once"
    )
    parser.add_argument(
        "--burstiness", type=positive_float, default=1.0, help="Gamma shape; 1 = Poisson"
    )
    parser.add_argument(
        "--concurrency", type=positive_int, default=None, help="max requests in flight"
    )
    parser.add_argument(
        "--streams", type=positive_int, default=1, help="gRPC streams to spread over"
    )
    parser.add_argument(
        "--per-request",
        action="store_true",
        help="one GenerateOne call per request instead of multiplexed streams",
    )
    parser.add_argument(
        "--protocol",
        default="grpc",
        choices=("grpc", "http", "both"),
        help="http: the OpenAI-compatible front; both: gRPC then HTTP, side by side",
    )
    parser.add_argument("--http-server", metavar="HOST:PORT", help="the HTTP front of the --server")
    parser.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="also serve the model with vLLM's OpenAI server from this Python's environment "
        "and send it the same workload over HTTP (after Slipstream's server stopped)",
    )
    parser.add_argument("--vllm-log", type=Path, default=None, help="keep vLLM's server log here")
    parser.add_argument("--warmup", type=non_negative_int, default=4, help="untimed requests first")
    parser.add_argument("--no-local", action="store_true", help="skip the in-process run")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument(
        "--trace-overhead",
        action="store_true",
        help="serve twice, tracing off and exporting OTLP to a local receiver; compare",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="off/on pairs (--trace-overhead); gRPC/HTTP pairs, alternating (--protocol both)",
    )
    parser.set_defaults(func=run)


def _timed_runs(args: argparse.Namespace, shape: LoadShape) -> dict:
    from slipstream.service.bench.http_load import run_http

    report: dict = {}
    server = args.server
    protocols = ("grpc", "http") if args.protocol == "both" else (args.protocol,)
    http_port = free_port() if "http" in protocols and server is None else 0
    at_once = LoadShape(math.inf, 1.0, None, 0)
    with spawned_server(args, http_port=http_port) if server is None else _given(server) as target:
        model, vocab = remote_model(target)
        workload = make_workload(args.requests, args.seed, vocab)
        warmup = make_workload(args.warmup, args.seed + 1000, vocab, output_len=(4, 16))
        http_target = args.http_server or f"{target.rsplit(':', 1)[0]}:{http_port}"
        per_request = getattr(args, "per_request", False)
        runs: dict[str, list[tuple[list[Trace], float]]] = {p: [] for p in protocols}
        # Rounds alternate which protocol goes first, so a machine whose load
        # drifts during the run does not favour either.
        for round_index in range(max(1, args.rounds) if len(protocols) > 1 else 1):
            order = protocols if round_index % 2 == 0 else protocols[::-1]
            for protocol in order:
                if protocol == "grpc":
                    run_remote(target, warmup, at_once, args.streams, per_request)
                    run = run_remote(target, workload, shape, args.streams, per_request)
                else:
                    base_url = f"http://{http_target}"
                    run = run_http(base_url, model, workload, shape, warmup)
                runs[protocol].append(run)
        for protocol, results in runs.items():
            key, where = ("server", target) if protocol == "grpc" else ("http", http_target)
            traces = [t for result, _ in results for t in result]
            wall = sum(w for _, w in results)
            report[key] = {"target": where, **metrics(traces, list(workload) * len(results), wall)}
    if args.vllm_python:
        report["vllm"] = _vllm_run(args, model, workload, warmup, shape)
    if args.model and not args.no_local:
        engine = local_engine(args)
        try:
            run_local(engine, warmup, LoadShape(math.inf, 1.0, None, 0), "warmup")
            traces, wall = run_local(engine, workload, shape, "bench")
        finally:
            engine.shutdown()  # type: ignore[attr-defined]
        report["in_process"] = metrics(traces, workload, wall)
    report["workload"] = workload_summary(workload)
    return report


def _vllm_run(
    args: argparse.Namespace,
    model: str,
    workload: Sequence[WorkloadRequest],
    warmup: Sequence[WorkloadRequest],
    shape: LoadShape,
) -> dict:
    """The same requests at the same offsets through vLLM's OpenAI server."""
    import tempfile

    from slipstream.service.bench.http_load import run_http
    from slipstream.service.bench.offline import resolve_model_dir
    from slipstream.service.bench.peers import SERVED_PEERS
    from slipstream.service.bench.report import resolved_dtype

    if args.model is None:
        raise SystemExit("bench serve --vllm-python: give --model NAME (vLLM loads its folder)")
    with tempfile.TemporaryDirectory(prefix="slipstream-vllm-serve-") as tmp:
        log_path = args.vllm_log or Path(tmp, "vllm-server.log")
        started = time.monotonic()
        with SERVED_PEERS["vllm"].served(
            args.vllm_python, resolve_model_dir(args.model), model, resolved_dtype(args.dtype),
            args.threads or 2, free_port(), log_path,
        ) as base_url:  # fmt: skip
            load_s = time.monotonic() - started
            traces, wall = run_http(base_url, model, workload, shape, warmup)
    return {"target": "vllm", "load_s": load_s, **metrics(traces, workload, wall)}


@contextmanager
def _given(target: str) -> Iterator[str]:
    yield target


def run(args: argparse.Namespace) -> int:
    if args.server is None and args.model is None:
        raise SystemExit("bench serve: give --server HOST:PORT or --model NAME")
    if args.server is not None and args.protocol != "grpc" and args.http_server is None:
        raise SystemExit("bench serve --protocol http/both with --server: give --http-server")
    shape = LoadShape(args.rate, args.burstiness, args.concurrency, args.seed)
    if args.trace_overhead:
        from slipstream.service.bench.trace_overhead import tracing_comparison

        if args.model is None:
            raise SystemExit("bench serve --trace-overhead: give --model NAME")
        report = tracing_comparison(args, shape)
        _write(args, report)
        return 0
    report = _timed_runs(args, shape)
    report["ratios"] = _ratios(report)
    report["hardware"] = hardware(args.dtype)
    report["settings"] = {
        k: (str(v) if isinstance(v, Path) or (isinstance(v, float) and math.isinf(v)) else v)
        for k, v in vars(args).items()
        if k != "func"
    }
    print(_table(report))
    _write(args, report)
    return 0


def _ratios(report: dict) -> dict[str, float]:
    ratios = {}
    grpc, http, local = report.get("server"), report.get("http"), report.get("in_process")
    vllm = report.get("vllm")
    if grpc and vllm:
        ratios["vllm_over_slipstream_ttft_p50"] = vllm["ttft_ms"]["p50"] / grpc["ttft_ms"]["p50"]
        ratios["vllm_over_slipstream_e2e_p95"] = vllm["e2e_ms"]["p95"] / grpc["e2e_ms"]["p95"]
        ratio = grpc["output_tokens_per_s"] / vllm["output_tokens_per_s"]
        ratios["slipstream_vs_vllm_output_tokens_per_s"] = ratio
    if grpc and local:
        ratio = grpc["output_tokens_per_s"] / local["output_tokens_per_s"]
        ratios["server_vs_in_process_output_tokens_per_s"] = ratio
    if grpc and http:
        ratio = http["output_tokens_per_s"] / grpc["output_tokens_per_s"]
        ratios["http_vs_grpc_output_tokens_per_s"] = ratio
        ratios["http_minus_grpc_ttft_p50_ms"] = http["ttft_ms"]["p50"] - grpc["ttft_ms"]["p50"]
    return ratios


def _write(args: argparse.Namespace, report: dict) -> None:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


def environ_without_otel() -> dict[str, str]:
    """This process's environment minus ``OTEL_*``: a server that traces nothing."""
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def _table(report: dict) -> str:
    lines = [
        f"{'':12}{'tok/s':>9}{'req/s':>8}{'TTFT p50/p99 ms':>18}{'ITL p50/p99 ms':>17}"
        f"{'TPOT p50 ms':>12}{'E2E p50/p99 ms':>17}  counts ok"
    ]
    for name in ("server", "http", "vllm", "in_process"):
        m = report.get(name)
        if m is None:
            continue
        lines.append(
            f"{name:12}{m['output_tokens_per_s']:9.1f}{m['request_throughput']:8.2f}"
            f"{m['ttft_ms']['p50']:9.1f}/{m['ttft_ms']['p99']:<8.1f}"
            f"{m['itl_ms']['p50']:8.1f}/{m['itl_ms']['p99']:<8.1f}"
            f"{m['tpot_ms']['p50']:12.1f}"
            f"{m['e2e_ms']['p50']:8.0f}/{m['e2e_ms']['p99']:<8.0f}  {m['token_counts_match']}"
        )
    ratios = report.get("ratios", {})
    if "server_vs_in_process_output_tokens_per_s" in ratios:
        ratio = ratios["server_vs_in_process_output_tokens_per_s"]
        lines.append(f"server / in-process output tokens/s: {ratio:.1%}")
    if "http_vs_grpc_output_tokens_per_s" in ratios:
        ratio = ratios["http_vs_grpc_output_tokens_per_s"]
        extra = ratios["http_minus_grpc_ttft_p50_ms"]
        lines.append(
            f"http / grpc output tokens/s: {ratio:.1%}; TTFT p50 http - grpc: {extra:+.1f} ms"
        )
    return "\n".join(lines)

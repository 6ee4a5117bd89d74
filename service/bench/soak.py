"""``slipstream bench soak --minutes N``: a long mixed load against a spawned
``slipstream serve``, to show that nothing accumulates.

The mix, offered at ``--load`` (0.8) of its capacity measured first:

    plain       submits on a few long-lived streams, read at once
    mixed       a stream of its own with 1-6 requests (max 1-128 tokens, half
                with ignore_eos, classes 0-3, 30 % with a timeout of 0.05,
                0.3, 1 or 3 s, 20 % cancelled within 0.5 s): issue 31's mix
    cancel      cancelled after a random delay
    deadline    a timeout of 30-200 ms, too short for its 400 tokens on most
                machines (expires, DEADLINE_EXCEEDED, or refused at once as
                infeasible; one finished within it met its deadline)
    disconnect  a stream of its own (200-600 tokens), dropped mid-generation
    slow        a stream of its own, read slowly (a pause of several seconds)
    stalled     every ``--stall-every`` s, a client process that submits and is
                then stopped (SIGSTOP: it reads nothing, not even at the TCP
                level); the server pauses its requests, then cancels them
                SLOW_READER after its grace; the client is resumed to read them

Every ``--interval`` seconds it records the server's RSS, its used KV blocks
(device and host), the p99 latency of the plain requests finished in the
interval, and the errors nobody asked for (a finish or status that is not
what the kind provokes). At the end it waits for the server to go idle and
reports the blocks still used (leaked), RSS growth after the warm-up (the
first fifth of the run) and the error count; JSON with ``--json``, a PNG
with ``--plot``.

The capacity is the mix's own (``soak_capacity``): the same kinds, weights
and clients (not the stopped readers) with ``--calibrate-in-flight``
arrivals always in flight for ``--calibrate-s`` seconds, before the run and
again after it. The run's Poisson arrivals come at ``--load`` times the
arrivals per second measured before; the report's ``calibration`` holds
both measurements (arrivals, asked and read tokens per second, the
machine's load average), the summary the shares of them the run offered
(asked tokens) and was served (read tokens).

Every submit refused (REJECTED) is counted by reject reason and by minute
of the run (``refusals_by_reason``, ``refusals_per_minute``); refusals for
capacity are ``queue_full`` and ``overloaded``. A run offered under half the
capacity (the lower measured) that refuses anything for capacity fails
(exit code 1), as do leaked blocks, errors nobody asked for (in the run or
in the calibration) and a mixed request refused DEADLINE_INFEASIBLE whose
timeout was at least 1.5x what it needs alone (``infeasible_unjustified``;
the isolated times are measured on the idle server first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slipstream.service.bench.report import hardware
from slipstream.service.bench.serve_process import spawned_serve
from slipstream.service.bench.soak_capacity import MixCapacity, measure_mix_capacity
from slipstream.service.bench.soak_clients import (
    CAPACITY_REASONS,
    Clients,
    Interval,
    Load,
    draw_kind,
    stalled_client,
)
from slipstream.service.cli.arg_types import positive_finite_float, positive_float, positive_int
from slipstream.service.engine.config import DTYPE_CHOICES

# ---------------------------------------------------------------- server


@contextmanager
def spawned(args: argparse.Namespace) -> Iterator[tuple[int, str]]:
    """``slipstream serve`` (pid, host:port), stopped with SIGTERM at the end."""
    # The server's defaults (its cost model calibrated at start-up, as a user's
    # is), but no HTTP front: its fixed port would keep two soaks from running.
    flags = ["--model", args.model, "--dtype", args.dtype, "--http-port", "0"]
    flags += ["--slow-reader-grace", str(args.slow_reader_grace)]
    flags += ["--max-outbox-events", str(args.max_outbox_events)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    with spawned_serve(flags) as server:
        yield server


# ---------------------------------------------------------------- driving


async def _sample(stub: object, pid: int) -> dict[str, float]:
    import psutil

    from slipstream.v1 import inference_pb2 as pb

    stats = await stub.GetServerStats(pb.GetServerStatsRequest())  # type: ignore[attr-defined]
    return {
        "rss_mb": psutil.Process(pid).memory_info().rss / 2**20,
        "device_blocks_used": stats.kv_blocks_used.device,
        "host_blocks_used": stats.kv_blocks_used.host,
        "running": stats.running,
        "waiting": stats.waiting,
        "machine_load_average": os.getloadavg()[0],  # other work on a shared machine
    }


# Output lengths whose isolated service time is measured (seconds, medians of 3).
ISOLATED_TOKENS = (1, 128)


async def _isolated_seconds(stub: object, vocab: int) -> dict[int, float]:
    """Seconds one request of a 32-token prompt takes alone, by output length."""
    from slipstream.v1 import inference_pb2 as pb

    load = Load(random.Random(2), vocab)
    seconds: dict[int, float] = {}
    for max_tokens in ISOLATED_TOKENS:
        times = []
        for i in range(3):
            submit = pb.Submit(
                request_id=f"alone-{max_tokens}-{i}",
                token_ids=pb.TokenIds(ids=[load.rng.randrange(5, vocab) for _ in range(32)]),
                stopping=pb.StoppingCriteria(max_new_tokens=max_tokens, ignore_eos=True),
            )
            started = time.monotonic()
            async for _ in stub.Generate(iter([pb.GenerateRequest(submit=submit)])):  # type: ignore[attr-defined]
                pass
            times.append(time.monotonic() - started)
        seconds[max_tokens] = statistics.median(times)
    return seconds


# An infeasible refusal is unjustified when the timeout was at least this many
# times the request's isolated service time. The isolated times are measured
# on the idle server before the mix; during the mix the load generator shares
# the machine's cores, so a timeout just above them may really be too short.
UNJUSTIFIED_MARGIN = 1.5


def _infeasible_summary(
    infeasible: list[tuple[float, int]], before: dict[int, float], after: dict[int, float]
) -> dict[str, object]:
    """Mixed requests refused DEADLINE_INFEASIBLE at the door (running alone
    they would miss: not those given up later in the queue) against their isolated service
    time (interpolated between the measured lengths for their max_new_tokens;
    the slower of the measurements before and after the mix, so a machine
    that slowed down meanwhile is not held against the server):
    ``unjustified`` had a timeout of at least ``UNJUSTIFIED_MARGIN`` times it
    (a server with room should have served them), ``borderline`` one between
    1x and that."""
    alone = {n: max(before[n], after[n]) for n in before}
    (short, t_short), (long, t_long) = sorted(alone.items())
    per_token = (t_long - t_short) / (long - short)

    def isolated(max_tokens: int) -> float:
        return t_short + (max_tokens - short) * per_token

    def sample(timeout: float, max_tokens: int) -> dict[str, float]:
        return {
            "timeout_s": timeout,
            "max_new_tokens": max_tokens,
            "isolated_s": isolated(max_tokens),
        }

    ratios = [(t / isolated(n), t, n) for t, n in infeasible]
    unjustified = [sample(t, n) for r, t, n in ratios if r >= UNJUSTIFIED_MARGIN]
    borderline = [sample(t, n) for r, t, n in ratios if 1.0 <= r < UNJUSTIFIED_MARGIN]
    return {
        "isolated_seconds": {str(n): s for n, s in sorted(before.items())},
        "isolated_seconds_after": {str(n): s for n, s in sorted(after.items())},
        "infeasible_refusals": len(infeasible),
        "infeasible_unjustified": len(unjustified),
        "infeasible_borderline": len(borderline),
        "infeasible_unjustified_samples": unjustified[:10],
        "infeasible_borderline_samples": borderline[:10],
    }


async def _soak(args: argparse.Namespace, pid: int, target: str) -> dict[str, object]:
    import grpc

    from slipstream.v1 import inference_pb2 as pb
    from slipstream.v1 import inference_pb2_grpc as pb_grpc

    async with (
        grpc.aio.insecure_channel(target) as channel,
        grpc.aio.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)]) as slow_channel,
    ):
        stub = pb_grpc.InferenceStub(channel)
        vocab = (await stub.GetModelInfo(pb.GetModelInfoRequest())).vocab_size
        alone = await _isolated_seconds(stub, vocab)
        capacity, trial = await _measure_capacity(args, channel, slow_channel, vocab, seed=1)
        rate = capacity.rate_at(args.load)
        print(
            f"soak: the mix's capacity {capacity.arrivals_per_s:.1f} arrivals/s "
            f"({capacity.asked_tokens_per_s:.0f} tok/s asked, "
            f"{capacity.read_tokens_per_s:.0f} read) with {capacity.in_flight} in flight "
            f"over {capacity.seconds:.0f} s (machine load average "
            f"{capacity.load_average:.1f}, {os.cpu_count()} CPUs); "
            f"offering {args.load:g} of it: {rate:.1f} arrivals/s",
            flush=True,
        )
        load = Load(random.Random(args.seed), vocab, args.slow_reader_grace)
        clients = Clients(channel, slow_channel)
        samples: list[dict[str, object]] = []
        tasks: set[asyncio.Task[None]] = set()
        started = time.monotonic()
        end = started + args.minutes * 60
        next_sample = started
        index = 0
        next_stall = started + args.stall_every / 2
        while time.monotonic() < end:
            now = time.monotonic()
            if args.stall_every > 0 and now >= next_stall:
                task = asyncio.ensure_future(stalled_client(load, target, index))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_stall += args.stall_every
            if now >= next_sample:
                sample = await _sample(stub, pid)
                interval, load.interval = load.interval, Interval()
                lat = sorted(interval.latencies_s)
                sample.update(
                    t_s=round(now - started, 1),
                    finished=interval.finished,
                    errors=len(interval.errors),
                    error_samples=interval.errors[:3],
                    p99_latency_s=statistics.quantiles(lat, n=100)[98] if len(lat) >= 2 else None,
                    in_flight=len(tasks),
                )
                samples.append(sample)
                next_sample += args.interval
            kind = draw_kind(load.rng)
            task = asyncio.ensure_future(clients.arrival(load, kind, index))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
            await asyncio.sleep(load.rng.expovariate(rate))
        arrivals_s = time.monotonic() - started
        # Let everything started finish, then the server must be idle.
        if tasks:
            await asyncio.wait(tasks, timeout=args.slow_reader_grace + 400)
        clients.close()
        tail = load.interval
        output_tokens = load.output_tokens + clients.output_tokens
        idle = await _wait_idle(stub)
        final = await _sample(stub, pid)
        alone_after = await _isolated_seconds(stub, vocab)
        # Again on the idle server: a machine whose other work slowed it
        # during the run shows here, and is not held against the server.
        capacity_after, trial_after = await _measure_capacity(
            args, channel, slow_channel, vocab, seed=2
        )
    errors = sum(int(s["errors"]) for s in samples) + len(tail.errors)  # type: ignore[call-overload]
    warm = [s for s in samples if float(s["t_s"]) >= args.minutes * 60 / 5]  # type: ignore[arg-type]
    warm_rss = float(warm[0]["rss_mb"]) if warm else float(samples[0]["rss_mb"])  # type: ignore[arg-type]
    capacity_refusals = sum(load.refusals.get(r, 0) for r in CAPACITY_REASONS)
    # Per second of arrivals, as the calibration counts them: the drain
    # after the last (stopped readers wait 40 s) adds time but no work.
    offered_tokens_per_s = load.offered_tokens / arrivals_s
    read_tokens_per_s = output_tokens / arrivals_s
    return {
        "calibration": _calibration(args, rate, (capacity, trial), (capacity_after, trial_after)),
        "requests": index,
        "samples": samples,
        "final": {**final, "idle": idle},
        "summary": {
            "leaked_device_blocks": final["device_blocks_used"],
            "leaked_host_blocks": final["host_blocks_used"],
            "rss_after_warmup_mb": warm_rss,
            "rss_final_mb": final["rss_mb"],
            "rss_growth_after_warmup": final["rss_mb"] / warm_rss - 1.0,
            "errors_not_asked_for": errors,
            "calibration_errors": len(trial.interval.errors) + len(trial_after.interval.errors),
            # Offered against the mix's capacity in the same measures: the
            # arrivals, every submit's max_new_tokens, and what the readers
            # that read their tokens saw generated.
            "offered_arrivals_per_s": index / arrivals_s,
            "offered_tokens_per_s": offered_tokens_per_s,
            "read_tokens_per_s": read_tokens_per_s,
            "offered_share_of_capacity": offered_tokens_per_s / capacity.asked_tokens_per_s,
            "offered_share_of_capacity_after": offered_tokens_per_s
            / capacity_after.asked_tokens_per_s,
            "read_share_of_capacity": read_tokens_per_s / capacity.read_tokens_per_s,
            "refusals_by_reason": dict(sorted(load.refusals.items())),
            "refusals_per_minute": {
                str(m): dict(sorted(r.items())) for m, r in sorted(load.refusal_minutes.items())
            },
            "capacity_refusals": capacity_refusals,
            "capacity_refusal_samples": load.refusal_samples,
            **_infeasible_summary(load.infeasible, alone, alone_after),
            "infeasible_messages_first_and_last": load.infeasible_messages,
            # Mixed requests that queued and were then given up as unable to
            # make their deadline at the load they met (also DEADLINE_INFEASIBLE).
            "infeasible_abandoned_in_queue": load.abandoned_in_queue,
            "outcomes": dict(sorted(load.outcomes.items())),
            "error_samples": [e for s in samples for e in s["error_samples"]][:10]  # type: ignore[attr-defined]
            + tail.errors[:10],
        },
    }


async def _measure_capacity(
    args: argparse.Namespace, channel: object, slow_channel: object, vocab: int, seed: int
) -> tuple[MixCapacity, Load]:
    """The mix's capacity (``soak_capacity``), and the Load its requests
    were recorded in."""
    trial = Load(random.Random(seed), vocab, args.slow_reader_grace)
    clients = Clients(channel, slow_channel)
    capacity = await measure_mix_capacity(
        clients, trial, args.calibrate_in_flight, args.calibrate_s
    )
    clients.close()
    return capacity, trial


def _calibration(
    args: argparse.Namespace,
    rate: float,
    before: tuple[MixCapacity, Load],
    after: tuple[MixCapacity, Load],
) -> dict[str, object]:
    """How the offered load was chosen: the mix's capacity measured before
    the run (the rate is ``load`` of it) and again after, each with what its
    own requests met (a refusal there, with at most ``in_flight`` arrivals
    in flight, is a finding too)."""

    def measured(capacity: MixCapacity, trial: Load) -> dict[str, object]:
        return {
            **capacity.describe(),
            "refusals_by_reason": dict(sorted(trial.refusals.items())),
            "outcomes": dict(sorted(trial.outcomes.items())),
            "error_samples": trial.interval.errors[:10],
        }

    return {
        "method": "the soak's mix (no stopped readers) in a closed loop",
        "load": args.load,
        "offered_arrivals_per_s": rate,
        "cpu_count": os.cpu_count(),
        "server_threads": args.threads,
        "capacity": measured(*before),
        "capacity_after": measured(*after),
    }


async def _wait_idle(stub: object, timeout_s: float = 60.0) -> bool:
    from slipstream.v1 import inference_pb2 as pb

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        stats = await stub.GetServerStats(pb.GetServerStatsRequest())  # type: ignore[attr-defined]
        if (stats.running, stats.waiting, stats.swapped) == (0, 0, 0):
            return True
        await asyncio.sleep(0.2)
    return False


# ---------------------------------------------------------------- report


def plot(report: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    assert isinstance(samples, list)
    t = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(t, [s["rss_mb"] for s in samples])
    axes[0].set_ylabel("server RSS (MB)")
    axes[1].plot(t, [s["device_blocks_used"] for s in samples], label="device")
    axes[1].plot(t, [s["host_blocks_used"] for s in samples], label="host")
    axes[1].set_ylabel("KV blocks used")
    axes[1].legend()
    axes[2].plot(t, [s["p99_latency_s"] for s in samples])
    axes[2].set_ylabel("p99 latency, plain (s)")
    axes[3].bar(t, [s["errors"] for s in samples], width=0.05, color="tab:red")
    axes[3].set_ylabel("errors not asked for")
    axes[3].set_xlabel("minutes")
    fig.suptitle(f"bench soak: {report['settings']['model']}, {len(t)} samples")  # type: ignore[index]
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = bench_subparsers.add_parser("soak", help="long mixed load: does anything accumulate?")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--minutes", type=positive_float, default=30.0)
    parser.add_argument(
        "--load",
        type=positive_float,
        default=0.8,
        help="fraction of the mix's measured capacity to offer",
    )
    parser.add_argument(
        "--calibrate-s",
        type=positive_finite_float,
        default=15.0,
        help="seconds of the capacity measurement (the mix in a closed loop)",
    )
    parser.add_argument(
        "--calibrate-in-flight",
        type=positive_int,
        default=32,
        help="arrivals of the mix in flight while the capacity is measured",
    )
    parser.add_argument(
        "--interval", type=positive_float, default=5.0, help="seconds between samples"
    )
    parser.add_argument(
        "--slow-reader-grace", type=positive_float, default=5.0, help="the server's"
    )
    parser.add_argument(
        "--max-outbox-events",
        type=positive_int,
        default=64,
        help="the server's (small, so the stopped readers reach it soon)",
    )
    parser.add_argument(
        "--stall-every", type=float, default=20.0, help="seconds between stopped readers (0: none)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    machine = hardware(args.dtype)
    cpu = machine["cpu"]
    assert isinstance(cpu, dict)
    print(
        f"soak: {args.model} ({machine['dtype']}) on {cpu['model']}, {os.cpu_count()} CPUs",
        flush=True,
    )
    with spawned(args) as (pid, target):
        report = asyncio.run(_soak(args, pid, target))
    report["hardware"] = machine
    report["settings"] = {k: str(v) for k, v in vars(args).items() if k != "func"}
    print(json.dumps(report["summary"], indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot is not None:
        plot(report, args.plot)
    summary = report["summary"]
    assert isinstance(summary, dict)
    leaked = summary["leaked_device_blocks"] or summary["leaked_host_blocks"]
    errors = summary["errors_not_asked_for"] or summary["calibration_errors"]
    failed = leaked or errors or summary["infeasible_unjustified"]
    return 1 if failed or refused_with_room(summary) else 0


def refused_with_room(summary: dict[str, object]) -> bool:
    """Something was refused for capacity while the load offered was under
    half the mix's capacity (the lower of the two measured, before and
    after the run): a refusal that protected nobody."""
    before = summary["offered_share_of_capacity"]
    after = summary["offered_share_of_capacity_after"]
    assert isinstance(before, float) and isinstance(after, float)
    return max(before, after) < 0.5 and bool(summary["capacity_refusals"])

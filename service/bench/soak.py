"""``slipstream bench soak --minutes N``: a long mixed load against a spawned
``slipstream serve``, to show that nothing accumulates.

The mix, at ~80% of the capacity measured first (``--load``):

    plain       submits on a few long-lived streams, read at once
    mixed       a stream of its own with 1-6 requests (max 1-128 tokens, half
                with ignore_eos, classes 0-3, 30 % with a timeout of 0.05,
                0.3, 1 or 3 s, 20 % cancelled within 0.5 s): issue 31's mix
    cancel      cancelled after a random delay
    deadline    a timeout too short to finish (expires, DEADLINE_EXCEEDED)
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

Every submit refused (REJECTED) is counted by reject reason and by minute
of the run (``refusals_by_reason``, ``refusals_per_minute``); refusals for
capacity are ``queue_full`` and ``overloaded``. The capacity measurement
also gives generated tokens per second; the load offered is bounded above
by the ``max_new_tokens`` of every submit per second. A run offered under
half the capacity (by that bound) that refuses anything for capacity fails
(exit code 1), as do leaked blocks, errors nobody asked for and a mixed
request refused DEADLINE_INFEASIBLE whose timeout was at least 1.5x what it
needs alone (``infeasible_unjustified``; the isolated times are measured on
the idle server first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slipstream.service.bench.report import hardware
from slipstream.service.bench.serve_process import spawned_serve
from slipstream.service.bench.soak_clients import (
    CAPACITY_REASONS,
    Interval,
    Load,
    SharedStream,
    mixed_stream,
    own_stream,
    stalled_client,
)
from slipstream.service.cli.arg_types import positive_float, positive_int
from slipstream.service.engine.config import DTYPE_CHOICES

KINDS = ("plain", "mixed", "cancel", "deadline", "disconnect", "slow")
WEIGHTS = (0.5, 0.2, 0.075, 0.075, 0.075, 0.075)


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


async def _capacity(target: str, vocab: int, seconds: float) -> tuple[float, float]:
    """Plain requests and generated tokens per second with 32 always in
    flight (closed loop)."""
    import grpc

    from slipstream.v1 import inference_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        shared = SharedStream(stub)
        load = Load(random.Random(1), vocab)
        end = time.monotonic() + seconds
        count = 0

        async def worker(w: int) -> None:
            nonlocal count
            while time.monotonic() < end:
                await shared.run(load, "plain", w * 100_000 + count)
                count += 1

        await asyncio.gather(*(worker(w) for w in range(32)))
        shared.call.cancel()
    return count / seconds, shared.output_tokens / seconds


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
        capacity, capacity_tokens = await _capacity(target, vocab, args.calibrate_s)
        rate = args.load * capacity
        print(
            f"soak: capacity {capacity:.1f} req/s, {capacity_tokens:.0f} tok/s; "
            f"offering {rate:.1f} req/s",
            flush=True,
        )
        load = Load(random.Random(args.seed), vocab, args.slow_reader_grace)
        streams = [SharedStream(stub) for _ in range(4)]
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
            kind = load.rng.choices(KINDS, WEIGHTS)[0]
            if kind == "mixed":
                coro = mixed_stream(load, pb_grpc.InferenceStub(channel), index)
            elif kind in ("disconnect", "slow"):
                own = slow_channel if kind == "slow" else channel
                coro = own_stream(load, pb_grpc.InferenceStub(own), kind, index)
            else:
                coro = streams[index % len(streams)].run(load, kind, index)
            task = asyncio.ensure_future(coro)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
            await asyncio.sleep(load.rng.expovariate(rate))
        # Let everything started finish, then the server must be idle.
        if tasks:
            await asyncio.wait(tasks, timeout=args.slow_reader_grace + 400)
        for stream in streams:
            stream.call.cancel()
        tail = load.interval
        mix_s = time.monotonic() - started
        output_tokens = load.output_tokens + sum(s.output_tokens for s in streams)
        idle = await _wait_idle(stub)
        final = await _sample(stub, pid)
        alone_after = await _isolated_seconds(stub, vocab)
    errors = sum(int(s["errors"]) for s in samples) + len(tail.errors)  # type: ignore[call-overload]
    warm = [s for s in samples if float(s["t_s"]) >= args.minutes * 60 / 5]  # type: ignore[arg-type]
    warm_rss = float(warm[0]["rss_mb"]) if warm else float(samples[0]["rss_mb"])  # type: ignore[arg-type]
    capacity_refusals = sum(load.refusals.get(r, 0) for r in CAPACITY_REASONS)
    offered_tokens_per_s = load.offered_tokens / mix_s
    return {
        "capacity_req_per_s": capacity,
        "capacity_tokens_per_s": capacity_tokens,
        "offered_req_per_s": rate,
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
            # At most what was offered (every submit's max_new_tokens), and
            # what the readers that read their tokens saw generated.
            "offered_tokens_per_s_at_most": offered_tokens_per_s,
            "read_tokens_per_s": output_tokens / mix_s,
            "offered_share_of_capacity_at_most": offered_tokens_per_s / capacity_tokens,
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
        "--load", type=positive_float, default=0.8, help="fraction of measured capacity"
    )
    parser.add_argument(
        "--calibrate-s", type=positive_float, default=15.0, help="capacity measurement"
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
    with spawned(args) as (pid, target):
        report = asyncio.run(_soak(args, pid, target))
    report["hardware"] = hardware(args.dtype)
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
    failed = leaked or summary["errors_not_asked_for"] or summary["infeasible_unjustified"]
    return 1 if failed or refused_with_room(summary) else 0


def refused_with_room(summary: dict[str, object]) -> bool:
    """Something was refused for capacity while the load offered was under
    half the measured capacity (by its upper bound): a refusal that
    protected nobody."""
    share = summary["offered_share_of_capacity_at_most"]
    assert isinstance(share, float)
    return share < 0.5 and bool(summary["capacity_refusals"])

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
(exit code 1), as do leaked blocks and errors nobody asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.service.bench.report import hardware
from slipstream.service.engine.config import DTYPE_CHOICES

KINDS = ("plain", "mixed", "cancel", "deadline", "disconnect", "slow")
WEIGHTS = (0.5, 0.2, 0.075, 0.075, 0.075, 0.075)
# Refused for capacity (the reject reasons' lower-case names).
CAPACITY_REASONS = ("queue_full", "overloaded")


@dataclass(slots=True)
class Interval:
    """What happened between two samples."""

    finished: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Load:
    rng: random.Random
    vocab: int
    grace_s: float = 10.0  # the server's --slow-reader-grace
    interval: Interval = field(default_factory=Interval)
    outcomes: dict[str, int] = field(default_factory=dict)  # "kind: outcome" -> count
    started: float = field(default_factory=time.monotonic)
    # Refusals by reject reason, and by minute of the run then reason.
    refusals: dict[str, int] = field(default_factory=dict)
    refusal_minutes: dict[int, dict[str, int]] = field(default_factory=dict)
    refusal_samples: list[str] = field(default_factory=list)
    offered_tokens: int = 0  # max_new_tokens of every submit
    output_tokens: int = 0  # generated tokens seen by the readers that read them

    def refused(self, finished: object) -> None:
        """Counts a REJECTED finish by its reject reason."""
        from slipstream.v1 import inference_pb2 as pb

        code = finished.reject_reason  # type: ignore[attr-defined]
        reason = pb.RejectReason.Name(code).removeprefix("REJECT_REASON_").lower()
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        minute = self.refusal_minutes.setdefault(int((time.monotonic() - self.started) // 60), {})
        minute[reason] = minute.get(reason, 0) + 1
        if reason in CAPACITY_REASONS and len(self.refusal_samples) < 10:
            self.refusal_samples.append(finished.message)  # type: ignore[attr-defined]

    def prompt(self) -> list[int]:
        return [self.rng.randrange(5, self.vocab) for _ in range(self.rng.randint(8, 48))]

    def record(
        self, kind: str, error: str | None, latency_s: float | None = None, outcome: str = ""
    ) -> None:
        key = f"{kind}: {outcome or error or 'ok'}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        self.interval.finished += 1
        self.interval.by_kind[kind] = self.interval.by_kind.get(kind, 0) + 1
        if error:
            self.interval.errors.append(f"{kind}: {error}")
        if latency_s is not None:
            self.interval.latencies_s.append(latency_s)


# ---------------------------------------------------------------- server


@contextmanager
def spawned(args: argparse.Namespace) -> Iterator[tuple[int, str]]:
    """``slipstream serve`` (pid, host:port), stopped with SIGTERM at the end."""
    command = [sys.executable, "-m", "slipstream.service.cli", "serve", "--port", "0"]
    command += ["--model", args.model, "--dtype", args.dtype, "--no-calibrate"]
    command += ["--slow-reader-grace", str(args.slow_reader_grace)]
    command += ["--max-outbox-events", str(args.max_outbox_events)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(r"listening on (\S+:\d+)", line)
            if match:
                break
        else:
            raise RuntimeError(f"slipstream serve exited with {proc.wait()}")
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield proc.pid, match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- one request of each kind


def _submit(
    pb: object,
    request_id: str,
    ids: list[int],
    max_tokens: int,
    ignore_eos: bool = True,
    load: Load | None = None,
    **extra: object,
) -> object:
    if load is not None:
        load.offered_tokens += max_tokens
    return pb.GenerateRequest(  # type: ignore[attr-defined]
        submit=pb.Submit(  # type: ignore[attr-defined]
            request_id=request_id,
            token_ids=pb.TokenIds(ids=ids),  # type: ignore[attr-defined]
            stopping=pb.StoppingCriteria(max_new_tokens=max_tokens, ignore_eos=ignore_eos),  # type: ignore[attr-defined]
            **extra,
        )
    )


async def _mixed_stream(load: Load, stub: object, index: int) -> None:
    """mixed: issue 31's stream of 1-6 requests on a stream of its own."""
    import grpc
    from google.protobuf.duration_pb2 import Duration

    from slipstream.v1 import inference_pb2 as pb

    rng = load.rng
    num_requests = rng.randint(1, 6)
    cancels: list[tuple[float, str]] = []
    call = stub.Generate()  # type: ignore[attr-defined]
    error = None
    reasons: list[str] = []
    try:
        for i in range(num_requests):
            request_id = f"mixed-{index}-{i}"
            extra: dict[str, object] = {"priority": rng.randint(0, 3)}
            if rng.random() < 0.3:
                timeout = rng.choice((0.05, 0.3, 1.0, 3.0))
                extra["timeout"] = Duration(seconds=int(timeout), nanos=int(timeout % 1 * 1e9))
            max_tokens = rng.randint(1, 128)
            ignore_eos = rng.random() < 0.5
            await call.write(
                _submit(pb, request_id, load.prompt(), max_tokens, ignore_eos, load, **extra)
            )
            if rng.random() < 0.2:
                cancels.append((rng.uniform(0.0, 0.5), request_id))
        for delay, request_id in sorted(cancels):
            await asyncio.sleep(delay)
            await call.write(pb.GenerateRequest(cancel=pb.Cancel(request_id=request_id)))
        await call.done_writing()
        while (response := await call.read()) is not grpc.aio.EOF:
            event = response.WhichOneof("event")
            if event == "chunk":
                load.output_tokens += len(response.chunk.token_ids)
            elif event == "finished":
                finished = response.finished
                reasons.append(pb.FinishReason.Name(finished.reason).removeprefix("FINISH_REASON_"))
                if finished.reason == pb.FINISH_REASON_REJECTED:
                    load.refused(finished)
        if len(reasons) != num_requests or "ERROR" in reasons:
            error = f"finished {'+'.join(sorted(set(reasons)))}"
    except Exception as exc:  # an RpcError nobody asked for
        error = f"{type(exc).__name__} {getattr(exc, 'code', lambda: None)()}"
    finally:
        load.record("mixed", error, outcome="+".join(sorted(set(reasons))))


async def _own_stream(load: Load, stub: object, kind: str, index: int) -> None:
    """disconnect / slow: a stream of their own."""
    import grpc

    from slipstream.v1 import inference_pb2 as pb

    rng = load.rng
    num_requests = 1
    max_tokens = rng.randint(200, 600) if kind == "disconnect" else 64
    call = stub.Generate()  # type: ignore[attr-defined]
    error = None
    outcome = ""
    try:
        for i in range(num_requests):
            prompt = load.prompt()
            await call.write(_submit(pb, f"{kind}-{index}-{i}", prompt, max_tokens, load=load))
        await call.done_writing()
        if kind == "disconnect":
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            call.cancel()
            return
        # slow: a few events read slowly, then none at all until the server gives up.
        for _ in range(rng.randint(1, 5)):
            await call.read()
            await asyncio.sleep(0.2)
        await asyncio.sleep(load.grace_s + 3.0)
        reasons = []
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.WhichOneof("event") == "finished":
                reasons.append(response.finished.reason)
        names = sorted({pb.FinishReason.Name(r).removeprefix("FINISH_REASON_") for r in reasons})
        outcome = "+".join(names)
        if len(reasons) != num_requests or not set(names) <= {"SLOW_READER", "MAX_TOKENS"}:
            error = f"finished {outcome}"
    except Exception as exc:  # an RpcError nobody asked for
        code = getattr(exc, "code", lambda: None)()
        if not (kind == "disconnect" and code is not None and code.name == "CANCELLED"):
            error = f"{type(exc).__name__} {code}"
    finally:
        load.record(kind, error, outcome=outcome or ("cancelled" if kind == "disconnect" else ""))


class SharedStream:
    """plain / cancel / deadline requests multiplexed on one long-lived stream."""

    def __init__(self, stub: object) -> None:
        self.call = stub.Generate()  # type: ignore[attr-defined]
        self.waiters: dict[str, asyncio.Future[object]] = {}
        self.output_tokens = 0
        self.reader = asyncio.ensure_future(self._read())
        self._write_lock = asyncio.Lock()  # one write at a time on a call

    async def write(self, message: object) -> None:
        async with self._write_lock:
            await self.call.write(message)

    async def _read(self) -> None:
        async for response in self.call:
            if response.WhichOneof("event") == "chunk":
                self.output_tokens += len(response.chunk.token_ids)
            if response.WhichOneof("event") == "finished":
                future = self.waiters.pop(response.request_id, None)
                if future is not None and not future.done():
                    future.set_result(response.finished)

    async def run(self, load: Load, kind: str, index: int) -> None:
        from google.protobuf.duration_pb2 import Duration

        from slipstream.v1 import inference_pb2 as pb

        rng = load.rng
        request_id = f"{kind}-{index}"
        extra: dict[str, object] = {}
        if kind == "deadline":
            extra["timeout"] = Duration(nanos=int(rng.uniform(0.03, 0.2) * 1e9))
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.waiters[request_id] = future
        started = time.monotonic()
        max_tokens = rng.randint(16, 48) if kind == "plain" else 400
        await self.write(_submit(pb, request_id, load.prompt(), max_tokens, load=load, **extra))
        if kind == "cancel":
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            await self.write(pb.GenerateRequest(cancel=pb.Cancel(request_id=request_id)))
        try:
            finished = await asyncio.wait_for(future, timeout=300)
        except TimeoutError:
            load.record(kind, "no Finished within 300 s")
            return
        expected = {
            "plain": pb.FINISH_REASON_MAX_TOKENS,
            "cancel": pb.FINISH_REASON_CANCELLED,
            "deadline": pb.FINISH_REASON_DEADLINE_EXCEEDED,
        }[kind]
        reason = finished.reason  # type: ignore[attr-defined]
        if reason == pb.FINISH_REASON_REJECTED:
            load.refused(finished)
        outcome = pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_")
        error = None if reason == expected else f"finished {pb.FinishReason.Name(reason)}"
        if kind == "deadline" and finished.reject_reason == pb.REJECT_REASON_DEADLINE_INFEASIBLE:  # type: ignore[attr-defined]
            error = None  # refused at once as unreachable: also what was asked for
        if kind == "cancel" and reason == pb.FINISH_REASON_MAX_TOKENS:
            error = None  # finished before the cancel arrived
        latency = time.monotonic() - started if kind == "plain" else None
        load.record(kind, error, latency, outcome)


# ---------------------------------------------------------------- driving


async def _stalled_client(load: Load, target: str, index: int) -> None:
    """One stopped reader (``stalled``): a child process of this module."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "slipstream.service.bench.soak",
        target,
        f"stalled-{index}",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    error = None
    outcome = ""
    stage = "starting"
    try:
        await asyncio.wait_for(proc.stdout.readline(), timeout=60)  # "sent"
        stage = "stopped"
        proc.send_signal(signal.SIGSTOP)
        # The kernel's socket buffers and the HTTP/2 window absorb a little;
        # the server pauses the stream after that.
        # Under load its tokens come slowly: give the buffers time to fill.
        await asyncio.sleep(load.grace_s + 40.0)
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        stage = "reading"
        reasons = json.loads(await asyncio.wait_for(proc.stdout.readline(), timeout=300))
        outcome = "+".join(sorted(set(reasons)))
        if len(reasons) != STALLED_REQUESTS or not set(reasons) <= {"SLOW_READER", "MAX_TOKENS"}:
            error = f"finished {outcome}"
    except (TimeoutError, json.JSONDecodeError) as exc:
        error = f"stalled client, {stage}: {exc!r}"
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        load.record("stalled", error, outcome=outcome)


STALLED_REQUESTS = 8


def _stalled_main(target: str, tag: str) -> None:
    """The stopped reader's side: submit, say "sent", and once told to go on
    read everything and print the finish reasons as JSON."""
    import grpc

    from slipstream.v1 import inference_pb2 as pb
    from slipstream.v1 import inference_pb2_grpc as pb_grpc

    go = threading.Event()

    def requests() -> Iterator[object]:
        for i in range(STALLED_REQUESTS):
            yield _submit(pb, f"{tag}-{i}", [5, 6, 7 + i], 300)
        print("sent", flush=True)
        go.wait()

    # A small window: the kernel's buffers and HTTP/2 absorb little before the server's.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    with grpc.insecure_channel(target, options=options) as channel:
        call = pb_grpc.InferenceStub(channel).Generate(requests())
        sys.stdin.readline()
        go.set()
        reasons = [
            pb.FinishReason.Name(r.finished.reason).removeprefix("FINISH_REASON_")
            for r in call
            if r.WhichOneof("event") == "finished"
        ]
    print(json.dumps(reasons), flush=True)


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
                task = asyncio.ensure_future(_stalled_client(load, target, index))
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
                coro = _mixed_stream(load, pb_grpc.InferenceStub(channel), index)
            elif kind in ("disconnect", "slow"):
                own = slow_channel if kind == "slow" else channel
                coro = _own_stream(load, pb_grpc.InferenceStub(own), kind, index)
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
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity")
    parser.add_argument("--calibrate-s", type=float, default=15.0, help="capacity measurement")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--slow-reader-grace", type=float, default=5.0, help="the server's")
    parser.add_argument(
        "--max-outbox-events",
        type=int,
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
    return 1 if leaked or summary["errors_not_asked_for"] or refused_with_room(summary) else 0


def refused_with_room(summary: dict[str, object]) -> bool:
    """Something was refused for capacity while the load offered was under
    half the measured capacity (by its upper bound): a refusal that
    protected nobody."""
    share = summary["offered_share_of_capacity_at_most"]
    assert isinstance(share, float)
    return share < 0.5 and bool(summary["capacity_refusals"])


if __name__ == "__main__":
    _stalled_main(sys.argv[1], sys.argv[2])

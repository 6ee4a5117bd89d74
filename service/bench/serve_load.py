"""The load ``slipstream bench serve`` sends and what it measures: a
workload's send times (Poisson/Gamma arrivals under a concurrency cap), one
trace per request, sent over gRPC (``run_remote``) or straight into an
in-process engine (``run_local``), and the latency and throughput metrics
of the traces."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from slipstream.service.bench.workload import WorkloadRequest


@dataclass(slots=True)
class Trace:
    """When one request was sent and when each of its chunks arrived."""

    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    finished: float = 0.0
    finish_reason: str = ""


@dataclass(frozen=True, slots=True)
class LoadShape:
    rate: float  # requests per second; inf = all at once
    burstiness: float  # Gamma shape; 1.0 = Poisson
    concurrency: int | None
    seed: int


def arrival_offsets(num_requests: int, shape: LoadShape) -> list[float]:
    """Send times from t0: Gamma inter-arrivals with mean 1/rate."""
    if math.isinf(shape.rate):
        return [0.0] * num_requests
    rng = random.Random(shape.seed + 1)
    scale = 1.0 / (shape.rate * shape.burstiness)
    t, offsets = 0.0, []
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.gammavariate(shape.burstiness, scale)
    return offsets


async def run_paced(
    workload: Sequence[WorkloadRequest],
    shape: LoadShape,
    send: Callable[[int, Trace], Awaitable[None]],
) -> tuple[list[Trace], float]:
    """Sends request ``i`` with ``send(i, its trace)`` at its arrival offset,
    at most ``shape.concurrency`` at once; the traces and the wall seconds."""
    limit = asyncio.Semaphore(shape.concurrency or len(workload) or 1)
    traces = [Trace() for _ in workload]
    t0 = time.perf_counter()

    async def one(i: int, offset: float) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        async with limit:
            await send(i, traces[i])

    offsets = arrival_offsets(len(workload), shape)
    await asyncio.gather(*(one(i, off) for i, off in enumerate(offsets)))
    return traces, time.perf_counter() - t0


# ---------------------------------------------------------------- metrics


def _percentiles(values_s: Sequence[float]) -> dict[str, float]:
    if not values_s:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0}
    ms = np.asarray(values_s) * 1000
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p95": float(np.percentile(ms, 95)),
        "p99": float(np.percentile(ms, 99)),
    }


def metrics(traces: Sequence[Trace], workload: Sequence[WorkloadRequest], wall_s: float) -> dict:
    ttfts = [t.chunk_times[0] - t.sent for t in traces if t.chunk_times]
    itls = [b - a for t in traces for a, b in zip(t.chunk_times, t.chunk_times[1:], strict=False)]
    tpots = [
        (t.finished - t.chunk_times[0]) / (t.num_tokens - 1)
        for t in traces
        if t.num_tokens > 1 and t.chunk_times
    ]
    num_output = sum(t.num_tokens for t in traces)
    num_prompt = sum(len(r.prompt_token_ids) for r in workload)
    return {
        "num_requests": len(traces),
        "num_completed": sum(t.finish_reason == "max_tokens" for t in traces),
        "num_output_tokens": num_output,
        "wall_s": wall_s,
        "request_throughput": len(traces) / wall_s,
        "output_tokens_per_s": num_output / wall_s,
        "total_tokens_per_s": (num_output + num_prompt) / wall_s,
        "ttft_ms": _percentiles(ttfts),
        "tpot_ms": _percentiles(tpots),
        "itl_ms": _percentiles(itls),
        "e2e_ms": _percentiles([t.finished - t.sent for t in traces]),
        "token_counts_match": [t.num_tokens for t in traces] == [r.max_tokens for r in workload],
    }


# ---------------------------------------------------------------- over gRPC


async def _run_remote(
    target: str,
    workload: Sequence[WorkloadRequest],
    shape: LoadShape,
    num_streams: int,
    per_request: bool = False,
) -> tuple[list[Trace], float]:
    from slipstream.clients import AsyncClient

    async with AsyncClient(target) as client:
        streams = [client.stream() for _ in range(num_streams)]

        async def send(i: int, trace: Trace) -> None:
            trace.sent = time.perf_counter()
            prompt, max_tokens = workload[i].prompt_token_ids, workload[i].max_tokens
            if per_request:  # a GenerateOne call each: a balancer places each one
                gen = await client.generate_one(
                    prompt, request_id=f"b{i}", max_tokens=max_tokens, ignore_eos=True
                )
            else:
                gen = await streams[i % num_streams].generate(
                    prompt, max_tokens=max_tokens, ignore_eos=True
                )
            async for chunk in gen:
                trace.chunk_times.append(time.perf_counter())
                trace.num_tokens += len(chunk.token_ids)
            trace.finished = time.perf_counter()
            trace.finish_reason = (await gen.result()).finish_reason

        traces, wall = await run_paced(workload, shape, send)
        for s in streams:
            await s.close()
    return traces, wall


def run_remote(
    target: str,
    workload: Sequence[WorkloadRequest],
    shape: LoadShape,
    num_streams: int,
    per_request: bool = False,
) -> tuple[list[Trace], float]:
    return asyncio.run(_run_remote(target, workload, shape, num_streams, per_request))


# ---------------------------------------------------------------- in-process


def run_local(
    engine: object, workload: Sequence[WorkloadRequest], shape: LoadShape, tag: str
) -> tuple[list[Trace], float]:
    """The same workload and arrivals through ``engine.submit`` directly."""
    from slipstream.service.engine.events import FinishEvent, RequestSpec

    traces = [Trace() for _ in workload]
    done = threading.Semaphore(0)
    limit = threading.Semaphore(shape.concurrency or len(workload) or 1)

    def callback(trace: Trace) -> Callable[[object], None]:
        def on_event(event: object) -> None:
            now = time.perf_counter()
            if isinstance(event, FinishEvent):
                trace.finished, trace.finish_reason = now, event.reason.name.lower()
                limit.release()
                done.release()
            else:
                trace.chunk_times.append(now)
                trace.num_tokens += len(event.token_ids)  # type: ignore[attr-defined]

        return on_event

    t0 = time.perf_counter()
    for i, offset in enumerate(arrival_offsets(len(workload), shape)):
        time.sleep(max(0.0, t0 + offset - time.perf_counter()))
        limit.acquire()
        traces[i].sent = time.perf_counter()
        request = RequestSpec(
            req_id=f"{tag}-{i}",
            prompt_token_ids=list(workload[i].prompt_token_ids),
            max_new_tokens=workload[i].max_tokens,
            ignore_eos=True,
        )
        engine.submit(request, callback(traces[i]))  # type: ignore[attr-defined]
    for _ in workload:
        done.acquire()
    return traces, time.perf_counter() - t0

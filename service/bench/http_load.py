"""The ``bench serve`` workload over the OpenAI-compatible HTTP front: one
streamed ``/v1/completions`` request per workload request (token-id prompt,
greedy, EOS ignored, usage in the last chunk), timed like the gRPC run.

Token chunks are recognised by their ``"finish_reason":null`` and not
parsed, so the client spends per token about what the gRPC client does; only
the finish and usage chunks are decoded.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from slipstream.service.bench.serve_load import LoadShape, Trace, run_paced

if TYPE_CHECKING:
    import aiohttp

    from slipstream.service.bench.workload import WorkloadRequest

# OpenAI's finish reasons in the gRPC run's terms.
_FINISH = {"length": "max_tokens", "stop": "eos"}
_TOKEN_CHUNK = b'"finish_reason":null'


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, request: WorkloadRequest, trace: Trace
) -> None:
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    trace.sent = time.perf_counter()
    async with session.post(url, json=body) as response:
        if response.status != 200:
            trace.finish_reason = f"http_{response.status}"
            trace.finished = time.perf_counter()
            return
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            if _TOKEN_CHUNK in line:
                trace.chunk_times.append(time.perf_counter())
                continue
            if line.startswith(b"data: [DONE]"):
                break
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                trace.num_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                trace.finish_reason = _FINISH.get(choice["finish_reason"], "error")
            if "error" in chunk:
                trace.finish_reason = "error"
    trace.finished = time.perf_counter()


async def _run_phase(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    workload: Sequence[WorkloadRequest],
    shape: LoadShape,
) -> tuple[list[Trace], float]:
    async def send(i: int, trace: Trace) -> None:
        await _one(session, url, model, workload[i], trace)

    return await run_paced(workload, shape, send)


async def _run_http(
    base_url: str,
    model: str,
    workload: Sequence[WorkloadRequest],
    shape: LoadShape,
    warmup: Sequence[WorkloadRequest],
) -> tuple[list[Trace], float]:
    import aiohttp

    url = f"{base_url}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)  # one connection per request in flight
    timeout = aiohttp.ClientTimeout(total=None)
    # One session: the warm-up's connections are kept for the timed run, as
    # the gRPC run keeps its channel.
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await _run_phase(session, url, model, warmup, LoadShape(math.inf, 1.0, None, 0))
        return await _run_phase(session, url, model, workload, shape)


def run_http(
    base_url: str,
    model: str,
    workload: Sequence[WorkloadRequest],
    shape: LoadShape,
    warmup: Sequence[WorkloadRequest] = (),
) -> tuple[list[Trace], float]:
    """``workload`` through ``base_url``'s ``/v1/completions``, streamed,
    after an untimed ``warmup`` on the same connections."""
    return asyncio.run(_run_http(base_url, model, workload, shape, warmup))

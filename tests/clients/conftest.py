"""A scripted ``slipstream.v1.Inference`` server for client tests: it records
what clients send (call metadata, submits) and answers with a predictable
token stream, so client behaviour is tested without a model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

TOKEN_INTERVAL_S = 0.01
ABORT_CALL_PROMPT = "abort the call"
# Its request's Accepted is followed by the rejection a Slipstream server
# sends for a second submit under the same id; then the request goes on.
DUPLICATE_PROMPT = "someone reused my id"
# Its tokens go out with no pause: a cancel arrives after all of them.
BURST_PROMPT = "all at once"
# On GenerateOne: refused as a Slipstream server refuses a tenant over its
# quota, the reason and the retry hint in the trailers.
OVER_QUOTA_PROMPT = "over quota"
OVER_QUOTA_RETRY_MS = 1500


def num_prompt_tokens(submit: pb.Submit) -> int:
    """The scripted server's count of a prompt's tokens: its ids, else a
    token a word."""
    return len(submit.token_ids.ids) or len(submit.text.split())


def accepted(submit: pb.Submit) -> pb.Accepted:
    return pb.Accepted(num_prompt_tokens=num_prompt_tokens(submit))


@dataclass
class Recorded:
    metadata: list[dict[str, str]] = field(default_factory=list)  # of Generate calls
    info_metadata: list[dict[str, str]] = field(default_factory=list)  # of GetModelInfo calls
    submits: list[pb.Submit] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    batches: int = 0  # Batch responses sent


class ScriptedServicer(pb_grpc.InferenceServicer):
    """Request i of max_new_tokens n streams tokens 0..n-1, one per chunk."""

    def __init__(self) -> None:
        self.recorded = Recorded()

    async def Generate(
        self, request_iterator: AsyncIterator[pb.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.recorded.metadata.append(dict(context.invocation_metadata()))
        out: asyncio.Queue[pb.GenerateResponse | None] = asyncio.Queue()
        cancelled: set[str] = set()
        abort_requested = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []

        async def produce(submit: pb.Submit) -> None:
            rid = submit.request_id
            await out.put(pb.GenerateResponse(request_id=rid, accepted=accepted(submit)))
            if submit.text == DUPLICATE_PROMPT:
                duplicate = pb.Finished(
                    reason=pb.FINISH_REASON_REJECTED,
                    reject_reason=pb.REJECT_REASON_DUPLICATE_REQUEST_ID,
                    status_code="ALREADY_EXISTS",
                )
                await out.put(pb.GenerateResponse(request_id=rid, finished=duplicate))
            n, reason = submit.stopping.max_new_tokens, pb.FINISH_REASON_MAX_TOKENS
            for i in range(n):
                if rid in cancelled:
                    reason = pb.FINISH_REASON_CANCELLED
                    break
                chunk = pb.TokenChunk(token_ids=[i], text=f"t{i} ", index=i)
                await out.put(pb.GenerateResponse(request_id=rid, chunk=chunk))
                if submit.text != BURST_PROMPT:
                    await asyncio.sleep(TOKEN_INTERVAL_S)
            finished = pb.Finished(reason=reason, status_code="OK", text="!")
            finished.usage.output_tokens = len(submit.stopping.stop_sequences) or 0
            await out.put(pb.GenerateResponse(request_id=rid, finished=finished))

        async def read() -> None:
            async for message in request_iterator:
                if message.HasField("submit"):
                    self.recorded.submits.append(message.submit)
                    if message.submit.text == ABORT_CALL_PROMPT:
                        abort_requested.set()
                        await out.put(None)
                        return
                    tasks.append(asyncio.create_task(produce(message.submit)))
                else:
                    self.recorded.cancels.append(message.cancel.request_id)
                    cancelled.add(message.cancel.request_id)
            await asyncio.gather(*tasks)
            await out.put(None)

        reader = asyncio.create_task(read())
        # A client that asks for batches gets what waits as one Batch, as a
        # Slipstream server sends it.
        batches = self.recorded.metadata[-1].get("slipstream-batch") == "1"
        ended = False
        while not ended and (response := await out.get()) is not None:
            waiting = [response]
            while batches and not out.empty():
                more = out.get_nowait()
                if more is None:
                    ended = True
                    break
                waiting.append(more)
            if len(waiting) > 1:
                self.recorded.batches += 1
                yield pb.GenerateResponse(batch=pb.Batch(responses=waiting))
            else:
                yield response
        if abort_requested.is_set():
            for task in tasks:
                task.cancel()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted abort")
        await reader

    async def GenerateOne(
        self, submit: pb.Submit, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The same tokens as ``Generate``; a cancel ends the call."""
        self.recorded.submits.append(submit)
        rid = submit.request_id
        if submit.text == OVER_QUOTA_PROMPT:
            trailers = (
                ("slipstream-reject-reason", "quota_exceeded"),
                ("slipstream-retry-after-ms", str(OVER_QUOTA_RETRY_MS)),
            )
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "over quota", trailing_metadata=trailers
            )
        yield pb.GenerateResponse(request_id=rid, accepted=accepted(submit))
        for i in range(submit.stopping.max_new_tokens):
            chunk = pb.TokenChunk(token_ids=[i], text=f"t{i} ", index=i)
            yield pb.GenerateResponse(request_id=rid, chunk=chunk)
            if submit.text != BURST_PROMPT:
                await asyncio.sleep(TOKEN_INTERVAL_S)
        finished = pb.Finished(reason=pb.FINISH_REASON_MAX_TOKENS, status_code="OK", text="!")
        yield pb.GenerateResponse(request_id=rid, finished=finished)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        self.recorded.info_metadata.append(dict(context.invocation_metadata()))
        return pb.ModelInfo(name="scripted", has_chat_template=True)


class ScriptedServer:
    def __init__(self) -> None:
        self.servicer = ScriptedServicer()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        self.target = f"127.0.0.1:{self.port}"

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(self.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    yield server
    server.stop()

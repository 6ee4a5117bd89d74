"""asyncio client, the same shape as the blocking one:

    async with AsyncClient("localhost:50051") as client:
        gen = await client.generate("Once upon a time", max_tokens=32)
        async for chunk in gen:
            print(chunk.text, end="")
        print((await gen.result()).finish_reason)

A reader task per stream routes events to their ``AsyncGeneration``. Nothing
is retried behind the caller's back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

import grpc

from slipstream.clients.wire import (
    Accumulator,
    Chunk,
    Conversation,
    GenerateOptions,
    Messages,
    Metadata,
    Prompt,
    Result,
    StreamError,
    build_submit,
    call_metadata,
    cancel_message,
)
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

_CLOSE = object()


class AsyncGeneration:
    def __init__(self, stream: AsyncStream, request_id: str) -> None:
        self.request_id = request_id
        self._stream = stream
        self._acc = Accumulator(request_id)
        self._chunks: asyncio.Queue[Chunk | Result | StreamError] = asyncio.Queue()
        self._outcome: asyncio.Future[Result] = asyncio.get_running_loop().create_future()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        while True:
            item = await self._chunks.get()
            if isinstance(item, Chunk):
                yield item
            elif isinstance(item, StreamError):
                raise item
            else:
                return

    async def cancel(self) -> None:
        await self._stream.cancel(self.request_id)

    async def result(self) -> Result:
        return await asyncio.shield(self._outcome)

    @property
    def done(self) -> bool:
        return self._outcome.done()

    def _on_response(self, response: pb.GenerateResponse) -> bool:
        kind = response.WhichOneof("event")
        if kind == "chunk":
            self._chunks.put_nowait(self._acc.add_chunk(response.chunk))
        elif kind == "accepted":
            self._acc.queue_position = response.accepted.queue_position
        elif kind == "finished":
            self._settle(self._acc.finish(response.finished))
            return True
        return False

    def _settle(self, outcome: Result | StreamError) -> None:
        if self._outcome.done():
            return
        if isinstance(outcome, StreamError):
            self._outcome.set_exception(outcome)
            self._outcome.exception()  # retrieved: the caller may never ask
        else:
            self._outcome.set_result(outcome)
        self._chunks.put_nowait(outcome)


class AsyncStream:
    """One ``Generate`` call carrying many requests (see ``Stream``: the same
    ``close()`` and ``abort()`` semantics)."""

    def __init__(
        self,
        stub: pb_grpc.InferenceStub,
        metadata: Metadata = None,
        timeout: float | None = None,
    ) -> None:
        self._outgoing: asyncio.Queue[object] = asyncio.Queue()
        self._pending: dict[str, AsyncGeneration] = {}
        self._ids = itertools.count()
        self._error: StreamError | None = None
        self._is_closing = False
        self._call = stub.Generate(
            self._requests(), metadata=call_metadata(metadata), timeout=timeout
        )
        self._reader = asyncio.create_task(self._read())

    async def _requests(self) -> AsyncIterator[pb.GenerateRequest]:
        while (message := await self._outgoing.get()) is not _CLOSE:
            yield message  # type: ignore[misc]

    async def generate(
        self, prompt: Prompt | Conversation, *, request_id: str | None = None, **options: object
    ) -> AsyncGeneration:
        if self._error is not None:
            raise self._error
        if self._is_closing:
            raise RuntimeError("the stream is closed for new requests")
        request_id = request_id or f"r{next(self._ids)}"
        message = build_submit(request_id, prompt, GenerateOptions(**options))  # type: ignore[arg-type]
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is already in flight on this stream")
        generation = AsyncGeneration(self, request_id)
        self._pending[request_id] = generation
        await self._outgoing.put(message)
        return generation

    async def chat(
        self, messages: Messages, *, request_id: str | None = None, **options: object
    ) -> AsyncGeneration:
        """Submit a conversation; the answer stops at the model's end of turn."""
        return await self.generate(Conversation.of(messages), request_id=request_id, **options)

    async def cancel(self, request_id: str) -> None:
        await self._outgoing.put(cancel_message(request_id))

    async def close(self) -> None:
        """No more submits; half-close once every request has finished."""
        self._is_closing = True
        if not self._pending:
            self._outgoing.put_nowait(_CLOSE)

    def abort(self) -> None:
        self._call.cancel()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    @property
    def is_broken(self) -> bool:
        return self._error is not None

    async def _read(self) -> None:
        error = StreamError("OK", "the stream ended before the request finished")
        try:
            async for response in self._call:
                generation = self._pending.get(response.request_id)
                if generation is not None and generation._on_response(response):
                    del self._pending[response.request_id]
                    if self._is_closing and not self._pending:
                        self._outgoing.put_nowait(_CLOSE)
        except grpc.RpcError as exc:
            error = StreamError(exc.code().name, exc.details() or "")
        except asyncio.CancelledError:
            error = StreamError("CANCELLED", "the stream was cancelled")
        self._error = error
        orphans, self._pending = list(self._pending.values()), {}
        for generation in orphans:
            generation._settle(error)


class AsyncClient:
    """asyncio counterpart of ``Client``."""

    def __init__(
        self,
        target: str,
        *,
        metadata: Metadata = None,
        options: list[tuple[str, object]] | None = None,
    ) -> None:
        self._channel = grpc.aio.insecure_channel(target, options=options)
        self.stub = pb_grpc.InferenceStub(self._channel)
        self._metadata = metadata
        self._shared: AsyncStream | None = None

    def stream(self, metadata: Metadata = None, timeout: float | None = None) -> AsyncStream:
        return AsyncStream(self.stub, call_metadata(self._metadata, metadata), timeout)

    async def generate(
        self, prompt: Prompt | Conversation, *, metadata: Metadata = None, **options: object
    ) -> AsyncGeneration:
        if metadata:
            stream = self.stream(metadata)
            generation = await stream.generate(prompt, **options)
            await stream.close()
            return generation
        if self._shared is None or self._shared.is_broken:
            self._shared = self.stream()
        return await self._shared.generate(prompt, **options)

    async def chat(
        self, messages: Messages, *, metadata: Metadata = None, **options: object
    ) -> AsyncGeneration:
        """Submit a conversation (see ``Client.chat``)."""
        return await self.generate(Conversation.of(messages), metadata=metadata, **options)

    async def tokenize(self, text: str) -> list[int]:
        return list((await self.stub.Tokenize(pb.TokenizeRequest(text=text))).token_ids)

    async def model_info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest())

    async def server_stats(self) -> pb.ServerStats:
        return await self.stub.GetServerStats(pb.GetServerStatsRequest())

    async def close(self) -> None:
        if self._shared is not None:
            await self._shared.close()
            await self._shared.wait_closed()
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

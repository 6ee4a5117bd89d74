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
import itertools
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Unpack

import grpc

from slipstream.clients.balancing import channel_options, channel_target
from slipstream.clients.security import TLS, secure_aio_channel, with_token
from slipstream.clients.wire import (
    BATCH_METADATA,
    CLIENT_CLOSED,
    Accumulator,
    Chunk,
    Conversation,
    GenerateOptions,
    Messages,
    Metadata,
    Options,
    Prompt,
    Result,
    StreamError,
    build_one,
    build_submit,
    call_metadata,
    call_outcome,
    cancel_message,
    check_call_timeout,
    is_past_deadline,
    stream_error,
    unbatched,
)
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

_CLOSE = object()


class AsyncGeneration:
    """One request's handle (see ``Generation``: chunks are delivered once;
    leaving a loop does not cancel the request, ``await cancel()`` does)."""

    def __init__(self, cancel: Callable[[], Awaitable[None]], request_id: str) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._is_cancelled = False
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
                continue
            self._chunks.put_nowait(item)  # the end stays: a later loop ends at once
            if isinstance(item, StreamError):
                raise item
            return

    async def cancel(self) -> None:
        self._is_cancelled = True
        await self._cancel()

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
            self._acc.accept(response.accepted)
        elif kind == "finished" and self._acc.ends_request(response.finished):
            if (tail := self._acc.tail_chunk(response.finished)) is not None:
                self._chunks.put_nowait(tail)
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
        self._abort_reason: str | None = None
        check_call_timeout(timeout)
        self._call = stub.Generate(
            self._requests(), metadata=call_metadata(metadata, BATCH_METADATA), timeout=timeout
        )
        self._reader = asyncio.create_task(self._read())

    async def _requests(self) -> AsyncIterator[pb.GenerateRequest]:
        while (message := await self._outgoing.get()) is not _CLOSE:
            yield message  # type: ignore[misc]

    async def generate(
        self,
        prompt: Prompt | Conversation,
        *,
        request_id: str | None = None,
        **options: Unpack[Options],
    ) -> AsyncGeneration:
        if self._error is not None:
            raise self._error
        if self._is_closing:
            raise RuntimeError("the stream is closed for new requests")
        request_id = request_id or f"r{next(self._ids)}"
        message = build_submit(request_id, prompt, GenerateOptions(**options))
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is already in flight on this stream")
        generation = AsyncGeneration(lambda: self.cancel(request_id), request_id)
        self._pending[request_id] = generation
        await self._outgoing.put(message)
        return generation

    async def chat(
        self, messages: Messages, *, request_id: str | None = None, **options: Unpack[Options]
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

    def abort(self, reason: str = "the stream was aborted") -> None:
        """Ends the call now; unfinished requests fail with ``StreamError``
        CANCELLED, ``reason`` its details."""
        self._abort_reason = reason
        self._call.cancel()

    @property
    def is_idle(self) -> bool:
        """No request on it is unfinished."""
        return not self._pending

    async def wait_closed(self) -> None:
        """Until the call has ended. Cancelling the caller's task cancels
        this wait (the error propagates), not the stream."""
        await asyncio.wait([self._reader])

    @property
    def is_broken(self) -> bool:
        return self._error is not None

    async def _read(self) -> None:
        error = StreamError("OK", "the stream ended before the request finished")
        try:
            async for message in self._call:
                for response in unbatched(message):
                    generation = self._pending.get(response.request_id)
                    if generation is not None and generation._on_response(response):
                        del self._pending[response.request_id]
                        if self._is_closing and not self._pending:
                            self._outgoing.put_nowait(_CLOSE)
        except grpc.RpcError as exc:
            error = stream_error(exc)
        except asyncio.CancelledError:
            error = StreamError("CANCELLED", "the stream was cancelled")
        if self._abort_reason is not None and error.code == "CANCELLED":
            error = StreamError("CANCELLED", self._abort_reason)
        self._error = error
        # grpc.aio's task that writes the call waits on the queue for its
        # next message even after the call ended (a deadline, the server's
        # end, a lost connection): this ends it, else it is destroyed pending
        # ("Task was destroyed but it is pending!") once the stream is gone.
        self._outgoing.put_nowait(_CLOSE)
        orphans, self._pending = list(self._pending.values()), {}
        for generation in orphans:
            generation._settle(error)


async def _read_one(call: grpc.aio.UnaryStreamCall, generation: AsyncGeneration) -> None:
    try:
        async for response in call:
            if generation._on_response(response):
                return
        generation._settle(StreamError("OK", "the call ended before the request finished"))
    except grpc.RpcError as exc:
        if generation._is_cancelled and exc.code() is grpc.StatusCode.CANCELLED:
            generation._settle(generation._acc.cancelled_by_caller())
        elif is_past_deadline(exc):
            generation._settle(generation._acc.deadline_passed())
        else:
            generation._settle(call_outcome(generation.request_id, exc))
    except asyncio.CancelledError:  # grpc.aio's for a cancelled call, or AsyncClient.close()
        if generation._is_cancelled:
            generation._settle(generation._acc.cancelled_by_caller())
        else:
            call.cancel()
            generation._settle(StreamError("CANCELLED", CLIENT_CLOSED))


class AsyncClient:
    """asyncio counterpart of ``Client`` (the same targets and balancing).
    Build it inside the event loop that uses it (in a coroutine): its
    channel belongs to that loop."""

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        metadata: Metadata = None,
        options: list[tuple[str, object]] | None = None,
        tls: TLS | None = None,
        token: str | None = None,
        balanced: bool | None = None,
    ) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "AsyncClient must be created inside a running event loop (in a coroutine, "
                "e.g. under asyncio.run()); outside one, use Client"
            ) from None
        if balanced is None:
            balanced = not isinstance(target, str)
        merged = [*(channel_options() if balanced else []), *(options or [])]
        self._channel = secure_aio_channel(channel_target(target), tls, merged)
        self._calls: set[asyncio.Task[None]] = set()
        # Every stream it opened (the shared one, yours, one-request ones): close() ends them.
        self._streams: weakref.WeakSet[AsyncStream] = weakref.WeakSet()
        self.stub = pb_grpc.InferenceStub(self._channel)
        # The token goes with every call (gRPC metadata is per call).
        self._metadata = with_token(metadata, token)
        self._shared: AsyncStream | None = None
        self._left_ready = False  # the connection left READY since the shared stream opened
        self._watcher: asyncio.Task[None] | None = None
        self._retiring: set[AsyncStream] = set()
        self._is_closed = False

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError("the client is closed")

    def stream(self, metadata: Metadata = None, timeout: float | None = None) -> AsyncStream:
        self._check_open()
        stream = AsyncStream(self.stub, call_metadata(self._metadata, metadata), timeout)
        self._streams.add(stream)
        return stream

    async def generate(
        self,
        prompt: Prompt | Conversation,
        *,
        metadata: Metadata = None,
        multiplex: bool = True,
        **options: Unpack[Options],
    ) -> AsyncGeneration:
        self._check_open()
        if not multiplex:
            return await self.generate_one(prompt, metadata=metadata, **options)
        if metadata:
            stream = self.stream(metadata)
            generation = await stream.generate(prompt, **options)
            await stream.close()
            return generation
        return await (await self._shared_stream()).generate(prompt, **options)

    async def _shared_stream(self) -> AsyncStream:
        """The shared stream, retired once its connection left READY (see
        ``Client._shared_stream``)."""
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch_state())
        self._retiring = {stream for stream in self._retiring if not stream._reader.done()}
        if self._shared is not None and self._left_ready:
            await self._shared.close()
            self._retiring.add(self._shared)  # held until its requests finish
            self._shared = None
        if self._shared is None or self._shared.is_broken:
            self._shared = self.stream()
            self._left_ready = False
        return self._shared

    async def _watch_state(self) -> None:
        state = self._channel.get_state()
        while True:
            await self._channel.wait_for_state_change(state)
            new_state = self._channel.get_state()
            if state is grpc.ChannelConnectivity.READY:
                self._left_ready = True
            state = new_state

    async def generate_one(
        self,
        prompt: Prompt | Conversation,
        *,
        request_id: str = "r0",
        metadata: Metadata = None,
        timeout: float | None = None,
        **options: Unpack[Options],
    ) -> AsyncGeneration:
        """One request on a ``GenerateOne`` call of its own (see
        ``Client.generate_one``)."""
        self._check_open()
        submit = build_one(request_id, prompt, GenerateOptions(**options))
        check_call_timeout(timeout)
        call = self.stub.GenerateOne(
            submit, metadata=call_metadata(self._metadata, metadata), timeout=timeout
        )

        async def cancel() -> None:
            call.cancel()

        generation = AsyncGeneration(cancel, request_id)
        task = asyncio.create_task(_read_one(call, generation))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        return generation

    async def chat(
        self, messages: Messages, *, metadata: Metadata = None, **options: Unpack[Options]
    ) -> AsyncGeneration:
        """Submit a conversation (see ``Client.chat``)."""
        return await self.generate(Conversation.of(messages), metadata=metadata, **options)

    async def tokenize(self, text: str) -> list[int]:
        self._check_open()
        return list(
            (
                await self.stub.Tokenize(
                    pb.TokenizeRequest(text=text), metadata=call_metadata(self._metadata)
                )
            ).token_ids
        )

    async def model_info(self) -> pb.ModelInfo:
        self._check_open()
        return await self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), metadata=call_metadata(self._metadata)
        )

    async def server_stats(self) -> pb.ServerStats:
        self._check_open()
        return await self.stub.GetServerStats(
            pb.GetServerStatsRequest(), metadata=call_metadata(self._metadata)
        )

    async def close(self) -> None:
        """Closes the client at once, as ``Client.close`` does: requests
        still unfinished are cancelled on the server, and their results
        raise ``StreamError`` CANCELLED (collect what you need before
        closing, or leaving the ``async with``)."""
        self._is_closed = True
        streams = list(self._streams)
        for stream in streams:
            await stream.close()
            if not stream.is_idle:
                stream.abort(CLIENT_CLOSED)
        if self._watcher is not None:
            self._watcher.cancel()
        for task in self._calls:
            task.cancel()
        readers = [*(stream._reader for stream in streams), *self._calls]
        if readers:  # every request settled before close returns
            await asyncio.wait(readers)
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

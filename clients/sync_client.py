"""Blocking client: one multiplexed ``Generate`` stream per ``Stream``, a
reader thread that routes each event to its request's ``Generation``.

    client = Client("localhost:50051")
    gen = client.generate("Once upon a time", max_tokens=32, priority=0, deadline_s=2.0,
                          first_token_timeout_s=0.5)
    for chunk in gen:
        print(chunk.text, end="")
    print(gen.result().finish_reason)

    answer = client.chat([("user", "What is the capital of France?")]).result().text

Nothing is retried or reconnected behind the caller's back: when a stream
fails, its unfinished requests raise ``StreamError`` and the caller decides.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Unpack

import grpc

from slipstream.clients.balancing import channel_options, channel_target
from slipstream.clients.security import TLS, secure_channel, with_token
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


class Generation:
    """One request's handle: iterate its chunks, ``cancel()`` it, ``result()``.

    Each chunk is delivered once: once a loop has seen the end, another
    ends at once (or raises the same ``StreamError``). Breaking out of a
    loop does not cancel the request: call ``cancel()``."""

    def __init__(self, cancel: Callable[[], None], request_id: str) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._is_cancelled = False
        self._is_closed_by_client = False
        self._acc = Accumulator(request_id)
        self._chunks: queue.SimpleQueue[Chunk | Result | StreamError] = queue.SimpleQueue()
        self._done = threading.Event()
        self._outcome: Result | StreamError | None = None

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            item = self._chunks.get()
            if isinstance(item, Chunk):
                yield item
                continue
            self._chunks.put(item)  # the end stays: a later loop ends at once
            if isinstance(item, StreamError):
                raise item
            return

    def cancel(self) -> None:
        """Ask the server to abort this request; it finishes CANCELLED (on a
        ``generate_one`` call: the call is cancelled, and so the request)."""
        self._is_cancelled = True
        self._cancel()

    def result(self, timeout: float | None = None) -> Result:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} has not finished")
        if isinstance(self._outcome, StreamError):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # -- reader thread ----------------------------------------------------

    def _on_response(self, response: pb.GenerateResponse) -> bool:
        """Feed one event; True when the request finished."""
        kind = response.WhichOneof("event")
        if kind == "chunk":
            self._chunks.put(self._acc.add_chunk(response.chunk))
        elif kind == "accepted":
            self._acc.accept(response.accepted)
        elif kind == "finished" and self._acc.ends_request(response.finished):
            if (tail := self._acc.tail_chunk(response.finished)) is not None:
                self._chunks.put(tail)
            self._settle(self._acc.finish(response.finished))
            return True
        return False

    def _settle(self, outcome: Result | StreamError) -> None:
        self._outcome = outcome
        self._chunks.put(outcome)
        self._done.set()


class Stream:
    """One ``Generate`` call carrying many requests. ``close()`` takes no
    more submits and half-closes the call once every request has finished
    (cancels still go through until then); ``abort()`` ends the call at once,
    which aborts every unfinished request on the server (their results raise
    ``StreamError`` CANCELLED)."""

    def __init__(
        self,
        stub: pb_grpc.InferenceStub,
        metadata: Metadata = None,
        timeout: float | None = None,
    ) -> None:
        self._outgoing: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._pending: dict[str, Generation] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._error: StreamError | None = None
        self._is_closing = False
        self._abort_reason: str | None = None
        check_call_timeout(timeout)
        self._call = stub.Generate(
            iter(self._outgoing.get, _CLOSE),
            metadata=call_metadata(metadata, BATCH_METADATA),
            timeout=timeout,
        )
        self._reader = threading.Thread(target=self._read, name="slipstream-stream", daemon=True)
        self._reader.start()

    def generate(
        self,
        prompt: Prompt | Conversation,
        *,
        request_id: str | None = None,
        **options: Unpack[Options],
    ) -> Generation:
        request_id = request_id or f"r{next(self._ids)}"
        message = build_submit(request_id, prompt, GenerateOptions(**options))
        generation = Generation(lambda: self.cancel(request_id), request_id)
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._is_closing:
                raise RuntimeError("the stream is closed for new requests")
            if request_id in self._pending:
                raise ValueError(f"request_id {request_id!r} is already in flight on this stream")
            self._pending[request_id] = generation
        self._outgoing.put(message)
        return generation

    def chat(
        self, messages: Messages, *, request_id: str | None = None, **options: Unpack[Options]
    ) -> Generation:
        """Submit a conversation; the answer stops at the model's end of turn."""
        return self.generate(Conversation.of(messages), request_id=request_id, **options)

    def cancel(self, request_id: str) -> None:
        self._outgoing.put(cancel_message(request_id))

    def close(self) -> None:
        with self._lock:
            self._is_closing = True
            is_idle = not self._pending
        if is_idle:
            self._outgoing.put(_CLOSE)

    def abort(self, reason: str = "the stream was aborted") -> None:
        """Ends the call now; unfinished requests fail with ``StreamError``
        CANCELLED, ``reason`` its details."""
        self._abort_reason = reason
        self._call.cancel()

    @property
    def is_idle(self) -> bool:
        """No request on it is unfinished."""
        with self._lock:
            return not self._pending

    @property
    def is_broken(self) -> bool:
        return self._error is not None

    def _read(self) -> None:
        error = StreamError("OK", "the stream ended before the request finished")
        try:
            for message in self._call:
                for response in unbatched(message):
                    with self._lock:
                        generation = self._pending.get(response.request_id)
                    if generation is not None and generation._on_response(response):
                        with self._lock:
                            self._pending.pop(response.request_id, None)
                            is_done = self._is_closing and not self._pending
                        if is_done:
                            self._outgoing.put(_CLOSE)
        except grpc.RpcError as exc:
            if self._abort_reason is not None and exc.code() is grpc.StatusCode.CANCELLED:
                error = StreamError("CANCELLED", self._abort_reason)
            else:
                error = stream_error(exc)
        with self._lock:
            self._error = error
            orphans = list(self._pending.values())
            self._pending.clear()
        # gRPC's thread that writes the call waits on the queue for its next
        # message even after the call ended (a deadline, the server's end, a
        # lost connection): this ends it, else it waits for good.
        self._outgoing.put(_CLOSE)
        for generation in orphans:
            generation._settle(error)


def _read_one(call: grpc.Call, generation: Generation) -> None:
    """Feed a ``GenerateOne`` call's events to its generation (own thread)."""
    try:
        for response in call:  # type: ignore[attr-defined]
            if generation._on_response(response):
                return
        generation._settle(StreamError("OK", "the call ended before the request finished"))
    except grpc.RpcError as exc:
        if generation._is_closed_by_client and exc.code() is grpc.StatusCode.CANCELLED:
            generation._settle(StreamError("CANCELLED", CLIENT_CLOSED))
        elif generation._is_cancelled and exc.code() is grpc.StatusCode.CANCELLED:
            generation._settle(generation._acc.cancelled_by_caller())
        elif is_past_deadline(exc):
            generation._settle(generation._acc.deadline_passed())
        else:
            generation._settle(call_outcome(generation.request_id, exc))


class Client:
    """A channel to Slipstream. ``generate`` multiplexes requests on one
    shared stream (opened on first use, reopened on the next call after it
    fails); ``generate_one`` gives a request a call of its own, which a load
    balancer routes on its own; ``stream()`` opens a stream the caller manages.

    ``target`` is one address, a gRPC name (``dns:///name:port``) or a list of
    addresses; with a list, or with ``balanced=True``, the channel balances
    calls over every replica (``clients.balancing``: round_robin, health
    checking, retries of UNAVAILABLE before the first response)."""

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
        if balanced is None:
            balanced = not isinstance(target, str)
        merged = [*(channel_options() if balanced else []), *(options or [])]
        self._channel = secure_channel(channel_target(target), tls, merged)
        self.stub = pb_grpc.InferenceStub(self._channel)
        # The token goes with every call (gRPC metadata is per call).
        self._metadata = with_token(metadata, token)
        self._shared: Stream | None = None
        self._calls: dict[Generation, grpc.Call] = {}  # unfinished generate_one calls
        # Every stream it opened (the shared one, yours, one-request ones): close() ends them.
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._state = grpc.ChannelConnectivity.IDLE
        self._left_ready = False  # the connection left READY since the shared stream opened
        # Watched from the first shared stream on (``_shared_stream``): a client
        # that never opens one (one-shot calls, a chat ended at its first
        # prompt) starts no polling thread, which gRPC's can outlive a close
        # that comes right after it started and fail in (grpc/grpc#18995).
        self._watching = False
        self._is_closed = False

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError("the client is closed")

    def stream(self, metadata: Metadata = None, timeout: float | None = None) -> Stream:
        with self._lock:
            return self._open_stream(metadata, timeout)

    def _open_stream(self, metadata: Metadata = None, timeout: float | None = None) -> Stream:
        """A new stream (caller holds the lock: a racing close() either comes
        first, or finds the stream and ends it, never closes the channel
        under a call it has not seen)."""
        self._check_open()
        stream = Stream(self.stub, call_metadata(self._metadata, metadata), timeout)
        self._streams.add(stream)
        return stream

    def generate(
        self,
        prompt: Prompt | Conversation,
        *,
        metadata: Metadata = None,
        multiplex: bool = True,
        **options: Unpack[Options],
    ) -> Generation:
        """Submit one request. With ``multiplex=False`` it is a
        ``generate_one`` call; with ``metadata`` (which gRPC attaches per
        call) the request gets a stream of its own, closed after it."""
        self._check_open()
        if not multiplex:
            return self.generate_one(prompt, metadata=metadata, **options)
        with self._lock:
            if metadata:
                stream = self._open_stream(metadata)
                generation = stream.generate(prompt, **options)
                stream.close()
                return generation
            return self._shared_stream().generate(prompt, **options)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        with self._lock:  # a gRPC thread
            if self._state is grpc.ChannelConnectivity.READY and state is not self._state:
                self._left_ready = True
            self._state = state

    def generate_one(
        self,
        prompt: Prompt | Conversation,
        *,
        request_id: str = "r0",
        metadata: Metadata = None,
        timeout: float | None = None,
        **options: Unpack[Options],
    ) -> Generation:
        """One request on a ``GenerateOne`` call of its own. ``timeout`` is
        the call's gRPC deadline, which the server also applies to the
        request: its passing, whichever side sees it first, finishes the
        request ``deadline_exceeded`` (a ``Result``, as ``deadline_s``
        would). A rejected request's result says why (as on a stream); a
        failed call (UNAVAILABLE after retries, ...) raises ``StreamError``."""
        self._check_open()
        submit = build_one(request_id, prompt, GenerateOptions(**options))
        check_call_timeout(timeout)
        with self._lock:  # opened and registered at once, as _open_stream's streams
            self._check_open()
            call = self.stub.GenerateOne(
                submit, metadata=call_metadata(self._metadata, metadata), timeout=timeout
            )
            generation = Generation(call.cancel, request_id)
            self._calls[generation] = call
        call.add_done_callback(lambda _: self._forget(generation))
        threading.Thread(
            target=_read_one, args=(call, generation), name="slipstream-call", daemon=True
        ).start()
        return generation

    def _forget(self, generation: Generation) -> None:
        with self._lock:
            self._calls.pop(generation, None)

    def chat(
        self, messages: Messages, *, metadata: Metadata = None, **options: Unpack[Options]
    ) -> Generation:
        """Submit a conversation ((role, content) pairs or role/content dicts),
        rendered by the server with the model's chat template; the model's
        end-of-turn token ends the answer. Takes ``generate``'s options."""
        return self.generate(Conversation.of(messages), metadata=metadata, **options)

    def _shared_stream(self) -> Stream:
        """The shared stream (caller holds the lock). A connection that left
        READY after the stream had it (GOAWAY: the server's maximum connection
        age, a drain) retires the stream: its requests finish on the old
        connection, new ones go on a new stream, over a new connection."""
        self._check_open()  # under the lock: a racing close() is told as such
        if self._shared is not None and self._left_ready:
            self._shared.close()
            self._shared = None
        if self._shared is None or self._shared.is_broken:
            self._shared = self._open_stream()
            self._left_ready = False
            if not self._watching:
                self._watching = True
                self._channel.subscribe(self._on_state)
        return self._shared

    def tokenize(self, text: str) -> list[int]:
        self._check_open()
        return list(
            self.stub.Tokenize(
                pb.TokenizeRequest(text=text), metadata=call_metadata(self._metadata)
            ).token_ids
        )

    def model_info(self) -> pb.ModelInfo:
        self._check_open()
        return self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), metadata=call_metadata(self._metadata)
        )

    def server_stats(self) -> pb.ServerStats:
        self._check_open()
        return self.stub.GetServerStats(
            pb.GetServerStatsRequest(), metadata=call_metadata(self._metadata)
        )

    def close(self) -> None:
        """Closes the client at once: requests still unfinished are cancelled
        on the server, and their results raise ``StreamError`` CANCELLED
        (collect what you need before closing, or leaving the ``with``).
        ``AsyncClient.close`` does the same."""
        with self._lock:
            self._is_closed = True
            for stream in list(self._streams):
                stream.close()
                if not stream.is_idle:
                    stream.abort(CLIENT_CLOSED)
            calls, self._calls = self._calls, {}
            watching, self._watching = self._watching, False
        for generation, call in calls.items():
            generation._is_closed_by_client = True
            call.cancel()
        if watching:
            self._channel.unsubscribe(self._on_state)
            _close_once_unwatched(self._channel)
        else:
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# gRPC's connectivity poller leaves within 0.2 s of its last unsubscribe; the
# longest a close waits for it before closing anyway.
_POLLER_EXIT_S = 2.0


def _close_once_unwatched(channel: grpc.Channel) -> None:
    """Closes ``channel`` from a daemon thread once gRPC's connectivity
    poller has left it: a channel closed under the poller makes it raise
    "Cannot monitor channel state: Channel closed!" in its own thread, a
    traceback after two of three closes of a client that had a shared stream
    (grpc/grpc#18995). ``close`` returns at once; the connection goes at most
    0.2 s later. The poller's flag is gRPC's own (private) state; without
    it, a fixed wait."""
    state = getattr(channel, "_connectivity_state", None)

    def close() -> None:
        if state is None or not hasattr(state, "polling"):
            time.sleep(0.25)
        else:
            deadline = time.monotonic() + _POLLER_EXIT_S
            while state.polling and time.monotonic() < deadline:
                time.sleep(0.01)
        channel.close()

    threading.Thread(target=close, name="slipstream-channel-close", daemon=True).start()

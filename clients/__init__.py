"""Slipstream clients over the generated ``slipstream.v1`` stubs: ``Client``
(blocking) and ``AsyncClient`` (asyncio), each multiplexing many requests on
one bidirectional stream."""

from slipstream.clients.async_client import AsyncClient, AsyncGeneration, AsyncStream
from slipstream.clients.security import TLS
from slipstream.clients.sync_client import Client, Generation, Stream
from slipstream.clients.wire import Chunk, Result, StreamError, TokenLogprob

__all__ = [
    "TLS",
    "AsyncClient",
    "AsyncGeneration",
    "AsyncStream",
    "Chunk",
    "Client",
    "Generation",
    "Result",
    "Stream",
    "StreamError",
    "TokenLogprob",
]

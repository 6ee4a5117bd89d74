"""Where the server is in its life, and what health reports for it.

    LOADING ──serve(engine)──▶ SERVING ──drain()──▶ DRAINING
    NOT_SERVING                SERVING              NOT_SERVING

New calls are accepted only while SERVING; requests already on a stream keep
running while DRAINING (the engine refuses their streams' new submits).
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2

if TYPE_CHECKING:
    from slipstream.service.engine.engine import Engine

# Health is reported for the whole server ("") and for the inference service.
INFERENCE_SERVICE = "slipstream.v1.Inference"


class Phase(enum.IntEnum):
    LOADING = 0
    SERVING = 1
    DRAINING = 2


class NotServing(Exception):
    """The server is loading or draining (UNAVAILABLE); raised as this class
    while draining, as ``Loading`` while loading."""


class Loading(NotServing):
    """The server is still loading its model (UNAVAILABLE, as draining is)."""


class Lifecycle:
    def __init__(self, engine: Engine | None = None) -> None:
        self.health = health.aio.HealthServicer()
        self._engine = engine
        self.phase = Phase.LOADING

    @property
    def engine(self) -> Engine:
        """The engine, for calls that need it; raises Loading while loading,
        its start included: what the model is (HTTP /v1/models, gRPC
        GetModelInfo) is not told before health says SERVING."""
        if self._engine is None or self.phase is Phase.LOADING:
            raise Loading("the model is still loading")
        return self._engine

    def require_serving(self) -> Engine:
        """The engine, if new calls are accepted now."""
        if self.phase is Phase.LOADING:
            raise Loading("the server is loading")
        if self.phase is not Phase.SERVING:
            raise NotServing(f"the server is {self.phase.name.lower()}")
        return self.engine

    async def serve(self, engine: Engine | None = None) -> None:
        if engine is not None:
            self._engine = engine
        assert self._engine is not None, "serve() needs an engine"
        # Off the event loop: start() returns once the engine thread can step.
        await asyncio.to_thread(self._engine.start)
        self.phase = Phase.SERVING
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        """Stop taking work: health NOT_SERVING, new calls and submits refused."""
        self.phase = Phase.DRAINING
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._engine is not None:
            self._engine.drain()

    async def report_loading(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set_health(self, status: int) -> None:
        for service in ("", INFERENCE_SERVICE):
            await self.health.set(service, status)

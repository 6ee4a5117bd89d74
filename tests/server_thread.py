"""A live gRPC server for end-to-end tests, on its own event loop thread like
a real process's: ``create_server(engine, "127.0.0.1", 0, **options)``
(telemetry, limits, tls, tenants, ...), started, its target ready to dial."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any


class ServerThread:
    def __init__(self, engine: object, target_host: str = "127.0.0.1", **options: Any) -> None:
        """``target_host``: the name clients dial (``localhost`` for a TLS
        certificate issued to it); the server listens on 127.0.0.1."""
        from slipstream.service.api.server import create_server

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        start = create_server(engine, "127.0.0.1", 0, **options)  # type: ignore[arg-type]
        self.server, self.port = self.run(start)
        self.target = f"{target_host}:{self.port}"
        self.telemetry = options.get("telemetry")

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Runs ``coro`` on the server's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def hold_every_submit(engine: object, monkeypatch: Any) -> None:
    """Pauses each request the moment ``engine`` takes it: it holds its KV and
    gets no more steps, so it cannot finish before a timeout, a deadline or a
    disconnect ends it, however fast this machine generates (a deadline still
    ends a paused request; a cancel or an abort still frees it)."""
    submit = engine.submit  # type: ignore[attr-defined]

    def submit_held(request: Any, on_event: Any) -> None:
        submit(request, on_event)
        engine.pause([request.req_id])  # type: ignore[attr-defined]

    monkeypatch.setattr(engine, "submit", submit_held)

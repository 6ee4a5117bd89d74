"""The HTTP front alone around one engine, on an event loop thread of its
own, for tests that call it as a client would."""

from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.request

from slipstream.service.api.auth import Tenants
from slipstream.service.api.limits import Limits
from slipstream.service.api.tls import ServerTLS
from slipstream.service.telemetry.tracing import Telemetry


class FrontThread:
    def __init__(
        self,
        engine: object,
        limits: Limits | None = None,
        telemetry: Telemetry | None = None,
        tenants: Tenants | None = None,
        tls: ServerTLS | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._call(self._start(engine, limits, telemetry, tenants, tls))
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    async def _start(
        self,
        engine: object,
        limits: Limits | None,
        telemetry: Telemetry | None,
        tenants: Tenants | None,
        tls: ServerTLS | None,
    ) -> int:
        from slipstream.service.api.http.app import HttpFront
        from slipstream.service.api.lifecycle import Lifecycle

        lifecycle = Lifecycle(engine)  # type: ignore[arg-type]
        self.http = HttpFront(lifecycle, telemetry, limits=limits, tenants=tenants, tls=tls)
        port = await self.http.start("127.0.0.1", 0)
        await lifecycle.serve()
        return port

    def stop(self) -> None:
        self._call(self.http.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    def post_bytes(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """POSTs ``body`` as JSON; the status and the raw reply, errors too."""
        request = urllib.request.Request(
            self.base_url + path,
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

"""Hand-off of one request's engine events to its HTTP handler.

Engine thread                         event loop (the handler)
  on_event(ev) ─▶ events.append(ev)     batches(): wait wakeup, take all queued
                 └─ one call_soon_threadsafe per burst, not per token
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from slipstream.service.engine.events import Event, FinishEvent


class EventRelay:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: deque[Event] = deque()  # appends are thread-safe
        self._wakeup = asyncio.Event()
        self._wake_pending = False
        self.is_finished = False  # the FinishEvent has been taken (loop side)

    def on_event(self, event: Event) -> None:
        """Engine thread: queue ``event``; wake the loop once per burst."""
        self._events.append(event)
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._wakeup.set)

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Events in order, in the bursts they arrived in; the last batch
        ends with the request's FinishEvent."""
        while not self.is_finished:
            # Cleared before taking: an event appended after this point
            # schedules a fresh wakeup, one appended before is taken below.
            self._wake_pending = False
            self._wakeup.clear()
            if not self._events:
                await self._wakeup.wait()
                continue
            batch = []
            while self._events:
                batch.append(self._events.popleft())
            self.is_finished = isinstance(batch[-1], FinishEvent)
            yield batch

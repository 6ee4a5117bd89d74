"""Hand-off of one HTTP request's engine events to its handler: the events
of every engine request it made (one per choice), in the order they came.

Engine thread                         event loop (the handler)
  on_event(ev) ─▶ events.append(ev)     batches(): wait wakeup, take all queued
                 └─ one call_soon_threadsafe per burst, not per token
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterable

from slipstream.service.engine.events import Event, FinishEvent


class EventRelay:
    def __init__(self, loop: asyncio.AbstractEventLoop, req_ids: Iterable[str]) -> None:
        self._loop = loop
        self._events: deque[Event] = deque()  # appends are thread-safe
        self._wakeup = asyncio.Event()
        self._wake_pending = False
        # Requests whose FinishEvent has not been taken yet (loop side).
        self._unfinished = set(req_ids)

    @property
    def is_finished(self) -> bool:
        """Every request's FinishEvent has been taken, or it was given up."""
        return not self._unfinished

    def on_event(self, event: Event) -> None:
        """Engine thread: queue ``event``; wake the loop once per burst."""
        self._events.append(event)
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def give_up(self) -> list[str]:
        """The requests not finished yet, no longer waited for: the caller
        aborts them."""
        unfinished = list(self._unfinished)
        self._unfinished.clear()
        return unfinished

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Events in order, in the bursts they arrived in, until every
        request's FinishEvent has been taken."""
        while self._unfinished:
            # Cleared before taking: an event appended after this point
            # schedules a fresh wakeup, one appended before is taken below.
            self._wake_pending = False
            self._wakeup.clear()
            if not self._events:
                await self._wakeup.wait()
                continue
            batch = []
            while self._events:
                event = self._events.popleft()
                if isinstance(event, FinishEvent):
                    self._unfinished.discard(event.req_id)
                batch.append(event)
            yield batch

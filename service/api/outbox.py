"""A stream's outbound buffer: events its client has not read yet, counted in
events and bytes so a client that stops reading costs the server a bounded
amount of memory.

    engine thread ── put(event) ─▶ [ e e e e e ... ] ─▶ pop() ── event loop
                                   ├─ full: events or bytes at their bound
                                   └─ drained: at most half of both again

``put`` never refuses: a Finished must always get through, and the producer
is stopped upstream (the stream's requests are paused) once ``put`` reports
the buffer full. ``drop`` discards items (the chunks of requests cancelled
for not being read), so their memory goes at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from slipstream.service.engine.events import Event, FinishEvent, TokenEvent

T = TypeVar("T")

_EVENT_OVERHEAD_BYTES = 64  # a response's framing, ids and timings, roughly


def event_bytes(event: Event) -> int:
    """About what ``event`` costs as a response on the wire."""
    if isinstance(event, TokenEvent):
        return _EVENT_OVERHEAD_BYTES + 5 * len(event.token_ids) + len(event.text.encode())
    assert isinstance(event, FinishEvent)
    return 2 * _EVENT_OVERHEAD_BYTES + len(event.text.encode()) + len(event.message)


class Outbox(Generic[T]):
    def __init__(self, max_events: int, max_bytes: int) -> None:
        self._items: deque[tuple[T, int]] = deque()
        self._lock = threading.Lock()
        self._num_bytes = 0
        self._max_events = max_events
        self._max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def is_full(self) -> bool:
        return len(self._items) >= self._max_events or self._num_bytes >= self._max_bytes

    @property
    def is_drained(self) -> bool:
        """At most half full by both measures: time to let producers go on."""
        return 2 * len(self._items) <= self._max_events and 2 * self._num_bytes <= self._max_bytes

    def put(self, item: T, num_bytes: int) -> bool:
        """Appends ``item`` (any thread); True when the buffer is now full."""
        with self._lock:
            self._items.append((item, num_bytes))
            self._num_bytes += num_bytes
            return self.is_full

    def pop(self) -> T | None:
        """The oldest item, or None when empty."""
        with self._lock:
            if not self._items:
                return None
            item, num_bytes = self._items.popleft()
            self._num_bytes -= num_bytes
            return item

    def remove(self, item: T) -> None:
        """Withdraws ``item`` (which must be present)."""
        self.drop(lambda candidate: candidate is item)

    def drop(self, predicate: Callable[[T], bool]) -> int:
        """Discards every item ``predicate`` accepts; returns how many."""
        with self._lock:
            kept = deque(entry for entry in self._items if not predicate(entry[0]))
            num_dropped = len(self._items) - len(kept)
            self._items = kept
            self._num_bytes = sum(num_bytes for _, num_bytes in kept)
            return num_dropped

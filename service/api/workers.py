"""A small, bounded pool of threads for the CPU work of a front door —
tokenizing and chat-rendering prompts, the ``Tokenize`` call — so none of it
runs on the event loop.

    event loop                       worker threads (nice +5; +19 for a large input)
      await pool.run(fn, size) ──▶     fn()            HF fast tokenizers release
      ◀── result / exception ────                      the GIL while they work
                                       malloc_trim(0)  after a large input

At most ``num_workers`` jobs run and ``max_queued`` wait; one more raises
``WorkersBusy`` (a ``QueueFull``: the submit is rejected, nothing waits
unboundedly). The workers run at a lower CPU priority than the engine thread,
so a tokenization takes the cores the model step leaves over; a large input
(``trim_after_bytes``, 1 MiB) runs on a worker of its own at the lowest
priority. A CPU step's threads work in lock-step, and one of them losing its
core to a long tokenization stalls every region of the step: 4 MB of text
beside a streaming request on a 2-core Zen 5 (`serve --model smollm2`)
stopped the stream for 150-190 ms at nice 5, at most 20-28 ms at 19, and
was refused 3.9-4.9 s or 7.7-9.1 s later. At 19 an ordinary prompt would
wait too long behind the step (20 KB: 80-230 ms to be accepted against
10-15 at nice 5; 256 KB: 2.7-3.2 s against 0.16-0.25; docs/operations.md).

Memory: tokenizing a few MB of text allocates hundreds of MB (tokens,
offsets, per-token strings) that glibc keeps in the worker thread's arena
after it is freed; ``malloc_trim(0)`` hands those pages back. It is used
instead of an allocator choice (jemalloc/tcmalloc via LD_PRELOAD) because it
needs no extra package or launcher environment and acts exactly where the
spike happened; it is a no-op on a libc without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import structlog

from slipstream.scheduler.errors import QueueFull

if TYPE_CHECKING:
    from slipstream.service.api.limits import Limits

log = structlog.get_logger(__name__)

T = TypeVar("T")

WORKER_NICE = 5  # relative to the process; Linux priorities are per thread
LARGE_INPUT_NICE = 19  # the lowest Linux allows


class WorkersBusy(QueueFull):
    """Every worker is busy and the waiting line is full."""


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_malloc_trim = _load_malloc_trim()


def release_memory() -> bool:
    """Returns freed heap pages to the system; False where unavailable."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def _lower_priority(nice: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.nice(0) + nice)


class WorkerPool:
    def __init__(self, num_workers: int, max_queued: int, trim_after_bytes: int) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=num_workers,
            thread_name_prefix="slipstream-tokenizer",
            initializer=_lower_priority,
            initargs=(WORKER_NICE,),
        )
        self._large = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="slipstream-tokenizer-large",
            initializer=_lower_priority,
            initargs=(LARGE_INPUT_NICE,),
        )
        self._capacity = num_workers + max_queued
        self._num_pending = 0  # queued or running; a cancelled caller's job still counts
        self._pending_lock = threading.Lock()
        self._trim_after_bytes = trim_after_bytes
        self._trim_lock = threading.Lock()

    @classmethod
    def for_limits(cls, limits: Limits) -> WorkerPool:
        return cls(limits.num_tokenizer_workers, limits.max_queued_prompts, limits.trim_after_bytes)

    @property
    def num_pending(self) -> int:
        return self._num_pending

    async def run(self, fn: Callable[[], T], input_bytes: int = 0) -> T:
        """``fn()`` on a worker; raises ``WorkersBusy`` at once when the pool
        is full, else whatever ``fn`` raises. ``input_bytes`` at or over the
        trim threshold take the large input's worker, which releases memory
        afterwards."""
        with self._pending_lock:
            if self._num_pending >= self._capacity:
                raise WorkersBusy(
                    f"the server is tokenizing {self._num_pending} prompts; retry shortly"
                )
            self._num_pending += 1
        large = input_bytes >= self._trim_after_bytes
        future = (self._large if large else self._executor).submit(self._call, fn, input_bytes)
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _future: object) -> None:
        with self._pending_lock:
            self._num_pending -= 1

    def _call(self, fn: Callable[[], T], input_bytes: int) -> T:
        try:
            return fn()
        finally:
            if input_bytes >= self._trim_after_bytes:
                self._trim(input_bytes)

    def _trim(self, input_bytes: int) -> None:
        # One trim at a time: concurrent trims walk the same arenas for nothing.
        if not self._trim_lock.acquire(blocking=False):
            return
        try:
            started = time.monotonic()
            if release_memory():
                log.debug(
                    "memory_trimmed",
                    input_bytes=input_bytes,
                    seconds=round(time.monotonic() - started, 4),
                )
        finally:
            self._trim_lock.release()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)

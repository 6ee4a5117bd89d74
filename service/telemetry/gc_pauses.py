"""Pauses of Python's cyclic garbage collector, for ``/metrics``.

A collection stops every thread of the server — the engine's steps and the
gRPC and HTTP fronts alike — so a slow request whose steps show no cause may
find it here: ``slipstream_gc_pause_seconds{generation}``, a histogram timed
by a ``gc.callbacks`` hook (two clock reads a collection). The server freezes
its start-up heap (``engine/gc_heap.py``), which keeps full collections short;
this says how short.
"""

from __future__ import annotations

import bisect
import gc
import time

# Upper bounds (seconds) of the pause histogram's buckets.
GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
NUM_GENERATIONS = 3


class GcPauses:
    """Per generation: how many collections took up to each bucket's bound
    (the last count: longer), and their total seconds."""

    def __init__(self) -> None:
        self._started = 0.0  # collections never overlap: the interpreter runs one at a time
        self._counts = [[0] * (len(GC_PAUSE_BUCKETS) + 1) for _ in range(NUM_GENERATIONS)]
        self._sums = [0.0] * NUM_GENERATIONS

    def on_collection(self, phase: str, info: dict[str, int]) -> None:
        """The ``gc.callbacks`` hook."""
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        seconds = now - self._started
        generation = info["generation"]
        self._counts[generation][bisect.bisect_left(GC_PAUSE_BUCKETS, seconds)] += 1
        self._sums[generation] += seconds

    def snapshot(self) -> list[tuple[list[int], float]]:
        """Per generation, 0 first: the bucket counts (not cumulative) and the sum."""
        return [
            (list(counts), total) for counts, total in zip(self._counts, self._sums, strict=True)
        ]


_PAUSES: GcPauses | None = None


def gc_pauses() -> GcPauses:
    """The process's pause record, its hook installed on first use."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = GcPauses()
        gc.callbacks.append(_PAUSES.on_collection)
    return _PAUSES

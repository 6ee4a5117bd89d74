"""The start-up heap is frozen for the cyclic collector while the server
serves (``gc_heap.py``): what was alive before is skipped by every
collection, what serving makes is still collected, and shutdown unfreezes."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.gc_heap import frozen_heap

CONFIG = EngineConfig(model="tiny", dtype="float32")


def _is_tracked(obj: object) -> bool:
    """Whether the collector walks ``obj`` (frozen objects it skips)."""
    return any(o is obj for o in gc.get_objects())


def test_a_frozen_heap_skips_what_was_alive_and_still_collects_what_is_new() -> None:
    before = [object()]  # a container: tracked by the collector
    assert _is_tracked(before)
    with frozen_heap() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0  # frozen objects freed leave the count
        assert not _is_tracked(before)
        cycle: list[object] = []
        cycle.append(cycle)  # garbage only the collector can free
        collected_before = gc.get_stats()[2]["collected"]
        del cycle
        gc.collect()
        assert gc.get_stats()[2]["collected"] > collected_before
    assert gc.get_freeze_count() == 0
    assert _is_tracked(before)


def test_the_server_serves_with_its_startup_heap_frozen_and_unfreezes_on_shutdown() -> None:
    from slipstream.service.api.server import run
    from slipstream.service.engine.loader import load_engine

    seen: list[int] = []

    def on_ready(port: int, engine: object) -> None:
        seen.append(gc.get_freeze_count())
        os.kill(os.getpid(), signal.SIGTERM)  # the server's own handler: it drains and returns

    asyncio.run(run(lambda: load_engine(CONFIG), "127.0.0.1", 0, 0.5, on_ready=on_ready))
    # The model, torch and the rest: far more than a bare interpreter's ~8,000.
    assert seen and seen[0] > 100_000
    assert gc.get_freeze_count() == 0

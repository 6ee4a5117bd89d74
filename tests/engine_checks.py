"""Checks of a started engine that hold on any device (the CPU's tests and
the GPU's run the same ones)."""

from __future__ import annotations

import time
from typing import Any

from slipstream.scheduler.request import FinishReason
from slipstream.service.engine.engine import _Collector
from slipstream.service.engine.events import RequestSpec


def check_cancel_and_deadline_free_every_block(engine: Any) -> Any:
    """A request cancelled mid-stream and one whose deadline passes while it
    is held both end at once and leave no block used; returns the stats."""
    long = RequestSpec(
        req_id="long", prompt_token_ids=[5, 6, 7], max_new_tokens=1000, ignore_eos=True
    )
    timed = RequestSpec(
        req_id="timed",
        prompt_token_ids=[8, 9],
        max_new_tokens=1000,
        ignore_eos=True,
        expected_output_tokens=4,  # feasible at the door; held below, it runs out
        deadline=time.monotonic() + 0.5,
    )
    collectors = {r.req_id: _Collector() for r in (long, timed)}
    engine.submit(timed, collectors["timed"].on_event)
    give_up = time.monotonic() + 30.0
    # Held only once it has run: held before its first step, it could be
    # refused as infeasible (REJECTED) instead, which is not what this checks.
    while not (collectors["timed"].token_ids or collectors["timed"].finish):
        assert time.monotonic() < give_up
        time.sleep(0.001)
    engine.pause(["timed"])  # held, its deadline still runs: it cannot finish first
    engine.submit(long, collectors["long"].on_event)
    while len(collectors["long"].token_ids) < 5:
        assert time.monotonic() < give_up
        time.sleep(0.001)
    engine.abort("long")
    cancelled = collectors["long"].wait("long")
    expired = collectors["timed"].wait("timed")
    assert cancelled.finish.reason is FinishReason.CANCELLED
    assert cancelled.finish.num_output_tokens == len(cancelled.token_ids)
    assert expired.finish.reason is FinishReason.DEADLINE_EXCEEDED, expired.finish
    assert engine.wait_idle(5.0)
    stats = engine.stats()
    assert (stats.device_blocks.used, stats.host_blocks.used, stats.running) == (0, 0, 0)
    return stats

"""A short soak of issue 31's mix against a spawned ``slipstream serve
--model tiny``: deadline-bearing (some infeasible), cancelled, disconnected
and mixed-class traffic at a moderate load must not be refused for capacity
(QUEUE_FULL, OVERLOADED) while the engine runs under half its capacity."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from slipstream.service.bench import soak


@pytest.mark.usefixtures("tiny_model_dir")
def test_the_mix_at_moderate_load_is_never_refused_for_capacity() -> None:
    args = argparse.Namespace(
        model="tiny",
        dtype="float32",
        threads=None,
        minutes=0.4,
        load=0.1,
        calibrate_s=4.0,
        calibrate_in_flight=32,
        interval=5.0,
        slow_reader_grace=2.0,
        max_outbox_events=64,
        stall_every=0.0,
        seed=3,
    )
    with soak.spawned(args) as (pid, target):
        report = asyncio.run(soak._soak(args, pid, target))
    summary = report["summary"]
    assert isinstance(summary, dict)
    outcomes = summary["outcomes"]
    # The mix ran: mixed streams, cancels, deadlines and dropped streams.
    for kind in ("mixed", "cancel", "deadline", "disconnect"):
        assert any(key.startswith(f"{kind}:") for key in outcomes), (kind, outcomes)
    # Under half the mix's capacity measured before and after.
    assert summary["offered_share_of_capacity"] < 0.5, summary
    assert summary["offered_share_of_capacity_after"] < 0.5, summary
    assert summary["capacity_refusals"] == 0, summary["capacity_refusal_samples"]
    assert not soak.refused_with_room(summary)
    assert summary["leaked_device_blocks"] == 0 and summary["leaked_host_blocks"] == 0
    # Every deadline refused as infeasible was shorter than (or within the
    # margin of) what the request needs alone.
    assert summary["infeasible_unjustified"] == 0, summary["infeasible_unjustified_samples"]

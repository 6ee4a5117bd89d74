"""The capacity ``bench soak`` offers a fraction of: its own mix (the same
kinds, weights and clients as the run, less the stopped readers) in a
closed loop, ``in_flight`` arrivals always in flight.

A closed loop offers no more than the server takes in, so what it gets
through is the server's capacity for this mix at that concurrency, whatever
the mix asks per arrival; an open loop at a fraction of it keeps fewer in
flight on average. Capacity measured on another mix does not carry over:
a plain request asks 16-48 tokens, an arrival of the mix about 156 on
average (streams of 1-6 requests, 400-token cancels and deadlines, 200-600
token disconnects), so a load set from plain requests offered the mix
several times what the server serves.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

from slipstream.service.bench.soak_clients import Clients, Load, draw_kind

# Kinds whose client keeps its arrival open long after the server's part is
# done (a slow reader pauses for the server's grace): in the closed loop they
# run beside the places in flight instead of holding one idle for seconds,
# and end with the measurement.
DWELLING = ("slow",)


@dataclass(frozen=True, slots=True)
class MixCapacity:
    """What the soak's own mix got through with ``in_flight`` arrivals always
    in flight (a closed loop, the same clients as the run) over ``seconds``:
    the capacity the run offers a fraction of. ``asked_tokens`` is every
    submit's max_new_tokens, ``read_tokens`` what the readers that read saw
    generated (cancels, deadlines and disconnects end short of what they
    asked). ``load_average`` is the machine's (one minute) at the end: on a
    machine shared with other work the capacity moves with it."""

    in_flight: int
    seconds: float
    arrivals: int
    asked_tokens: int
    read_tokens: int
    load_average: float = 0.0

    @property
    def arrivals_per_s(self) -> float:
        return self.arrivals / self.seconds

    @property
    def asked_tokens_per_s(self) -> float:
        return self.asked_tokens / self.seconds

    @property
    def read_tokens_per_s(self) -> float:
        return self.read_tokens / self.seconds

    def rate_at(self, load: float) -> float:
        """Arrivals per second of the mix that offer ``load`` of this capacity."""
        if self.arrivals == 0:
            raise RuntimeError(f"no arrival of the mix finished in {self.seconds:.0f} s")
        return load * self.arrivals_per_s

    def describe(self) -> dict[str, float]:
        return {
            "in_flight": self.in_flight,
            "seconds": self.seconds,
            "arrivals": self.arrivals,
            "arrivals_per_s": self.arrivals_per_s,
            "asked_tokens_per_s": self.asked_tokens_per_s,
            "read_tokens_per_s": self.read_tokens_per_s,
            "machine_load_average": self.load_average,
        }


async def measure_mix_capacity(
    clients: Clients, load: Load, in_flight: int, seconds: float
) -> MixCapacity:
    """The mix with ``in_flight`` arrivals always in flight for ``seconds``,
    then until the last of them finishes; what they ask and read is counted
    in ``load``. The dwelling kinds' clients still pausing then are ended."""
    started = time.monotonic()
    end = started + seconds
    arrivals = 0
    beside: set[asyncio.Task[None]] = set()

    async def place() -> None:
        nonlocal arrivals
        while time.monotonic() < end:
            kind = draw_kind(load.rng)
            arrival = clients.arrival(load, kind, arrivals)
            arrivals += 1
            if kind in DWELLING:
                beside.add(asyncio.ensure_future(arrival))
            else:
                await arrival

    await asyncio.gather(*(place() for _ in range(in_flight)))
    elapsed = time.monotonic() - started
    for task in beside:  # pausing past the time measured, for nothing
        task.cancel()
    await asyncio.gather(*beside, return_exceptions=True)
    read_tokens = load.output_tokens + clients.output_tokens
    return MixCapacity(
        in_flight, elapsed, arrivals, load.offered_tokens, read_tokens, os.getloadavg()[0]
    )

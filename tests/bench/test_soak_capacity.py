"""The load ``bench soak`` offers is a fraction of the capacity measured on
its own mix: fake clients and a fake clock, no server."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from slipstream.service.bench import soak, soak_capacity
from slipstream.service.bench.soak_capacity import MixCapacity, measure_mix_capacity
from slipstream.service.bench.soak_clients import KINDS, WEIGHTS, Load, SharedStream

# What an arrival of each kind asks (max_new_tokens, a mixed stream's summed):
# a plain request asks a fraction of the others, as in the real mix.
ASKED = {"plain": 32, "mixed": 226, "cancel": 400, "deadline": 400, "disconnect": 400, "slow": 64}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class SerialServer:
    """Clients of a server that generates ``tokens_per_s`` whatever the mix:
    each arrival takes its asked tokens' time on the fake clock."""

    def __init__(self, clock: FakeClock, tokens_per_s: float) -> None:
        self.clock = clock
        self.tokens_per_s = tokens_per_s
        self.kinds: Counter[str] = Counter()
        self.output_tokens = 0

    async def _serve(self, load: Load, kind: str) -> None:
        self.kinds[kind] += 1
        load.offered_tokens += ASKED[kind]
        load.output_tokens += ASKED[kind]
        self.clock.now += ASKED[kind] / self.tokens_per_s
        await asyncio.sleep(0)

    def arrival(self, load: Load, kind: str, index: int) -> object:
        return self._serve(load, kind)


def test_the_offered_load_asks_load_times_what_the_server_serves_of_the_mix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rate is in arrivals of the mix, measured on the mix: at --load 0.8
    the run asks 0.8 of the tokens per second the server gets through. A
    rate from plain requests (32 tokens each) asked the mix's ~156 tokens
    per arrival at that many arrivals: ~4x the server."""
    clock = FakeClock()
    monkeypatch.setattr(soak_capacity, "time", clock)
    server = SerialServer(clock, tokens_per_s=5_000.0)
    load = Load(random.Random(1), vocab=1000)

    capacity = asyncio.run(measure_mix_capacity(server, load, in_flight=8, seconds=60.0))  # type: ignore[arg-type]

    assert set(server.kinds) == set(KINDS)  # the run's whole mix, not plain requests
    assert capacity.asked_tokens_per_s == pytest.approx(5_000.0, rel=0.01)
    asked_per_arrival = sum(w * ASKED[k] for k, w in zip(KINDS, WEIGHTS, strict=True))
    offered_tokens_per_s = capacity.rate_at(0.8) * asked_per_arrival
    assert offered_tokens_per_s == pytest.approx(0.8 * 5_000.0, rel=0.05)


def test_the_capacity_is_drawn_in_the_mixs_proportions(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(soak_capacity, "time", clock)
    server = SerialServer(clock, tokens_per_s=50_000.0)
    capacity = asyncio.run(
        measure_mix_capacity(server, Load(random.Random(3), 1000), in_flight=4, seconds=100.0)  # type: ignore[arg-type]
    )
    assert capacity.arrivals == sum(server.kinds.values()) > 20_000
    for kind, weight in zip(KINDS, WEIGHTS, strict=True):
        assert server.kinds[kind] / capacity.arrivals == pytest.approx(weight, abs=0.01), kind


def test_a_slow_reader_does_not_hold_a_place_in_flight() -> None:
    """A slow reader's client pauses for seconds after the server's part is
    done: in the closed loop it runs beside the places, and is ended once
    the capacity is measured."""
    dwell_s = 30.0

    class Dwelling:
        output_tokens = 0
        started_slow = 0
        ended_slow = 0

        async def _arrive(self, load: Load, kind: str) -> None:
            load.offered_tokens += ASKED[kind]
            if kind == "slow":
                self.started_slow += 1
                try:
                    await asyncio.sleep(dwell_s)
                finally:
                    self.ended_slow += 1
            else:
                await asyncio.sleep(0)

        def arrival(self, load: Load, kind: str, index: int) -> object:
            return self._arrive(load, kind)

    async def measure() -> tuple[MixCapacity, float]:
        started = asyncio.get_running_loop().time()
        capacity = await measure_mix_capacity(clients, load, in_flight=2, seconds=0.2)  # type: ignore[arg-type]
        return capacity, asyncio.get_running_loop().time() - started

    clients = Dwelling()
    load = Load(random.Random(5), 1000)
    capacity, took_s = asyncio.run(measure())
    # Held places would have stopped both within ~30 arrivals.
    assert capacity.arrivals > 200
    assert clients.ended_slow == clients.started_slow > 0
    assert capacity.seconds < took_s < dwell_s


def test_no_arrival_is_no_capacity_to_offer_a_fraction_of() -> None:
    with pytest.raises(RuntimeError, match="no arrival of the mix finished"):
        MixCapacity(in_flight=32, seconds=15.0, arrivals=0, asked_tokens=0, read_tokens=0).rate_at(
            0.8
        )


def summary(before: float, after: float, refusals: int) -> dict[str, object]:
    return {
        "offered_share_of_capacity": before,
        "offered_share_of_capacity_after": after,
        "capacity_refusals": refusals,
    }


def test_a_refusal_with_room_is_judged_against_the_lower_capacity() -> None:
    assert soak.refused_with_room(summary(0.3, 0.4, refusals=1))
    assert not soak.refused_with_room(summary(0.3, 0.4, refusals=0))
    # The machine slowed during the run: after it, the load was 0.6 of it.
    assert not soak.refused_with_room(summary(0.3, 0.6, refusals=1))


# ---------------------------------------------------------------- the deadline kind


class OneFinish:
    """A Generate call answering every submit with one Finished."""

    def __init__(self, finished: object) -> None:
        self.finished = finished
        self.responses: asyncio.Queue[object] = asyncio.Queue()

    async def write(self, message: object) -> None:
        from slipstream.v1 import inference_pb2 as pb

        if message.HasField("submit"):  # type: ignore[attr-defined]
            response = pb.GenerateResponse(request_id=message.submit.request_id)  # type: ignore[attr-defined]
            response.finished.CopyFrom(self.finished)
            await self.responses.put(response)

    def __aiter__(self) -> OneFinish:
        return self

    async def __anext__(self) -> object:
        return await self.responses.get()

    def cancel(self) -> None:
        pass


def deadline_outcome(total_s: float) -> dict[str, int]:
    """The outcome of a deadline request (30-200 ms) that finished all its
    tokens after ``total_s`` by the server's clock."""
    from google.protobuf.duration_pb2 import Duration

    from slipstream.v1 import inference_pb2 as pb

    finished = pb.Finished(reason=pb.FINISH_REASON_MAX_TOKENS)
    finished.timings.total.CopyFrom(Duration(nanos=int(total_s * 1e9)))

    async def run() -> dict[str, int]:
        class Stub:
            def Generate(self) -> OneFinish:
                return OneFinish(finished)

        stream = SharedStream(Stub())
        load = Load(random.Random(0), 1000)
        await stream.run(load, "deadline", 0)
        stream.reader.cancel()
        return {"errors": len(load.interval.errors), **load.outcomes}

    return asyncio.run(run())


def test_a_deadline_met_is_no_error_and_one_missed_is() -> None:
    """400 tokens can take under 0.2 s on a quiet fast machine: finished
    within its timeout, the request met its deadline."""
    assert deadline_outcome(total_s=0.01) == {"errors": 0, "deadline: MAX_TOKENS": 1}
    assert deadline_outcome(total_s=0.5) == {"errors": 1, "deadline: MAX_TOKENS": 1}

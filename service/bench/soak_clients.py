"""The clients of ``slipstream bench soak``: one coroutine per kind of
request in its mix, the stopped reader (a child process of this module:
``python -m slipstream.service.bench.soak_clients TARGET TAG``), and the
``Load`` they all record what happened in."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field

# Refused for capacity (the reject reasons' lower-case names).
CAPACITY_REASONS = ("queue_full", "overloaded")

# The mix: each arrival is one of these kinds, drawn with these weights.
KINDS = ("plain", "mixed", "cancel", "deadline", "disconnect", "slow")
WEIGHTS = (0.5, 0.2, 0.075, 0.075, 0.075, 0.075)


def draw_kind(rng: random.Random) -> str:
    return rng.choices(KINDS, WEIGHTS)[0]


@dataclass(slots=True)
class Interval:
    """What happened between two samples."""

    finished: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Load:
    rng: random.Random
    vocab: int
    grace_s: float = 10.0  # the server's --slow-reader-grace
    interval: Interval = field(default_factory=Interval)
    outcomes: dict[str, int] = field(default_factory=dict)  # "kind: outcome" -> count
    started: float = field(default_factory=time.monotonic)
    # Refusals by reject reason, and by minute of the run then reason.
    refusals: dict[str, int] = field(default_factory=dict)
    refusal_minutes: dict[int, dict[str, int]] = field(default_factory=dict)
    refusal_samples: list[str] = field(default_factory=list)
    offered_tokens: int = 0  # max_new_tokens of every submit
    # Mixed requests refused DEADLINE_INFEASIBLE: (timeout_s, max_new_tokens),
    # checked afterwards against the isolated service time of that many tokens.
    infeasible: list[tuple[float, int]] = field(default_factory=list)
    infeasible_messages: list[str] = field(default_factory=list)  # the first and last five
    abandoned_in_queue: int = 0  # mixed requests queued, then found hopeless at the load
    output_tokens: int = 0  # generated tokens seen by the readers that read them

    def refused(self, finished: object) -> None:
        """Counts a REJECTED finish by its reject reason."""
        from slipstream.service.api.status import reject_reason_name

        reason = reject_reason_name(finished.reject_reason)  # type: ignore[attr-defined]
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        minute = self.refusal_minutes.setdefault(int((time.monotonic() - self.started) // 60), {})
        minute[reason] = minute.get(reason, 0) + 1
        if reason in CAPACITY_REASONS and len(self.refusal_samples) < 10:
            self.refusal_samples.append(finished.message)  # type: ignore[attr-defined]
        if reason == "deadline_infeasible":  # the estimate that decided it, over the run
            minute_s = f"{time.monotonic() - self.started:.0f}s: "
            self.infeasible_messages.append(minute_s + finished.message)  # type: ignore[attr-defined]
            del self.infeasible_messages[5:-5]

    def prompt(self) -> list[int]:
        return [self.rng.randrange(5, self.vocab) for _ in range(self.rng.randint(8, 48))]

    def record(
        self, kind: str, error: str | None, latency_s: float | None = None, outcome: str = ""
    ) -> None:
        key = f"{kind}: {outcome or error or 'ok'}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        self.interval.finished += 1
        self.interval.by_kind[kind] = self.interval.by_kind.get(kind, 0) + 1
        if error:
            self.interval.errors.append(f"{kind}: {error}")
        if latency_s is not None:
            self.interval.latencies_s.append(latency_s)


# ---------------------------------------------------------------- one request of each kind


def _submit(
    pb: object,
    request_id: str,
    ids: list[int],
    max_tokens: int,
    ignore_eos: bool = True,
    load: Load | None = None,
    **extra: object,
) -> object:
    if load is not None:
        load.offered_tokens += max_tokens
    return pb.GenerateRequest(  # type: ignore[attr-defined]
        submit=pb.Submit(  # type: ignore[attr-defined]
            request_id=request_id,
            token_ids=pb.TokenIds(ids=ids),  # type: ignore[attr-defined]
            stopping=pb.StoppingCriteria(max_new_tokens=max_tokens, ignore_eos=ignore_eos),  # type: ignore[attr-defined]
            **extra,
        )
    )


async def mixed_stream(load: Load, stub: object, index: int) -> None:
    """mixed: issue 31's stream of 1-6 requests on a stream of its own."""
    import grpc
    from google.protobuf.duration_pb2 import Duration

    from slipstream.v1 import inference_pb2 as pb

    rng = load.rng
    num_requests = rng.randint(1, 6)
    cancels: list[tuple[float, str]] = []
    asked: dict[str, tuple[float, int]] = {}  # request id -> (timeout_s, max_new_tokens)
    call = stub.Generate()  # type: ignore[attr-defined]
    error = None
    reasons: list[str] = []
    try:
        for i in range(num_requests):
            request_id = f"mixed-{index}-{i}"
            extra: dict[str, object] = {"priority": rng.randint(0, 3)}
            if rng.random() < 0.3:
                timeout = rng.choice((0.05, 0.3, 1.0, 3.0))
                extra["timeout"] = Duration(seconds=int(timeout), nanos=int(timeout % 1 * 1e9))
            max_tokens = rng.randint(1, 128)
            if "timeout" in extra:
                asked[request_id] = (timeout, max_tokens)
            ignore_eos = rng.random() < 0.5
            await call.write(
                _submit(pb, request_id, load.prompt(), max_tokens, ignore_eos, load, **extra)
            )
            if rng.random() < 0.2:
                cancels.append((rng.uniform(0.0, 0.5), request_id))
        for delay, request_id in sorted(cancels):
            await asyncio.sleep(delay)
            await call.write(pb.GenerateRequest(cancel=pb.Cancel(request_id=request_id)))
        await call.done_writing()
        while (response := await call.read()) is not grpc.aio.EOF:
            event = response.WhichOneof("event")
            if event == "chunk":
                load.output_tokens += len(response.chunk.token_ids)
            elif event == "finished":
                finished = response.finished
                reasons.append(pb.FinishReason.Name(finished.reason).removeprefix("FINISH_REASON_"))
                if finished.reason == pb.FINISH_REASON_REJECTED:
                    load.refused(finished)
                    if finished.reject_reason == pb.REJECT_REASON_DEADLINE_INFEASIBLE:
                        # Refused at the door ("running alone it needs"), or
                        # queued, then given up at the load it met ("at the
                        # current load"): only the first is about its own time.
                        if "at the current load" in finished.message:
                            load.abandoned_in_queue += 1
                        else:
                            load.infeasible.append(asked[response.request_id])
        if len(reasons) != num_requests or "ERROR" in reasons:
            error = f"finished {'+'.join(sorted(set(reasons)))}"
    except Exception as exc:  # an RpcError nobody asked for
        error = f"{type(exc).__name__} {getattr(exc, 'code', lambda: None)()}"
    finally:
        load.record("mixed", error, outcome="+".join(sorted(set(reasons))))


async def own_stream(load: Load, stub: object, kind: str, index: int) -> None:
    """disconnect / slow: a stream of their own."""
    import grpc

    from slipstream.v1 import inference_pb2 as pb

    rng = load.rng
    num_requests = 1
    max_tokens = rng.randint(200, 600) if kind == "disconnect" else 64
    call = stub.Generate()  # type: ignore[attr-defined]
    error = None
    outcome = ""
    try:
        for i in range(num_requests):
            prompt = load.prompt()
            await call.write(_submit(pb, f"{kind}-{index}-{i}", prompt, max_tokens, load=load))
        await call.done_writing()
        if kind == "disconnect":
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            call.cancel()
            return
        # slow: a few events read slowly, then none at all until the server gives up.
        for _ in range(rng.randint(1, 5)):
            await call.read()
            await asyncio.sleep(0.2)
        await asyncio.sleep(load.grace_s + 3.0)
        reasons = []
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.WhichOneof("event") == "finished":
                reasons.append(response.finished.reason)
        names = sorted({pb.FinishReason.Name(r).removeprefix("FINISH_REASON_") for r in reasons})
        outcome = "+".join(names)
        if len(reasons) != num_requests or not set(names) <= {"SLOW_READER", "MAX_TOKENS"}:
            error = f"finished {outcome}"
    except asyncio.CancelledError:  # the soak is done with it (the calibration's)
        call.cancel()
        outcome = "ended by the soak"
        raise
    except Exception as exc:  # an RpcError nobody asked for
        code = getattr(exc, "code", lambda: None)()
        if not (kind == "disconnect" and code is not None and code.name == "CANCELLED"):
            error = f"{type(exc).__name__} {code}"
    finally:
        load.record(kind, error, outcome=outcome or ("cancelled" if kind == "disconnect" else ""))


class SharedStream:
    """plain / cancel / deadline requests multiplexed on one long-lived stream."""

    def __init__(self, stub: object) -> None:
        self.call = stub.Generate()  # type: ignore[attr-defined]
        self.waiters: dict[str, asyncio.Future[object]] = {}
        self.output_tokens = 0
        self.reader = asyncio.ensure_future(self._read())
        self._write_lock = asyncio.Lock()  # one write at a time on a call

    async def write(self, message: object) -> None:
        async with self._write_lock:
            await self.call.write(message)

    async def _read(self) -> None:
        async for response in self.call:
            if response.WhichOneof("event") == "chunk":
                self.output_tokens += len(response.chunk.token_ids)
            if response.WhichOneof("event") == "finished":
                future = self.waiters.pop(response.request_id, None)
                if future is not None and not future.done():
                    future.set_result(response.finished)

    async def run(self, load: Load, kind: str, index: int) -> None:
        from google.protobuf.duration_pb2 import Duration

        from slipstream.v1 import inference_pb2 as pb

        rng = load.rng
        request_id = f"{kind}-{index}"
        extra: dict[str, object] = {}
        timeout_s = rng.uniform(0.03, 0.2) if kind == "deadline" else 0.0
        if kind == "deadline":
            extra["timeout"] = Duration(nanos=int(timeout_s * 1e9))
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.waiters[request_id] = future
        started = time.monotonic()
        max_tokens = rng.randint(16, 48) if kind == "plain" else 400
        await self.write(_submit(pb, request_id, load.prompt(), max_tokens, load=load, **extra))
        if kind == "cancel":
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            await self.write(pb.GenerateRequest(cancel=pb.Cancel(request_id=request_id)))
        try:
            finished = await asyncio.wait_for(future, timeout=300)
        except TimeoutError:
            load.record(kind, "no Finished within 300 s")
            return
        expected = {
            "plain": pb.FINISH_REASON_MAX_TOKENS,
            "cancel": pb.FINISH_REASON_CANCELLED,
            "deadline": pb.FINISH_REASON_DEADLINE_EXCEEDED,
        }[kind]
        reason = finished.reason  # type: ignore[attr-defined]
        if reason == pb.FINISH_REASON_REJECTED:
            load.refused(finished)
        outcome = pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_")
        error = None if reason == expected else f"finished {pb.FinishReason.Name(reason)}"
        if kind == "deadline" and finished.reject_reason == pb.REJECT_REASON_DEADLINE_INFEASIBLE:  # type: ignore[attr-defined]
            error = None  # refused at once as unreachable: also what was asked for
        if kind == "cancel" and reason == pb.FINISH_REASON_MAX_TOKENS:
            error = None  # finished before the cancel arrived
        if kind == "deadline" and reason == pb.FINISH_REASON_MAX_TOKENS:
            # 400 tokens can take under 0.2 s alone: met its deadline by the
            # server's clock, it is no error; finished past it, it is one.
            total = finished.timings.total  # type: ignore[attr-defined]
            if total.seconds + total.nanos / 1e9 <= timeout_s:
                error = None
        latency = time.monotonic() - started if kind == "plain" else None
        load.record(kind, error, latency, outcome)


class Clients:
    """Starts one arrival of a kind of the mix on a run's channels: plain,
    cancel and deadline on a few shared streams, the others on streams of
    their own (slow readers on ``slow_channel``, whose window stays small)."""

    def __init__(self, channel: object, slow_channel: object, num_shared: int = 4) -> None:
        from slipstream.v1 import inference_pb2_grpc as pb_grpc

        self._stub = pb_grpc.InferenceStub(channel)
        self._slow_stub = pb_grpc.InferenceStub(slow_channel)
        self.shared = [SharedStream(self._stub) for _ in range(num_shared)]

    def arrival(self, load: Load, kind: str, index: int) -> Coroutine[object, object, None]:
        if kind == "mixed":
            return mixed_stream(load, self._stub, index)
        if kind in ("disconnect", "slow"):
            stub = self._slow_stub if kind == "slow" else self._stub
            return own_stream(load, stub, kind, index)
        return self.shared[index % len(self.shared)].run(load, kind, index)

    @property
    def output_tokens(self) -> int:
        """Tokens read on the shared streams (the others count in their Load)."""
        return sum(stream.output_tokens for stream in self.shared)

    def close(self) -> None:
        for stream in self.shared:
            stream.call.cancel()


# ---------------------------------------------------------------- a stopped reader


async def stalled_client(load: Load, target: str, index: int) -> None:
    """One stopped reader (``stalled``): a child process of this module."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "slipstream.service.bench.soak_clients",
        target,
        f"stalled-{index}",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    error = None
    outcome = ""
    stage = "starting"
    try:
        await asyncio.wait_for(proc.stdout.readline(), timeout=60)  # "sent"
        stage = "stopped"
        proc.send_signal(signal.SIGSTOP)
        # The kernel's socket buffers and the HTTP/2 window absorb a little;
        # the server pauses the stream after that.
        # Under load its tokens come slowly: give the buffers time to fill.
        await asyncio.sleep(load.grace_s + 40.0)
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        stage = "reading"
        reasons = json.loads(await asyncio.wait_for(proc.stdout.readline(), timeout=300))
        outcome = "+".join(sorted(set(reasons)))
        if len(reasons) != STALLED_REQUESTS or not set(reasons) <= {"SLOW_READER", "MAX_TOKENS"}:
            error = f"finished {outcome}"
    except (TimeoutError, json.JSONDecodeError) as exc:
        error = f"stalled client, {stage}: {exc!r}"
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        load.record("stalled", error, outcome=outcome)


STALLED_REQUESTS = 8


def _stalled_main(target: str, tag: str) -> None:
    """The stopped reader's side: submit, say "sent", and once told to go on
    read everything and print the finish reasons as JSON."""
    import grpc

    from slipstream.v1 import inference_pb2 as pb
    from slipstream.v1 import inference_pb2_grpc as pb_grpc

    go = threading.Event()

    def requests() -> Iterator[object]:
        for i in range(STALLED_REQUESTS):
            yield _submit(pb, f"{tag}-{i}", [5, 6, 7 + i], 300)
        print("sent", flush=True)
        go.wait()

    # A small window: the kernel's buffers and HTTP/2 absorb little before the server's.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    with grpc.insecure_channel(target, options=options) as channel:
        call = pb_grpc.InferenceStub(channel).Generate(requests())
        sys.stdin.readline()
        go.set()
        reasons = [
            pb.FinishReason.Name(r.finished.reason).removeprefix("FINISH_REASON_")
            for r in call
            if r.WhichOneof("event") == "finished"
        ]
    print(json.dumps(reasons), flush=True)


if __name__ == "__main__":
    _stalled_main(sys.argv[1], sys.argv[2])

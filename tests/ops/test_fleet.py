"""The local fleet really run: 3 ``tiny`` replicas behind HAProxy
(``ops/fleet/fleet.py``), one client channel sending ``GenerateOne`` calls.

- spread: 300 requests, each replica serves 20-47% of them;
- a replica killed mid-run: nothing hangs, its in-flight requests end
  UNAVAILABLE (or finish), every later request is served by the others;
- a replica drained with SIGTERM: NOT_SERVING, HAProxy stops sending to
  it, its in-flight requests finish, none is lost.

Needs Debian's ``haproxy`` (``make fleet-test`` installs it). Prints the
figures it checks (run with ``-s`` to see them).
"""

from __future__ import annotations

import collections
import importlib.util
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from slipstream.clients import Client, Generation, StreamError
from slipstream.clients.balancing import channel_options, service_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed"),
]
REPO = Path(__file__).resolve().parents[2]
SERVE_ARGS = ("--dtype", "float32", "--threads", "1", "--no-calibrate", "--grace-s", "60")


def load_fleet_module() -> ModuleType:
    path = REPO / "ops" / "fleet" / "fleet.py"
    spec = importlib.util.spec_from_file_location("slipstream_fleet", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    module = load_fleet_module()
    fleet = module.Fleet(
        3, free_port(), "tiny", tmp_path_factory.mktemp("fleet"), serve_args=SERVE_ARGS
    )
    fleet.start(timeout_s=600)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def client(fleet: object) -> Iterator[Client]:
    # One channel to the balancer; a call refused before its first response
    # (UNAVAILABLE: a replica going away) is retried, and so re-balanced.
    options = channel_options(service_config(health_service=None))
    with Client(fleet.target, options=options) as c:  # type: ignore[attr-defined]
        yield c


DETAILS: list[str] = []  # of failed calls, for the printed figures


def outcome(generation: Generation, timeout_s: float) -> str:
    """``ok``, a finish reason, or the status code of a failed call."""
    try:
        result = generation.result(timeout=timeout_s)
    except StreamError as exc:
        DETAILS.append(f"{exc.code}: {exc.details}")
        return exc.code
    return "ok" if result.is_ok else result.finish_reason


def served(fleet: object, indices: list[int]) -> list[float]:
    return [fleet.finished_requests(i) for i in indices]  # type: ignore[attr-defined]


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="slipstream.v1.Inference"), timeout=5
        )
    return reply.status


def test_300_requests_spread_over_3_replicas(fleet: object, client: Client) -> None:
    before = served(fleet, [0, 1, 2])
    started = time.monotonic()
    generations = [
        client.generate_one([5 + i % 50, 6, 7], request_id=f"s{i}", max_tokens=4)
        for i in range(300)
    ]
    outcomes = collections.Counter(outcome(g, 120) for g in generations)
    wall = time.monotonic() - started
    shares = [(a - b) / 300 for a, b in zip(served(fleet, [0, 1, 2]), before, strict=True)]
    print(f"\nspread: {outcomes} in {wall:.1f} s, shares {[f'{s:.1%}' for s in shares]}")
    assert outcomes == {"ok": 300}
    assert all(0.20 <= share <= 0.47 for share in shares), shares


def test_a_killed_replica_fails_only_its_in_flight_requests(fleet: object, client: Client) -> None:
    running = [
        client.generate_one([9, 10 + i], request_id=f"k{i}", max_tokens=300, ignore_eos=True)
        for i in range(12)
    ]
    for generation in running:
        next(iter(generation))  # every request has its first token: in flight
    fleet.kill(2)  # type: ignore[attr-defined]
    started = time.monotonic()
    in_flight = collections.Counter(outcome(g, 120) for g in running)
    elapsed = time.monotonic() - started
    print(f"\nkill: in-flight outcomes {dict(in_flight)} in {elapsed:.1f} s; {set(DETAILS)}")
    # HAProxy ends a stream whose backend died with no grpc-status (gRPC's
    # UNKNOWN "Stream removed"); the client reports it as UNAVAILABLE.
    assert set(in_flight) <= {"ok", "UNAVAILABLE"}, in_flight
    assert in_flight["UNAVAILABLE"] >= 1  # a third of them were on the killed replica
    assert elapsed < 30  # nothing hangs
    before = served(fleet, [0, 1])
    later = [client.generate_one([11, i], request_id=f"l{i}", max_tokens=4) for i in range(30)]
    later_outcomes = collections.Counter(outcome(g, 60) for g in later)
    after = served(fleet, [0, 1])
    print(f"kill: later requests {dict(later_outcomes)}")
    assert later_outcomes == {"ok": 30}
    assert sum(after) - sum(before) == 30


def test_a_drained_replica_finishes_its_requests_and_gets_no_new_ones(
    fleet: object, client: Client
) -> None:
    replica = fleet.replicas[1]  # type: ignore[attr-defined]
    running = [
        client.generate_one([13, i], request_id=f"d{i}", max_tokens=200, ignore_eos=True)
        for i in range(8)
    ]
    for generation in running:
        next(iter(generation))
    served_before = served(fleet, [0])[0]
    fleet.drain(1)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while health(replica.target) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "still SERVING after SIGTERM"
        time.sleep(0.05)
    deadline = time.monotonic() + 5
    while fleet.server_states()["r1"] == "UP":  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "HAProxy still sends to the draining replica"
        time.sleep(0.05)
    later = [client.generate_one([15, i], request_id=f"n{i}", max_tokens=4) for i in range(20)]
    later_outcomes = collections.Counter(outcome(g, 60) for g in later)
    in_flight = collections.Counter(outcome(g, 120) for g in running)
    served_after = served(fleet, [0])[0]
    print(f"\ndrain: in-flight {dict(in_flight)}, later {dict(later_outcomes)}")
    assert in_flight == {"ok": 8}  # zero lost: the drained replica's finished too
    assert later_outcomes == {"ok": 20}
    # Every later request went to replica 0, plus its share of the running ones.
    assert served_after - served_before >= 20
    assert fleet.procs[1].wait(timeout=60) == 0  # type: ignore[attr-defined]

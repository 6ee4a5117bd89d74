"""Client-side balancing over two real servers (two ``tiny`` engines on
loopback): round_robin spreads ``generate_one`` calls, client health checking
stops sending to a draining replica, and the retry policy re-sends a call a
draining replica refused (UNAVAILABLE, before any response) to the other."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest

from slipstream.clients import Client
from slipstream.clients.balancing import channel_options, channel_target, service_config
from slipstream.service.api.lifecycle import Lifecycle
from slipstream.service.api.server import build_server
from slipstream.service.engine.config import EngineConfig

CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)


class Replica:
    """An engine and a server of its own, on an event loop thread; counts the
    ``GenerateOne`` calls that reached its engine."""

    def __init__(self) -> None:
        from slipstream.service.engine.loader import load_engine

        self.engine = load_engine(CONFIG)
        self.num_submits = 0
        submit = self.engine.submit

        def counting_submit(*args: object, **kwargs: object) -> None:
            submit(*args, **kwargs)  # type: ignore[arg-type]
            self.num_submits += 1

        self.engine.submit = counting_submit  # type: ignore[method-assign]
        self.lifecycle = Lifecycle(self.engine)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> tuple[object, int]:
            server, port = build_server(self.lifecycle, "127.0.0.1", 0)
            await server.start()
            await self.lifecycle.serve()
            return server, port

        self.server, port = self.run(start())  # type: ignore[misc]
        self.target = f"127.0.0.1:{port}"

    def run(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def drain(self) -> None:
        self.run(self.lifecycle.drain())

    def stop(self) -> None:
        self.run(self.server.stop(0))  # type: ignore[attr-defined]
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.engine.shutdown()


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    pair = [Replica(), Replica()]
    yield pair
    for replica in pair:
        replica.stop()


def results_ok(client: Client, count: int, tag: str) -> bool:
    generations = [
        client.generate_one([5, 6, i], request_id=f"{tag}{i}", max_tokens=3) for i in range(count)
    ]
    return all(g.result(timeout=60).is_ok for g in generations)


@pytest.mark.parametrize(
    "target",
    ["localhost", "localhost:", "[::1]", "dns:///slipstream", "ipv4:127.0.0.1:1,127.0.0.1"],
)
def test_a_target_without_a_port_is_refused(target: str) -> None:
    """gRPC dials 443 for a name without a port: never what was meant."""
    with pytest.raises(ValueError, match=r"has no port \(HOST:PORT, e\.g\. localhost:50051\)"):
        channel_target(target)


def test_a_client_without_a_port_is_refused() -> None:
    with pytest.raises(ValueError, match="address 'localhost' has no port"):
        Client("localhost")


@pytest.mark.parametrize(
    "target",
    [
        "localhost:50051",
        "[::1]:50051",
        "dns:///slipstream:50051",
        "dns://8.8.8.8/slipstream:50051",
        "ipv4:127.0.0.1:1,127.0.0.2:2",
        "ipv6:[::1]:50051",
        "unix:/run/slipstream.sock",
        "unix:///run/slipstream.sock",
        "unix-abstract:slipstream",
    ],
)
def test_a_target_with_a_port_or_a_socket_is_taken_as_is(target: str) -> None:
    assert channel_target(target) == target


def test_targets_and_service_config() -> None:
    assert channel_target(["127.0.0.1:1", "127.0.0.1:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target(["[::1]:1", "::1:2"]) == "ipv6:[::1]:1,[::1]:2"
    assert channel_target("dns:///slipstream:50051") == "dns:///slipstream:50051"
    with pytest.raises(ValueError, match="dns:///"):
        channel_target(["localhost:1"])
    with pytest.raises(ValueError, match="HOST:PORT"):
        channel_target(["127.0.0.1"])
    # gRPC would take port 70000 as 4464: refused, a string target as a list's
    for target in ("localhost:70000", ["127.0.0.1:65536"], "dns:///slipstream:99999"):
        with pytest.raises(ValueError, match="a port is 0-65535"):
            channel_target(target)
    assert channel_target("localhost:65535") == "localhost:65535"
    assert channel_target("unix:/run/slipstream.sock") == "unix:/run/slipstream.sock"
    config = json.loads(service_config())
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": "slipstream.v1.Inference"}
    (method,) = config["methodConfig"]
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert {"service": "slipstream.v1.Inference", "method": "GenerateOne"} in method["name"]
    assert all(name["method"] != "Generate" for name in method["name"])
    assert "healthCheckConfig" not in json.loads(service_config(health_service=None))
    with pytest.raises(ValueError):
        service_config(max_attempts=9)


def test_round_robin_then_health_checking_skips_a_draining_replica(
    replicas: list[Replica],
) -> None:
    a, b = replicas
    with Client([a.target, b.target]) as client:
        # Until both subchannels are READY, round_robin uses the ready one.
        assert results_ok(client, 4, "warm")
        time.sleep(0.3)
        before = (a.num_submits, b.num_submits)
        assert results_ok(client, 20, "rr")
        assert (a.num_submits - before[0], b.num_submits - before[1]) == (10, 10)
        b_before = b.num_submits
        b.drain()  # NOT_SERVING: the channel's health watch takes it out
        time.sleep(0.5)
        before = a.num_submits
        assert results_ok(client, 10, "hc")
        assert (a.num_submits - before, b.num_submits) == (10, b_before)


def test_a_call_a_draining_replica_refuses_is_retried_on_the_other(
    replicas: list[Replica],
) -> None:
    a, b = replicas
    # No health checking: the channel keeps picking b, which refuses with
    # UNAVAILABLE before any response; the retry policy sends the call to a.
    options = channel_options(service_config(health_service=None))
    with Client([a.target, b.target], options=options, balanced=False) as client:
        assert results_ok(client, 4, "warm")
        b.drain()
        before = a.num_submits
        assert results_ok(client, 10, "rt")
        assert a.num_submits - before == 10

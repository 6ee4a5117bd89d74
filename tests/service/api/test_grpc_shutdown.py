"""SIGTERM on a real ``slipstream serve`` process: health goes NOT_SERVING,
new calls and submits are refused, the running request finishes, the process
exits 0. A stop while the model is still loading ends the process at once; a
second one during the drain ends the grace."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_thread import hold_every_submit
from structlog.testing import capture_logs

from slipstream.clients import Client, Result
from slipstream.service.engine.config import EngineConfig
from slipstream.v1 import inference_pb2_grpc as pb_grpc

CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)


def health_status(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="slipstream.v1.Inference"), timeout=2
        )
    return reply.status


def test_sigterm_drains_then_exits(
    spawn_server: Callable[..., tuple[subprocess.Popen[str], str]],
) -> None:
    proc, target = spawn_server("--model", "tiny", "--grace-s", "20")
    client = Client(target)
    try:
        assert health_status(target) == health_pb2.HealthCheckResponse.SERVING
        stream = client.stream()
        running = stream.generate("drain me", max_tokens=500, ignore_eos=True)
        next(iter(running))

        proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 2
        while health_status(target) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < end, "health still SERVING after SIGTERM"
            time.sleep(0.02)

        late = stream.generate("too late", max_tokens=4).result(timeout=5)
        assert (late.finish_reason, late.reject_reason) == ("rejected", "draining")
        assert late.status_code == "UNAVAILABLE"
        with grpc.insecure_channel(target) as channel:
            new_call = pb_grpc.InferenceStub(channel).Generate(iter([]), timeout=5)
            try:
                list(new_call)
                raise AssertionError("a new call was accepted while draining")
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE

        stream.close()
        result = running.result(timeout=30)
        assert result.finish_reason == "max_tokens" and len(result.token_ids) == 500
        assert proc.wait(timeout=30) == 0
    finally:
        client.close()


def test_a_stop_while_loading_closes_the_listeners_without_waiting_for_the_load() -> None:
    from slipstream.service.api.server import run

    release = threading.Event()

    def load_forever() -> object:
        os.kill(os.getpid(), signal.SIGTERM)  # the server's own handler
        release.wait(30)
        raise RuntimeError("the load was released")

    started = time.monotonic()
    try:
        with capture_logs() as logs:
            served = asyncio.run(run(load_forever, "127.0.0.1", 0, 30.0))
        assert time.monotonic() - started < 10, "run waited for the load"
    finally:
        release.set()
    events = [line["event"] for line in logs]
    assert served is False  # the caller ends the process (os._exit) under the load
    assert "server_stopped_while_loading" in events and "server_serving" not in events
    port = next(line["port"] for line in logs if line["event"] == "server_loading")
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "still listening"


# ``slipstream serve`` whose model load never ends, busy in torch's native
# code as a real load is (a normal exit's finalization under such a thread
# aborted the process: "terminate called without an active exception", 134).
_SERVE_LOADING_FOREVER = """
import sys
import torch
from slipstream.service.engine import loader
def load_forever(config):
    a = torch.randn(512, 512)
    while True:
        a = torch.tanh(a @ a)
loader.load_engine = load_forever
from slipstream.service.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_loading_exits_0_at_once() -> None:
    command = [sys.executable, "-c", _SERVE_LOADING_FOREVER, "serve", "--model", "tiny"]
    command += ["--port", "0", "--http-port", "0", "--log-format", "json"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if '"server_loading"' in line:
                break
        else:
            raise AssertionError(f"the server exited before loading ({proc.wait()})")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        rest = proc.stderr.read()
        stopped = [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
        assert [line["event"] for line in stopped] == ["server_stopped_while_loading"]
        assert rest.rstrip().endswith("slipstream: stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_sigterm_cuts_the_drain_short(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.service.api.server import run
    from slipstream.service.engine.loader import load_engine

    def load_holding() -> object:
        engine = load_engine(CONFIG)
        hold_every_submit(engine, monkeypatch)  # its request never finishes by itself
        return engine

    outcome: list[object] = []

    def stop_twice(target: str, engine: object) -> None:
        with Client(target) as client:
            stream = client.stream()
            running = stream.generate("held", max_tokens=8)
            while not engine.live_output_counts():  # type: ignore[attr-defined]
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            while health_status(target) != health_pb2.HealthCheckResponse.NOT_SERVING:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            try:
                outcome.append(running.result(timeout=30))
            except Exception as exc:
                outcome.append(exc)

    def on_ready(port: int, engine: object) -> None:
        target = f"127.0.0.1:{port}"
        threading.Thread(target=stop_twice, args=(target, engine), daemon=True).start()

    started = time.monotonic()
    with capture_logs() as logs:
        asyncio.run(run(load_holding, "127.0.0.1", 0, 30.0, on_ready=on_ready))
    assert time.monotonic() - started < 15, "the drain waited out its grace"
    cut = [line for line in logs if line["event"] == "server_drain_cut_short"]
    assert [line["num_running"] for line in cut] == [1]
    end = time.monotonic() + 10
    while not outcome:
        assert time.monotonic() < end, "the held request never ended"
        time.sleep(0.01)
    result = outcome[0]
    assert isinstance(result, Result), result
    assert (result.finish_reason, result.status_code) == ("cancelled", "UNAVAILABLE")


def test_requests_cut_off_at_the_grace_end_shutdown_not_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Told apart from a client's cancel: reason shutdown in the metrics and
    the log, and on the wire CANCELLED with status UNAVAILABLE."""
    from opentelemetry.sdk.trace import TracerProvider

    from slipstream.service.api.server import run
    from slipstream.service.engine.loader import load_engine
    from slipstream.service.telemetry.metrics import ServerMetrics
    from slipstream.service.telemetry.tracing import Telemetry

    def load_holding() -> object:
        engine = load_engine(CONFIG)
        hold_every_submit(engine, monkeypatch)  # its request never finishes by itself
        return engine

    results: list[object] = []

    def stop_once(target: str, engine: object) -> None:
        with Client(target) as client:
            running = client.stream().generate("held", max_tokens=8)
            while not engine.live_output_counts():  # type: ignore[attr-defined]
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            try:
                results.append(running.result(timeout=30))
            except Exception as exc:
                results.append(exc)

    def on_ready(port: int, engine: object) -> None:
        target = f"127.0.0.1:{port}"
        threading.Thread(target=stop_once, args=(target, engine), daemon=True).start()

    metrics = ServerMetrics()
    telemetry = Telemetry(TracerProvider(), metrics)
    with capture_logs() as logs:
        asyncio.run(run(load_holding, "127.0.0.1", 0, 0.5, on_ready=on_ready, telemetry=telemetry))
    end = time.monotonic() + 10
    while not results:
        assert time.monotonic() < end, "the held request never ended"
        time.sleep(0.01)
    result = results[0]
    assert isinstance(result, Result), result
    assert (result.finish_reason, result.status_code) == ("cancelled", "UNAVAILABLE")
    finished = [line for line in logs if line["event"] == "request_finished"]
    assert [line["reason"] for line in finished] == ["shutdown"]
    expired = [line for line in logs if line["event"] == "server_grace_expired"]
    assert [line["num_running"] for line in expired] == [1]
    labels = {"priority": "0", "reason": "shutdown"}
    assert metrics.registry.get_sample_value("slipstream_requests_finished_total", labels) == 1


def test_health_says_not_serving_from_the_moment_the_port_listens(monkeypatch) -> None:
    """gRPC's health service says SERVING until told otherwise: a probe that
    reached the port between its start and the loading report was told the
    server serves while the model had not begun to load."""
    from slipstream.service.api import server as server_module

    seen: list[int] = []
    real_build = server_module.build_server

    def build_and_probe_at_start(*args: object, **kwargs: object) -> tuple[object, int]:
        server, bound = real_build(*args, **kwargs)
        real_start = server.start

        async def start_then_probe() -> None:
            await real_start()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{bound}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                seen.append(answer.status)

        server.start = start_then_probe
        return server, bound

    monkeypatch.setattr(server_module, "build_server", build_and_probe_at_start)

    release = threading.Event()

    def load_until_stopped() -> object:
        os.kill(os.getpid(), signal.SIGTERM)  # the server's own handler
        release.wait(30)
        raise RuntimeError("the load was released")

    try:
        served = asyncio.run(server_module.run(load_until_stopped, "127.0.0.1", 0, 30.0))
    finally:
        release.set()
    assert served is False
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING]

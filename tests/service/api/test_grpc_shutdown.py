"""SIGTERM on a real ``slipstream serve`` process: health goes NOT_SERVING,
new calls and submits are refused, the running request finishes, the process
exits 0."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from slipstream.clients import Client
from slipstream.v1 import inference_pb2_grpc as pb_grpc


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

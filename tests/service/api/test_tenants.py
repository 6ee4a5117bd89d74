"""Bearer-token tenants: the file format, authentication, per-request
permission and quota checks on a fake clock, then end to end over a real
``grpc.aio`` server on the ``tiny`` model (status codes per call and per
request, quotas released by every way a request can end, telemetry by
tenant, no token in any log line), and a ``slipstream serve`` process that
re-reads its tenants file on SIGHUP."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from polling import wait_until

from slipstream.clients import Client, StreamError
from slipstream.service.api.auth import (
    PermissionDenied,
    QuotaExceeded,
    Tenant,
    Tenants,
    TenantsFileError,
    Unauthenticated,
    parse_tenants,
    token_sha256,
)
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import RequestSpec
from slipstream.v1 import inference_pb2 as pb

CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)
SEARCH_TOKEN = "search-secret-token-1"
BATCH_TOKEN = "batch-secret-token-2"
SLOW_TOKEN = "slow-secret-token-3"
TENANTS_TOML = f"""
[tenants.search]
token_sha256 = ["{token_sha256(SEARCH_TOKEN)}"]
max_priority_class = 1
max_new_tokens = 32

[tenants.batch]
token_sha256 = ["{token_sha256(BATCH_TOKEN)}"]
max_priority_class = 2
max_inflight = 1

[tenants.slow]
token_sha256 = ["{token_sha256(SLOW_TOKEN)}"]
tokens_per_minute = 120
"""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- the file


def test_a_file_of_every_limit_parses() -> None:
    tenants = parse_tenants(TENANTS_TOML)
    assert sorted(tenants) == ["batch", "search", "slow"]
    assert tenants["search"] == Tenant(
        "search", (token_sha256(SEARCH_TOKEN),), max_priority_class=1, max_new_tokens=32
    )
    assert tenants["slow"].max_inflight is None and tenants["slow"].tokens_per_minute == 120


def test_token_hash_matches_sha256sum() -> None:
    # printf %s abc | sha256sum
    assert token_sha256("abc") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("not toml [", "not valid TOML"),
        ("", "no \\[tenants.NAME\\] tables"),
        ("[tenants.a]\nmax_inflight = 2", "token_sha256"),
        ('[tenants.a]\ntoken_sha256 = ["abc"]', "64 hex digits"),
        (f'[tenants.a]\ntoken_sha256 = ["{"a" * 64}"]\nmax_inflite = 2', "unknown keys"),
        (f'[tenants.a]\ntoken_sha256 = ["{"a" * 64}"]\nmax_inflight = 0', "max_inflight"),
        (f'[tenants.a]\ntoken_sha256 = ["{"a" * 64}"]\nmax_new_tokens = true', "integer"),
        (f'[tenants.a]\ntoken_sha256 = ["{"a" * 64}"]\nmax_priority_class = -1', ">= 0"),
        (
            f'[tenants.a]\ntoken_sha256 = ["{"a" * 64}"]\n'
            f'[tenants.b]\ntoken_sha256 = ["{"A" * 64}"]',
            "share a token",
        ),
        (f'other = 1\n[tenants.a]\ntoken_sha256 = ["{"a" * 64}"]', "top-level"),
    ],
)
def test_a_bad_file_says_what_is_wrong(text: str, complaint: str) -> None:
    with pytest.raises(TenantsFileError, match=complaint):
        parse_tenants(text)


# ---------------------------------------------------------------- authentication


def test_authenticate_finds_the_tenant_of_a_token() -> None:
    tenants = Tenants(parse_tenants(TENANTS_TOML))
    assert tenants.authenticate(f"Bearer {SEARCH_TOKEN}").name == "search"
    assert tenants.authenticate(f"bearer  {BATCH_TOKEN} ").name == "batch"
    for header, complaint in [
        (None, "missing"),
        ("", "missing"),
        (SEARCH_TOKEN, "Bearer <token>"),
        (f"Basic {SEARCH_TOKEN}", "Bearer <token>"),
        ("Bearer ", "Bearer <token>"),
        ("Bearer not-a-known-token", "unknown"),
        (f"Bearer {token_sha256(SEARCH_TOKEN)}", "unknown"),  # the hash is not the token
    ]:
        with pytest.raises(Unauthenticated, match=complaint):
            tenants.authenticate(header)


# ---------------------------------------------------------------- admission


def test_permission_is_per_request_and_never_changes_with_load() -> None:
    tenants = Tenants(parse_tenants(TENANTS_TOML))
    search = tenants.authenticate(f"Bearer {SEARCH_TOKEN}")
    with pytest.raises(PermissionDenied, match="priority class 0"):
        tenants.admit(search, priority=0, max_new_tokens=8, num_prompt_tokens=3)
    with pytest.raises(PermissionDenied, match="max_new_tokens 33"):
        tenants.admit(search, priority=1, max_new_tokens=33, num_prompt_tokens=3)
    grant = tenants.admit(search, priority=1, max_new_tokens=32, num_prompt_tokens=3)
    assert tenants.num_inflight("search") == 1
    grant.release(5)
    grant.release(5)  # once only
    assert tenants.num_inflight("search") == 0


def test_inflight_quota_frees_when_a_request_ends() -> None:
    tenants = Tenants(parse_tenants(TENANTS_TOML))
    batch = tenants.authenticate(f"Bearer {BATCH_TOKEN}")
    first = tenants.admit(batch, 2, 16, 4)
    with pytest.raises(QuotaExceeded, match="max_inflight 1") as over:
        tenants.admit(batch, 3, 16, 4)
    assert over.value.retry_after_s > 0 and "retry after" in str(over.value)
    first.release(16)
    tenants.admit(batch, 3, 16, 4).release()


def test_token_bucket_charges_prompt_and_output_and_refills() -> None:
    clock = FakeClock()
    tenants = Tenants(parse_tenants(TENANTS_TOML), clock=clock)
    slow = tenants.authenticate(f"Bearer {SLOW_TOKEN}")  # 120 tokens per minute: 2 per second
    grant = tenants.admit(slow, 0, 64, num_prompt_tokens=50)  # bucket 120 -> 70
    grant.charge(30)  # output as it is made: 40 left
    grant.release(num_output_tokens=60)  # the 30 not yet charged: 10 left
    with pytest.raises(QuotaExceeded, match="120 tokens per minute") as over:
        tenants.admit(slow, 0, 64, num_prompt_tokens=20)
    assert over.value.retry_after_s == pytest.approx(5.0)  # 10 missing at 2 per second
    clock.now += 5.0
    tenants.admit(slow, 0, 64, num_prompt_tokens=20).release(0)
    clock.now += 3600  # refills to one minute's worth, no more
    tenants.admit(slow, 0, 64, num_prompt_tokens=120).release(0)
    with pytest.raises(PermissionDenied, match="over tenant 'slow'"):
        tenants.admit(slow, 0, 64, num_prompt_tokens=121)  # could never fit


def test_a_long_answer_leaves_debt_that_delays_the_next_request() -> None:
    clock = FakeClock()
    tenants = Tenants(parse_tenants(TENANTS_TOML), clock=clock)
    slow = tenants.authenticate(f"Bearer {SLOW_TOKEN}")
    tenants.admit(slow, 0, 500, num_prompt_tokens=100).release(num_output_tokens=300)
    with pytest.raises(QuotaExceeded) as over:
        tenants.admit(slow, 0, 8, num_prompt_tokens=1)
    assert over.value.retry_after_s == pytest.approx((280 + 1) / 2)


def test_replace_keeps_usage_of_tenants_that_stay() -> None:
    tenants = Tenants(parse_tenants(TENANTS_TOML))
    batch = tenants.authenticate(f"Bearer {BATCH_TOKEN}")
    grant = tenants.admit(batch, 2, 8, 1)
    only_batch = {"batch": parse_tenants(TENANTS_TOML)["batch"]}
    tenants.replace(only_batch)
    assert tenants.names == ["batch"] and tenants.num_inflight("batch") == 1
    with pytest.raises(Unauthenticated):
        tenants.authenticate(f"Bearer {SEARCH_TOKEN}")
    grant.release(8)
    assert tenants.num_inflight("batch") == 0


def test_a_reload_that_drops_a_token_refuses_the_calls_that_hold_it() -> None:
    """A call authenticates once; each of its later requests is refused once
    a reload has dropped its token's hash (or its tenant), as a new call is."""
    old, new = token_sha256("old"), token_sha256("new")
    tenants = Tenants({"a": Tenant("a", (old, new)), "b": Tenant("b", (token_sha256("b"),))})
    kept, revoked, other = (tenants.gate(f"Bearer {t}") for t in ("new", "old", "b"))
    request = RequestSpec("r", [5, 6, 7], max_new_tokens=8)
    running = revoked.admit(request)[1]
    tenants.replace({"a": Tenant("a", (new,)), "b": Tenant("b", (token_sha256("b"),))})
    with pytest.raises(Unauthenticated, match="revoked by a tenants reload"):
        revoked.admit(request)
    assert kept.admit(request)[0].tenant == "a"
    assert tenants.num_inflight("a") == 2  # the one admitted before goes on
    running.release()
    tenants.replace({"a": Tenant("a", (new,))})
    with pytest.raises(Unauthenticated, match="removed by a tenants reload"):
        other.admit(request)


def test_a_tenant_removed_and_added_back_keeps_its_usage() -> None:
    """Two reloads (a tenant dropped by mistake, then put back) leave its
    in-flight count and its bucket's debt as they were: limits still hold."""
    clock = FakeClock()
    digest = token_sha256("t")
    a = Tenant("a", (digest,), max_inflight=2, tokens_per_minute=60)
    b = Tenant("b", (token_sha256("b"),))
    tenants = Tenants({"a": a, "b": b}, clock=clock)
    gate = tenants.gate("Bearer t")
    first, second = (tenants.admit(a, 0, 8, 10) for _ in range(2))
    first.charge(100)  # a long answer: 60 - 20 - 100 = -60, a minute of debt
    tenants.replace({"b": b})
    tenants.replace({"a": a, "b": b})
    assert tenants.num_inflight("a") == 2
    with pytest.raises(QuotaExceeded, match="2 requests in flight"):
        gate.admit(RequestSpec("r", [5], max_new_tokens=8))
    first.release()
    second.release()
    assert tenants.num_inflight("a") == 0
    with pytest.raises(QuotaExceeded, match="tokens per minute"):
        gate.admit(RequestSpec("r", [5], max_new_tokens=8))
    clock.now += 120  # settled: the next reloads may forget it
    tenants.replace({"b": b})
    tenants.replace({"a": a, "b": b})
    tenants.admit(a, 0, 8, 60).release(0)


def test_a_reload_that_adds_or_lowers_a_rate_takes_effect_at_once() -> None:
    clock = FakeClock()
    digest = token_sha256("t")
    tenants = Tenants({"a": Tenant("a", (digest,))}, clock=clock)
    a = tenants.authenticate("Bearer t")
    tenants.admit(a, 0, 8, 10_000).release(10_000)  # no rate yet: nothing counted
    tenants.replace({"a": Tenant("a", (digest,), tokens_per_minute=60)})
    tenants.admit(a, 0, 8, 60).release(0)  # a new limit starts full
    clock.now += 60  # full again: 60
    tenants.replace({"a": Tenant("a", (digest,), tokens_per_minute=40)})  # capped at 40
    tenants.admit(a, 0, 8, 30).release(0)
    with pytest.raises(QuotaExceeded):  # 10 left, not 30
        tenants.admit(a, 0, 8, 15)


# ---------------------------------------------------------------- over gRPC


class ServerThread:
    def __init__(self, engine: object, tenants: Tenants, telemetry: object) -> None:
        from slipstream.service.api.server import create_server

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        start = create_server(
            engine,  # type: ignore[arg-type]
            "127.0.0.1",
            0,
            telemetry,  # type: ignore[arg-type]
            tenants=tenants,
        )
        self.server, port = asyncio.run_coroutine_threadsafe(start, self.loop).result()
        self.target = f"127.0.0.1:{port}"
        self.http_port = asyncio.run_coroutine_threadsafe(
            self._start_http(engine, tenants, telemetry), self.loop
        ).result()

    async def _start_http(self, engine: object, tenants: Tenants, telemetry: object) -> int:
        from slipstream.service.api.http.app import HttpFront
        from slipstream.service.api.lifecycle import Lifecycle

        lifecycle = Lifecycle(engine)  # type: ignore[arg-type]
        await lifecycle.serve()
        self.http = HttpFront(lifecycle, telemetry, tenants=tenants)  # type: ignore[arg-type]
        return await self.http.start("127.0.0.1", 0)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.http.stop(), self.loop).result()
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


class Served:
    def __init__(
        self, server: ServerThread, tenants: Tenants, telemetry: object, spans: object
    ) -> None:
        self.server, self.tenants, self.telemetry = server, tenants, telemetry
        self.spans = spans  # an InMemorySpanExporter

    def client(self, token: str | None) -> Client:
        return Client(self.server.target, token=token)

    def metric(self, name: str, **labels: str) -> float:
        registry = self.telemetry.metrics.registry  # type: ignore[attr-defined]
        return registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def served(engine: object) -> Iterator[Served]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from slipstream.service.telemetry.metrics import ServerMetrics
    from slipstream.service.telemetry.tracing import Telemetry

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry = Telemetry(provider, ServerMetrics())
    tenants = Tenants(parse_tenants(TENANTS_TOML))
    server = ServerThread(engine, tenants, telemetry)
    yield Served(server, tenants, telemetry, spans)
    server.stop()


def test_calls_without_a_known_token_are_unauthenticated(served: Served) -> None:
    for token in (None, "wrong-token"):
        with served.client(token) as client:
            with pytest.raises(grpc.RpcError) as unary:
                client.model_info()
            assert unary.value.code() is grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(StreamError) as streamed:  # on submit, or when it is refused
                client.generate([5, 6, 7], max_tokens=4).result(timeout=30)
            assert streamed.value.code == "UNAUTHENTICATED"
    assert served.metric("slipstream_rejections_total", reason="unauthenticated") >= 4


def test_every_inference_method_needs_a_token(served: Served) -> None:
    """Each method of the service, called without a token, is refused
    (or not implemented yet): a new method cannot run open by mistake."""
    service = pb.DESCRIPTOR.services_by_name["Inference"]
    with grpc.insecure_channel(served.server.target) as channel:
        for method in service.methods:
            request_type = getattr(pb, method.input_type.name)
            kind = {
                (False, False): channel.unary_unary,
                (False, True): channel.unary_stream,
                (True, False): channel.stream_unary,
                (True, True): channel.stream_stream,
            }[(method.client_streaming, method.server_streaming)]
            call = kind(
                f"/{service.full_name}/{method.name}",
                request_serializer=request_type.SerializeToString,
                response_deserializer=bytes,
            )
            request = iter([request_type()]) if method.client_streaming else request_type()
            with pytest.raises(grpc.RpcError) as refused:
                response = call(request, timeout=30)
                if method.server_streaming:
                    list(response)
            assert refused.value.code() in {
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.UNIMPLEMENTED,
            }, method.name


def test_health_and_reflection_need_no_token(served: Served) -> None:
    with grpc.insecure_channel(served.server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="slipstream.v1.Inference"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
        names = {s.name for s in reply.list_services_response.service}
        assert "slipstream.v1.Inference" in names


def test_a_forbidden_request_fails_alone(served: Served) -> None:
    with served.client(SEARCH_TOKEN) as client:
        stream = client.stream()
        urgent = stream.generate([5, 6, 7], max_tokens=4, priority=0)
        greedy = stream.generate([5, 6, 7], max_tokens=33, priority=1)
        fine = stream.generate([5, 6, 7], max_tokens=4, priority=1, ignore_eos=True)
        stream.close()
        for result in (urgent.result(timeout=60), greedy.result(timeout=60)):
            assert result.finish_reason == "rejected"
            assert result.reject_reason == "permission_denied"
            assert result.status_code == "PERMISSION_DENIED"
            assert result.retry_after_s is None
        assert "priority class 0" in urgent.result().message
        assert fine.result(timeout=60).is_ok and fine.result().output_tokens == 4
    assert wait_until(lambda: served.tenants.num_inflight("search") == 0)
    served.telemetry.requests.flush(10)  # type: ignore[attr-defined]
    rejected = "slipstream_tenant_rejections_total"
    assert served.metric(rejected, tenant="search", reason="permission_denied") == 2
    finished = "slipstream_tenant_requests_finished_total"
    assert served.metric(finished, tenant="search", reason="max_tokens") >= 1
    assert served.metric("slipstream_tenant_tokens_total", tenant="search", kind="output") >= 4
    tagged = [
        span.attributes
        for span in served.spans.get_finished_spans()  # type: ignore[attr-defined]
        if span.attributes.get("slipstream.tenant") == "search"
    ]
    reasons = sorted(a.get("slipstream.rejection.reason", "ran") for a in tagged)
    assert reasons == ["permission_denied", "permission_denied", "ran"]


def test_a_request_naming_no_priority_takes_its_tenants_most_urgent_class(
    served: Served,
) -> None:
    # A caller that never heard of priorities is served, not refused for
    # class 0, the wire's zero value; one that asks for class 0 still is not.
    with served.client(BATCH_TOKEN) as client:
        plain = client.generate([5, 6, 7], max_tokens=2).result(timeout=60)
        urgent = client.generate([5, 6, 7], max_tokens=2, priority=0).result(timeout=60)
    assert plain.is_ok and urgent.reject_reason == "permission_denied"
    served.telemetry.requests.flush(10)  # type: ignore[attr-defined]
    classes = [
        span.attributes.get("slipstream.request.priority")
        for span in served.spans.get_finished_spans()  # type: ignore[attr-defined]
        if span.attributes.get("slipstream.tenant") == "batch"
        and "slipstream.rejection.reason" not in span.attributes
    ]
    assert classes == [2]  # batch's most urgent class


def test_over_the_inflight_quota_is_resource_exhausted_with_a_hint(served: Served) -> None:
    with served.client(BATCH_TOKEN) as client:
        stream = client.stream()
        long = stream.generate([5, 6, 7], max_tokens=900, ignore_eos=True, priority=2)
        next(iter(long))  # running
        second = stream.generate([8, 9], max_tokens=4, priority=2).result(timeout=60)
        assert second.reject_reason == "quota_exceeded"
        assert second.status_code == "RESOURCE_EXHAUSTED"
        assert second.retry_after_s is not None and second.retry_after_s > 0
        assert "retry after" in second.message
        long.cancel()
        assert long.result(timeout=60).finish_reason == "cancelled"
        third = stream.generate([8, 9], max_tokens=4, priority=2).result(timeout=60)
        assert third.is_ok
        stream.close()


def test_a_dropped_stream_gives_its_quota_back(served: Served) -> None:
    with served.client(BATCH_TOKEN) as client:
        stream = client.stream()
        long = stream.generate([5, 6, 7], max_tokens=900, ignore_eos=True, priority=2)
        next(iter(long))
        assert served.tenants.num_inflight("batch") == 1
        stream.abort()  # the client goes away mid-answer
    assert wait_until(lambda: served.tenants.num_inflight("batch") == 0)
    with served.client(BATCH_TOKEN) as client:
        assert client.generate([5], max_tokens=2, priority=2).result(timeout=60).is_ok


def test_token_rate_counts_output_as_it_is_made(served: Served) -> None:
    started = time.monotonic()
    with served.client(SLOW_TOKEN) as client:
        first = client.generate([5, 6, 7, 8], max_tokens=100, ignore_eos=True).result(timeout=60)
        assert first.is_ok and first.output_tokens == 100
        # 104 of 120 spent, 2 per second back since: without the output
        # counted, a 60-token prompt would fit.
        second = client.generate(list(range(5, 65)), max_tokens=4).result(timeout=60)
    refilled = 2 * (time.monotonic() - started)
    assert second.reject_reason == "quota_exceeded"
    assert second.retry_after_s is not None
    assert (60 - 16 - refilled) / 2 - 0.01 <= second.retry_after_s <= (60 - 16) / 2 + 0.01


def test_cli_takes_the_token_from_the_environment(
    served: Served, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from slipstream.service.cli import main

    target = served.server.target
    generate = ["generate", "--server", target, "--prompt", "Hi", "--max-tokens", "2", "--json"]
    monkeypatch.setenv("SLIPSTREAM_TOKEN", SEARCH_TOKEN)
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([*generate, "--priority", "1"]) == 0
        assert main(["stats", "--server", target, "--json"]) == 0
    # Only JSON: the server in this process logs to stdout as well.
    first, stats = [line for line in out.getvalue().splitlines() if line.startswith("{")]
    assert json.loads(first)["finish_reason"] in {"max_tokens", "eos"}
    assert "kv_blocks_used" in json.loads(stats)
    monkeypatch.delenv("SLIPSTREAM_TOKEN")
    assert main(["stats", "--server", target, "--json"]) == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED: missing bearer token" in err
    assert "(give --token or set SLIPSTREAM_TOKEN)" in err  # what to do about it
    # generate's asyncio client may see INTERNAL instead: grpc.aio overwrites
    # the status of a call the server ended while the client still wrote
    # (grpc/grpc#36066), for any early refusal.
    assert main(generate) == 1
    err = capsys.readouterr().err
    assert "slipstream: error: " in err and "Traceback" not in err


def test_logs_name_the_tenant_and_never_the_token(served: Served) -> None:
    from slipstream.service.telemetry.logs import configure_logging

    log = io.StringIO()
    configure_logging("info", "json", log)
    with served.client(SEARCH_TOKEN) as client:
        client.generate([5, 6], max_tokens=2, priority=1).result(timeout=60)
    with served.client("Not-A-Real-Token") as client, pytest.raises(grpc.RpcError):
        client.model_info()
    served.telemetry.requests.flush(10)  # type: ignore[attr-defined]
    lines = [json.loads(line) for line in log.getvalue().splitlines() if line]
    finished = [line for line in lines if line.get("event") == "request_finished"]
    assert finished and all(line.get("tenant") in {"search", "batch", "slow"} for line in finished)
    assert any(line.get("event") == "call_unauthenticated" for line in lines)
    text = log.getvalue()
    for secret in (SEARCH_TOKEN, BATCH_TOKEN, SLOW_TOKEN, "Not-A-Real-Token"):
        assert secret not in text
        assert token_sha256(secret) not in text


def test_generate_one_answers_for_its_tenant(served: Served) -> None:
    with served.client(SEARCH_TOKEN) as client:
        denied = client.generate_one([5, 6, 7], max_tokens=4, priority=0).result(timeout=60)
        assert denied.reject_reason == "permission_denied"
        assert denied.status_code == "PERMISSION_DENIED"
        fine = client.generate_one([5, 6, 7], max_tokens=4, priority=1, ignore_eos=True)
        assert fine.result(timeout=60).output_tokens == 4
    with served.client(None) as client:
        refused = client.generate_one([5, 6, 7], max_tokens=4)
        with pytest.raises(StreamError) as unauthenticated:
            refused.result(timeout=60)
        assert unauthenticated.value.code == "UNAUTHENTICATED"
    assert wait_until(lambda: served.tenants.num_inflight("search") == 0)


def http_post(served: Served, body: dict[str, object], token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.server.http_port}/v1/completions",
        data=json.dumps(body).encode(),
        headers=headers,
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, {"body": json.loads(response.read())}
    except urllib.error.HTTPError as exc:
        return exc.code, {"body": json.loads(exc.read()), "retry_after": exc.headers["Retry-After"]}


def test_the_http_front_applies_the_same_tenants(served: Served) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "priority": 1}
    refused = served.metric("slipstream_rejections_total", reason="unauthenticated")
    assert http_post(served, body, None)[0] == 401
    assert http_post(served, body, "wrong")[0] == 401
    # Counted as a gRPC call's are: token probing over HTTP shows too.
    assert served.metric("slipstream_rejections_total", reason="unauthenticated") == refused + 2
    status, answer = http_post(served, {**body, "priority": 0}, SEARCH_TOKEN)
    assert status == 403 and "priority class 0" in answer["body"]["error"]["message"]
    status, answer = http_post(served, body, SEARCH_TOKEN)
    assert status == 200, answer
    with served.client(BATCH_TOKEN) as client:  # batch's one in-flight slot, taken over gRPC
        long = client.generate([5, 6, 7], max_tokens=900, ignore_eos=True, priority=2)
        next(iter(long))
        status, answer = http_post(served, {**body, "priority": 2}, BATCH_TOKEN)
        assert status == 429 and answer["retry_after"] == "1"
        assert answer["body"]["error"]["code"] == "quota_exceeded"
        long.cancel()
        long.result(timeout=60)
    assert wait_until(lambda: served.tenants.num_inflight("batch") == 0)
    assert http_post(served, {**body, "priority": 2}, BATCH_TOKEN)[0] == 200
    assert served.tenants.num_inflight("batch") == 0
    # An OpenAI SDK's body names no priority: the tenant's most urgent class.
    plain = {k: v for k, v in body.items() if k != "priority"}
    status, answer = http_post(served, plain, SEARCH_TOKEN)
    assert status == 200, answer


def test_the_http_fronts_model_list_and_metrics_ask_a_token_health_does_not(
    served: Served,
) -> None:
    """/metrics names every tenant and /v1/models the model: with tenants,
    a token as for a completion (OpenAI's /v1/models asks one too)."""

    def get(path: str, token: str | None) -> int:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        url = f"http://127.0.0.1:{served.server.http_port}{path}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30):
                return 200
        except urllib.error.HTTPError as exc:
            return exc.code

    for path in ("/metrics", "/v1/models", "/v1/models/tiny"):
        assert (get(path, None), get(path, "wrong"), get(path, SEARCH_TOKEN)) == (401, 401, 200)
    assert get("/health", None) == 200


def test_every_401_over_http_names_the_bearer_scheme(served: Served) -> None:
    """RFC 9110 asks a 401 to say how to authenticate (WWW-Authenticate);
    clients that retry with a token, or tell 'no token' from 'forbidden',
    look for it."""
    base = f"http://127.0.0.1:{served.server.http_port}"
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}).encode()
    requests = [
        ("/v1/completions", body),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": []}'),
        ("/v1/models", None),
        ("/v1/models/tiny", None),
        ("/metrics", None),
    ]
    for path, data in requests:
        for authorization in (None, "Bearer wrong", "Basic c2VhcmNoOg=="):
            headers = {"Content-Type": "application/json"}
            if authorization is not None:
                headers["Authorization"] = authorization
            request = urllib.request.Request(base + path, data=data, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 401, (path, authorization)
            challenge = refused.value.headers["WWW-Authenticate"]
            assert challenge == 'Bearer realm="slipstream"', (path, authorization)


def test_a_revoked_token_stops_submitting_on_a_stream_opened_before(served: Served) -> None:
    """Removing a token's hash and reloading revokes it on streams already
    open too: their next submits are refused UNAUTHENTICATED, logged and
    counted for the tenant, while what they had running finishes."""
    files = parse_tenants(TENANTS_TOML)
    old, new = token_sha256("rotated-old"), token_sha256("rotated-new")
    served.tenants.replace({**files, "rotated": Tenant("rotated", (old, new))})
    refused = "slipstream_tenant_rejections_total"
    try:
        with served.client("rotated-old") as client:
            stream = client.stream()
            running = stream.generate([5, 6, 7], max_tokens=40, ignore_eos=True)
            next(iter(running))
            served.tenants.replace({**files, "rotated": Tenant("rotated", (new,))})
            late = stream.generate([5, 6], max_tokens=2).result(timeout=60)
            assert late.reject_reason == "unauthenticated"
            assert late.status_code == "UNAUTHENTICATED"
            assert "revoked" in late.message
            assert running.result(timeout=60).output_tokens == 40
            stream.close()
        with served.client("rotated-new") as client:
            assert client.generate([5, 6], max_tokens=2).result(timeout=60).is_ok
        served.telemetry.requests.flush(10)  # type: ignore[attr-defined]
        assert served.metric(refused, tenant="rotated", reason="unauthenticated") == 1
    finally:
        served.tenants.replace(files)


# ---------------------------------------------------------------- a real process


def test_sighup_rereads_the_tenants_file(
    spawn_server: Callable[..., tuple[object, str]], tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    one = f'[tenants.a]\ntoken_sha256 = ["{token_sha256("token-a")}"]\n'
    path.write_text(one)
    proc, target = spawn_server("--model", "tiny", "--no-calibrate", "--tenants", str(path))

    def code(token: str) -> grpc.StatusCode:
        with Client(target, token=token) as client:
            try:
                client.model_info()
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    assert code("token-a") is grpc.StatusCode.OK
    assert code("token-b") is grpc.StatusCode.UNAUTHENTICATED
    path.write_text(one + f'[tenants.b]\ntoken_sha256 = ["{token_sha256("token-b")}"]\n')
    proc.send_signal(signal.SIGHUP)  # type: ignore[attr-defined]
    assert wait_until(lambda: code("token-b") is grpc.StatusCode.OK)
    path.write_text("[tenants.b\n")  # broken: the old tenants stay
    proc.send_signal(signal.SIGHUP)  # type: ignore[attr-defined]
    time.sleep(0.5)
    assert code("token-a") is grpc.StatusCode.OK and code("token-b") is grpc.StatusCode.OK
    assert proc.poll() is None  # type: ignore[attr-defined]

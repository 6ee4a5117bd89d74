"""``/metrics`` over real HTTP, parsed with prometheus_client's own parser,
while real requests run through a real gRPC server on the ``tiny`` model."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_thread import ServerThread

from slipstream.clients import Client
from slipstream.service.engine.config import EngineConfig
from slipstream.service.telemetry.metrics import ServerMetrics, serve_metrics
from slipstream.service.telemetry.tracing import Telemetry

CONFIG = EngineConfig(
    model="tiny",
    dtype="float32",
    block_size=4,
    num_device_blocks=16,
    num_host_blocks=8,
    max_model_len=64,
)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def setup(engine: object) -> Iterator[tuple[ServerThread, Callable[[], Samples]]]:
    metrics = ServerMetrics()
    http, port = serve_metrics(metrics.registry, "127.0.0.1", 0)
    srv = ServerThread(engine, telemetry=Telemetry(None, metrics))

    def scrape() -> Samples:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    yield srv, scrape
    srv.stop()
    http.shutdown()


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_series_move_as_requests_run(
    setup: tuple[ServerThread, Callable[[], Samples]],
) -> None:
    server, scrape = setup
    before = scrape()
    assert value(before, "slipstream_kv_blocks", pool="device", state="free") == 16
    assert value(before, "slipstream_kv_blocks", pool="host", state="free") == 8

    with Client(server.target) as client:
        stream = client.stream()
        long = stream.generate([5, 6, 7, 8], max_tokens=56, ignore_eos=True, priority=1)
        next(iter(long))  # it is running now
        during = scrape()
        assert value(during, "slipstream_running_requests", priority="1") == 1
        assert value(during, "slipstream_kv_blocks", pool="device", state="used") > 0
        long.cancel()
        ok = [
            stream.generate(
                [5 + i, 6, 7], max_tokens=56, ignore_eos=True, priority=2, deadline_s=60
            )
            for i in range(3)
        ]
        rejected = stream.generate(list(range(5, 105)), max_tokens=4)  # longer than the context
        assert [g.result(timeout=120).output_tokens for g in ok] == [56, 56, 56]
        assert rejected.result(timeout=60).reject_reason is not None
        stream.close()

    after = scrape()
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert value(after, ttft, priority="2") - value(before, ttft, priority="2") == 3
    tpot = "gen_ai_server_time_per_output_token_seconds_count"
    assert value(after, tpot, priority="2") - value(before, tpot, priority="2") == 3
    assert value(after, "gen_ai_server_request_duration_seconds_sum", priority="2") > 0
    for waited in ("queue", "preempted"):  # observed for every request the duration is
        count = f"slipstream_request_{waited}_time_seconds_count"
        assert value(after, count, priority="2") - value(before, count, priority="2") == 3
    duration_buckets = [
        v
        for (n, labels), v in after.items()
        if n == "gen_ai_server_request_duration_seconds_bucket" and ("priority", "2") in labels
    ]
    assert max(duration_buckets) == 3  # the +Inf bucket
    finished = "slipstream_requests_finished_total"
    assert value(after, finished, priority="1", reason="cancelled") == 1
    assert value(after, finished, priority="2", reason="max_tokens") == 3
    assert value(after, "slipstream_deadline_requests_total", priority="2") == 3
    assert value(after, "slipstream_deadline_misses_total", priority="2") == 0
    assert value(after, "slipstream_rejections_total", reason="prompt_too_long") == 1
    assert value(after, "slipstream_engine_steps_total") > value(
        before, "slipstream_engine_steps_total"
    )
    # The engine thread's time by phase grew with the steps (the CPU: no wait on a device).
    host = "slipstream_engine_host_seconds_total"
    for phase in ("planning", "launch", "update", "publish"):
        assert value(after, host, phase=phase) > value(before, host, phase=phase), phase
    assert value(after, host, phase="device_wait") == 0
    # Each 59-token request needs 15 of the 16 four-token blocks: any two that
    # overlap for more than a few steps cannot both keep theirs, so someone was
    # preempted. (At 33 tokens, 9 blocks, a busy machine once let the first
    # finish before the others arrived: no preemption.)
    assert total(after, "slipstream_preemptions_total") > 0
    assert total(after, "slipstream_request_preempted_time_seconds_sum") > 0
    assert value(after, "slipstream_kv_blocks", pool="device", state="free") == 16
    assert value(after, "slipstream_running_requests", priority="1") == 0, "series stays at 0"
    assert value(after, "slipstream_queue_depth", priority="2") == 0


def test_an_expired_deadline_is_a_miss_of_its_class(
    setup: tuple[ServerThread, Callable[[], Samples]],
) -> None:
    server, scrape = setup
    before = scrape()
    with Client(server.target) as client:
        result = client.generate(
            [5, 6, 7], max_tokens=56, ignore_eos=True, priority=3, deadline_s=0.05
        ).result(timeout=60)
    time.sleep(0.01)
    after = scrape()
    if result.finish_reason == "rejected":  # a policy that rejects infeasible deadlines early
        assert value(after, "slipstream_rejections_total", reason="deadline_infeasible") == 1
        return
    assert result.finish_reason == "deadline_exceeded"
    miss = "slipstream_deadline_misses_total"
    assert value(after, miss, priority="3") - value(before, miss, priority="3") == 1


def test_finished_requests_summed_over_reasons_are_every_request(
    setup: tuple[ServerThread, Callable[[], Samples]],
) -> None:
    server, scrape = setup
    finished = "slipstream_requests_finished_total"
    before = scrape()
    with Client(server.target) as client:
        stream = client.stream()
        ran = stream.generate([5, 6, 7], max_tokens=2, priority=4)
        refused = stream.generate(list(range(5, 105)), max_tokens=4, priority=4)  # at the door
        assert ran.result(timeout=60).is_ok
        assert refused.result(timeout=60).reject_reason == "prompt_too_long"
        stream.close()
    after = scrape()
    assert total(after, finished) - total(before, finished) == 2
    rejected = value(after, finished, priority="4", reason="rejected")
    assert rejected - value(before, finished, priority="4", reason="rejected") == 1
    too_long = value(after, "slipstream_rejections_total", reason="prompt_too_long")
    assert too_long - value(before, "slipstream_rejections_total", reason="prompt_too_long") == 1


def test_a_call_refused_whole_is_a_rejection_and_no_finished_request() -> None:
    metrics = ServerMetrics()
    metrics.call_refused("draining")
    metrics.rejected("queue_full", tenant="search")  # a submit: unread priority
    sample = metrics.registry.get_sample_value
    assert sample("slipstream_rejections_total", {"reason": "draining"}) == 1
    assert (
        sample("slipstream_requests_finished_total", {"priority": "unknown", "reason": "rejected"})
        == 1
    )
    assert (
        sample(
            "slipstream_tenant_requests_finished_total", {"tenant": "search", "reason": "rejected"}
        )
        == 1
    )


def test_an_endpoint_pickers_gauges_follow_the_engine(
    setup: tuple[ServerThread, Callable[[], Samples]],
) -> None:
    server, scrape = setup
    idle = scrape()
    assert value(idle, "slipstream_num_requests_running") == 0
    assert value(idle, "slipstream_num_requests_waiting") == 0
    assert value(idle, "slipstream_kv_cache_usage_ratio") == 0
    with Client(server.target) as client:
        # 4 + 56 tokens fill 15 of the 16 four-token blocks by the end.
        long = client.generate_one([5, 6, 7, 8], max_tokens=56, ignore_eos=True)
        next(iter(long))
        during = scrape()
        used = value(during, "slipstream_kv_blocks", pool="device", state="used")
        assert value(during, "slipstream_num_requests_running") == 1
        ratio = value(during, "slipstream_kv_cache_usage_ratio")
        assert 0 < ratio <= 1
        # Scraped together, the ratio is the block gauges' used / total.
        assert abs(ratio - used / 16) <= 2 / 16
        assert long.result(timeout=120).output_tokens == 56
    after = scrape()
    assert value(after, "slipstream_num_requests_running") == 0
    assert value(after, "slipstream_kv_cache_usage_ratio") == 0


class _FakeEngine:
    def __init__(self) -> None:
        self.is_draining = False
        self.is_started = False  # its thread still preparing

    def stats(self) -> object:
        return type("Stats", (), {"is_draining": self.is_draining})()


def test_ready_is_200_only_while_an_engine_takes_requests() -> None:
    metrics = ServerMetrics()
    http, port = serve_metrics(metrics.registry, "127.0.0.1", 0, metrics.is_ready)

    def status() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert status() == 503  # loading
        engine = _FakeEngine()
        metrics._engine_collector.engine = engine  # type: ignore[assignment]
        assert status() == 503  # loaded, its thread not yet able to step
        engine.is_started = True
        assert status() == 200
        engine.is_draining = True
        assert status() == 503
    finally:
        http.shutdown()


def test_prefix_cache_hits_reach_the_caller_and_the_hit_rate(
    setup: tuple[ServerThread, Callable[[], Samples]],
) -> None:
    server, scrape = setup
    before = scrape()
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48]  # two full four-token blocks, then one token
    with Client(server.target) as client:
        first = client.generate(prompt, max_tokens=2, ignore_eos=True).result(timeout=60)
        second = client.generate(prompt, max_tokens=2, ignore_eos=True).result(timeout=60)
    assert (first.cached_tokens, second.cached_tokens) == (0, 8)  # over the wire (Usage)
    after = scrape()

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("slipstream_prefix_cache_queried_tokens_total") == 18
    assert delta("slipstream_prefix_cache_hit_tokens_total") == 8
    hits = value(after, "slipstream_prefix_cache_hit_tokens_total")
    queried = value(after, "slipstream_prefix_cache_queried_tokens_total")
    assert value(after, "slipstream_prefix_cache_hit_rate") == pytest.approx(hits / queried)
    assert value(after, "slipstream_prefix_cache_blocks") >= 2


def test_prefix_waits_are_a_counter_beside_the_hits() -> None:
    """The scheduler's prefix waits (requests sitting a step out while
    another computes their prefix) come from the engine's stats at scrape."""
    from slipstream.service.engine.events import EngineStats, PoolStats, PrefixCacheStats

    cache = PrefixCacheStats(queried_tokens=147, hit_tokens=96, waits=2, cached_blocks=3)
    stats = EngineStats(0, 0, 0, PoolStats(3, 13), PoolStats(0, 8), {}, 5, False, cache)
    metrics = ServerMetrics()
    metrics._engine_collector.engine = type("Engine", (), {"stats": lambda self: stats})()  # type: ignore[assignment]
    sample = metrics.registry.get_sample_value
    assert sample("slipstream_prefix_cache_waits_total") == 2
    assert sample("slipstream_prefix_cache_hit_tokens_total") == 96


def test_sheds_are_counted_by_class() -> None:
    from slipstream.scheduler.request import FinishReason, RejectCause
    from slipstream.service.engine.events import FinishEvent, RequestSpec

    metrics = ServerMetrics()
    for req_id, priority in (("a", 2), ("b", 2), ("c", 1)):
        request = RequestSpec(req_id, [1, 2], 4, priority=priority)
        metrics.on_submit(request, None)  # type: ignore[arg-type]
    for req_id in ("a", "b", "c"):
        shed = FinishEvent(req_id, FinishReason.REJECTED, reject_cause=RejectCause.SHED)
        metrics.on_finish(shed)
    sample = metrics.registry.get_sample_value
    assert sample("slipstream_shed_total", {"priority": "2"}) == 2
    assert sample("slipstream_shed_total", {"priority": "1"}) == 1
    assert sample("slipstream_rejections_total", {"reason": "shed"}) == 3


def test_held_back_steps_are_counted_by_class() -> None:
    from slipstream.scheduler.request import FinishReason
    from slipstream.service.engine.events import FinishEvent, RequestSpec

    metrics = ServerMetrics()
    for req_id, priority, held in (("a", 2, 5), ("b", 2, 3), ("c", 0, 0)):
        metrics.on_submit(RequestSpec(req_id, [1, 2], 4, priority=priority), None)  # type: ignore[arg-type]
        metrics.on_finish(FinishEvent(req_id, FinishReason.MAX_TOKENS, num_held_back=held))
    sample = metrics.registry.get_sample_value
    assert sample("slipstream_held_back_steps_total", {"priority": "2"}) == 8
    assert sample("slipstream_held_back_steps_total", {"priority": "0"}) is None


def test_overload_refusals_are_counted_by_class() -> None:
    from slipstream.service.engine.events import EngineStats, PoolStats

    class Engine:
        def stats(self) -> EngineStats:
            pool = PoolStats(0, 8)
            return EngineStats(
                0, 0, 0, pool, pool, {}, 7, False,
                overload_refused={2: 3, 1: 1},
                capacity_refusals={(2, "overloaded"): 3, (3, "queue_full"): 2},
                overload_estimate=1.25,
                step_time_pace=0.95,
            )  # fmt: skip

    metrics = ServerMetrics()
    metrics.bind_engine(Engine())  # type: ignore[arg-type]
    sample = metrics.registry.get_sample_value
    assert sample("slipstream_overload_refused_total", {"priority": "2"}) == 3
    assert sample("slipstream_overload_refused_total", {"priority": "1"}) == 1
    assert sample("slipstream_overload_refused_total", {"priority": "0"}) is None
    refusals = "slipstream_capacity_refusals_total"
    assert sample(refusals, {"priority": "2", "reason": "overloaded"}) == 3
    assert sample(refusals, {"priority": "3", "reason": "queue_full"}) == 2
    assert sample(refusals, {"priority": "2", "reason": "queue_full"}) is None
    assert sample("slipstream_overload_estimate") == 1.25
    assert sample("slipstream_step_time_pace") == 0.95


def test_device_memory_is_a_gauge_on_a_gpu_only() -> None:
    from slipstream.service.engine.events import EngineStats, PoolStats

    class Engine:
        def __init__(self, memory: PoolStats | None) -> None:
            self.memory = memory

        def stats(self) -> EngineStats:
            pool = PoolStats(0, 8)
            return EngineStats(0, 0, 0, pool, pool, {}, 7, False, device_memory=self.memory)

    on_gpu, on_cpu = ServerMetrics(), ServerMetrics()
    on_gpu.bind_engine(Engine(PoolStats(used=30 << 30, free=50 << 30)))  # type: ignore[arg-type]
    on_cpu.bind_engine(Engine(None))  # type: ignore[arg-type]
    name = "slipstream_device_memory_bytes"
    assert on_gpu.registry.get_sample_value(name, {"state": "used"}) == 30 << 30
    assert on_gpu.registry.get_sample_value(name, {"state": "free"}) == 50 << 30
    assert on_cpu.registry.get_sample_value(name, {"state": "used"}) is None


def test_collector_pauses_are_a_histogram_by_generation(
    setup: tuple[ServerThread, Callable[[], Samples]],
) -> None:
    import gc

    _, scrape = setup
    before = scrape()
    gc.collect()  # a full collection, on this thread: every thread stops for it
    gc.collect(0)
    after = scrape()
    for generation in ("0", "2"):
        count = ("slipstream_gc_pause_seconds_count", (("generation", generation),))
        assert after[count] >= before.get(count, 0.0) + 1
        total_s = after[("slipstream_gc_pause_seconds_sum", (("generation", generation),))]
        assert total_s > 0
        inf = ("slipstream_gc_pause_seconds_bucket", (("generation", generation), ("le", "+Inf")))
        assert after[inf] == after[count]  # the last bucket holds every collection


def _label_values(metrics: ServerMetrics, label: str) -> set[str]:
    return {
        s.labels[label]
        for family in metrics.registry.collect()
        for s in family.samples
        if label in s.labels
    }


def test_a_client_chosen_priority_adds_no_series_above_class_8() -> None:
    from slipstream.scheduler.request import FinishReason, RejectCause
    from slipstream.service.engine.events import EngineStats, FinishEvent, PoolStats, RequestSpec

    metrics = ServerMetrics()
    priorities = [0, 7, 8, 9, 1000, 2**31 - 1]
    for i, priority in enumerate(priorities):
        deadline = time.monotonic() + 60
        metrics.on_submit(
            RequestSpec(f"r{i}", [1, 2], 4, priority=priority, deadline=deadline), None
        )  # type: ignore[arg-type]
        metrics.on_finish(
            FinishEvent(
                f"r{i}", FinishReason.MAX_TOKENS, num_output_tokens=2, ttft_s=0.1, total_s=0.2
            )
        )
    metrics.on_submit(RequestSpec("shed", [1, 2], 4, priority=12345), None)  # type: ignore[arg-type]
    metrics.on_finish(FinishEvent("shed", FinishReason.REJECTED, reject_cause=RejectCause.SHED))

    class Engine:
        def stats(self) -> EngineStats:
            pool = PoolStats(0, 8)
            running = {"waiting": 0, "running": 1, "swapped": 0}
            return EngineStats(
                0, 3, 0, pool, pool, {3: running, 9: running, 77: running}, 7, False,
                overload_refused={9: 2, 40: 3},
                capacity_refusals={(9, "queue_full"): 1, (4000, "queue_full"): 4},
            )  # fmt: skip

    metrics.bind_engine(Engine())  # type: ignore[arg-type]
    assert _label_values(metrics, "priority") == {"0", "3", "7", "8+"}
    sample = metrics.registry.get_sample_value
    finished = "slipstream_requests_finished_total"
    assert sample(finished, {"priority": "8+", "reason": "max_tokens"}) == 4
    assert sample("slipstream_deadline_requests_total", {"priority": "8+"}) == 4
    assert sample("gen_ai_server_time_to_first_token_seconds_count", {"priority": "8+"}) == 4
    assert sample("slipstream_shed_total", {"priority": "8+"}) == 1
    # The engine's per-class gauges and counters sum the classes that share a label.
    assert sample("slipstream_running_requests", {"priority": "8+"}) == 2
    assert sample("slipstream_running_requests", {"priority": "3"}) == 1
    assert sample("slipstream_overload_refused_total", {"priority": "8+"}) == 5
    refusals = "slipstream_capacity_refusals_total"
    assert sample(refusals, {"priority": "8+", "reason": "queue_full"}) == 5


def test_a_deadline_the_scheduler_gives_up_on_after_queueing_is_a_miss() -> None:
    from slipstream.scheduler.request import ExpiredLimit, FinishReason, RejectCause
    from slipstream.service.engine.events import FinishEvent, RequestSpec

    metrics = ServerMetrics()
    deadline = time.monotonic() + 0.5
    for req_id, cause in (("late", RejectCause.DEADLINE_INFEASIBLE), ("shed", RejectCause.SHED)):
        metrics.on_submit(RequestSpec(req_id, [1, 2], 4, priority=2, deadline=deadline), None)  # type: ignore[arg-type]
        limit = ExpiredLimit.DEADLINE if cause is RejectCause.DEADLINE_INFEASIBLE else None
        metrics.on_finish(
            FinishEvent(req_id, FinishReason.REJECTED, reject_cause=cause, expired_limit=limit)
        )
    metrics.rejected("deadline_infeasible")  # refused at the door: never held the deadline
    sample = metrics.registry.get_sample_value
    assert sample("slipstream_deadline_requests_total", {"priority": "2"}) == 1
    assert sample("slipstream_deadline_misses_total", {"priority": "2"}) == 1
    assert sample("slipstream_rejections_total", {"reason": "deadline_infeasible"}) == 2


def test_no_created_series_double_the_families() -> None:
    from prometheus_client import enable_created_metrics, generate_latest

    from slipstream.scheduler.request import FinishReason
    from slipstream.service.engine.events import FinishEvent, RequestSpec

    enable_created_metrics()  # prometheus_client's default, whatever ran before
    metrics = ServerMetrics()
    metrics.on_submit(RequestSpec("a", [1, 2], 4, priority=1), None)  # type: ignore[arg-type]
    metrics.on_finish(FinishEvent("a", FinishReason.EOS, num_output_tokens=2, ttft_s=0.1))
    metrics.rejected("queue_full")
    text = generate_latest(metrics.registry).decode()
    assert "slipstream_requests_finished_total" in text
    assert "_created" not in text

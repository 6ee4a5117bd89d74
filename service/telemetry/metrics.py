"""Prometheus metrics on an HTTP ``/metrics`` endpoint.

Two sources, so the engine thread does almost nothing for metrics:

- gauges and engine counters are read from the engine when scraped
  (``EngineStats``);
- per-request outcomes (latency histograms, deadline misses, rejections)
  are recorded once per request, when it finishes or is refused.

Series (``priority`` is the request's priority class, 0 = most urgent; classes
0-7 are labelled as themselves and every class above as ``8+``, so a client
choosing priorities freely cannot add series without bound)::

    slipstream_queue_depth{priority}                       gauge
    slipstream_running_requests{priority}                  gauge
    slipstream_swapped_requests{priority}                  gauge
    slipstream_kv_blocks{pool=device|host, state=used|free} gauge
    slipstream_num_requests_waiting                         gauge (all classes)
    slipstream_num_requests_running                         gauge (all classes)
    slipstream_kv_cache_usage_ratio                         gauge (device pool, 0..1)
    slipstream_device_memory_bytes{state=used|free}         gauge (on a GPU only)
    slipstream_engine_steps_total                           counter
    slipstream_engine_host_seconds_total{phase}             counter (the engine thread's time:
                                                            planning|launch|device_wait|update|publish)
    slipstream_gc_pause_seconds{generation}                 histogram (Python's collector: every
                                                            thread stops while it runs)
    slipstream_preemptions_total{kind=swap|recompute}       counter
    slipstream_prefix_cache_queried_tokens_total            counter (looked up at admission)
    slipstream_prefix_cache_hit_tokens_total                counter (of those, found cached)
    slipstream_prefix_cache_hit_rate                        gauge (hit / queried since start)
    slipstream_prefix_cache_waits_total                     counter (steps a waiting request sat
                                                            out for a prefix being computed)
    slipstream_prefix_cache_blocks                          gauge (device blocks cached)
    slipstream_spec_draft_tokens_total                      counter (speculative decoding: draft
                                                            tokens verified)
    slipstream_spec_accepted_tokens_total                   counter (of those, accepted)
    slipstream_rejections_total{reason}                     counter (every refusal, at the door
                                                            or after queueing, by cause; and
                                                            calls refused whole: unauthenticated,
                                                            loading, draining; HTTP connections
                                                            over the cap: too_many_connections)
    slipstream_requests_finished_total{priority, reason}    counter (every request once, by how it
                                                            ended: refusals at the door too, as
                                                            reason=rejected, priority=unknown when
                                                            unread; summed: all requests)
    slipstream_shed_total{priority}                         counter (shed from a full queue)
    slipstream_overload_refused_total{priority}             counter (refused as overloaded)
    slipstream_capacity_refusals_total{priority, reason}    counter (reason=overloaded|queue_full)
    slipstream_overload_estimate                            gauge (offered / served; <= 1 with room)
    slipstream_deadline_requests_total{priority}            counter (deadline, judged)
    slipstream_deadline_misses_total{priority}              counter (expired, late, or
                                                            rejected as infeasible once queued)
    slipstream_held_back_steps_total{priority}              counter (steps requests were kept out
                                                            of the batch for more urgent work)
    gen_ai_server_time_to_first_token_seconds{priority}     histogram
    gen_ai_server_time_per_output_token_seconds{priority}   histogram
    gen_ai_server_request_duration_seconds{priority}        histogram

The three unlabelled gauges are what an endpoint picker (the Gateway API
Inference Extension's model-server protocol: queued requests, running
requests, KV-cache utilization as a fraction) scrapes from every replica;
they come from the same single ``engine.stats()`` call as the rest.

The same HTTP server answers ``/ready``: 200 while the engine takes new
requests, 503 while loading or draining (for proxies' HTTP health checks).

On a server with tenants (``serve --tenants``), each tenant's requests are
also counted by tenant name; the series above stay per class, so a tenant
adds a handful of series, not a copy of every histogram::

    slipstream_tenant_requests_finished_total{tenant, reason} counter
    slipstream_tenant_rejections_total{tenant, reason}        counter
    slipstream_tenant_tokens_total{tenant, kind=prompt|output} counter
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from slipstream.scheduler.request import FinishReason, RejectCause, Request
from slipstream.service.telemetry.gc_pauses import GC_PAUSE_BUCKETS, GcPauses, gc_pauses
from slipstream.service.telemetry.request_trace import rejection_label

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from wsgiref.types import StartResponse, WSGIEnvironment

    from prometheus_client.metrics_core import Metric

    from slipstream.scheduler.plan import RequestOutput, StepPlan
    from slipstream.service.engine.engine import Engine
    from slipstream.service.engine.events import (
        EngineStats,
        FinishEvent,
        PoolStats,
        PrefixCacheStats,
        RequestSpec,
    )

# Bucket boundaries recommended by the OpenTelemetry GenAI semantic conventions.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5)
DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
# Classes above this share one label (priority_label): the wire accepts any
# non-negative priority, and each distinct label value is a series kept forever.
MAX_LABELLED_PRIORITY = 7
# The class label of a request refused before its priority was read.
UNKNOWN_PRIORITY = "unknown"
_REJECTED = FinishReason.REJECTED.name.lower()
# Outcomes that say whether a deadline was met; a cancelled or failed request says neither.
_JUDGED = frozenset(
    {
        FinishReason.EOS,
        FinishReason.MAX_TOKENS,
        FinishReason.STOP_SEQUENCE,
        FinishReason.DEADLINE_EXCEEDED,
    }
)


def priority_label(priority: int) -> str:
    """A priority class as a metric label: ``0``..``7`` themselves, anything
    above ``8+`` (every series with a ``priority`` label goes through here)."""
    return str(priority) if priority <= MAX_LABELLED_PRIORITY else f"{MAX_LABELLED_PRIORITY + 1}+"


def _by_label(counts: dict[int, int]) -> dict[str, int]:
    """Per-class counts summed by their class's label."""
    summed: dict[str, int] = {}
    for priority, count in counts.items():
        label = priority_label(priority)
        summed[label] = summed.get(label, 0) + count
    return summed


class _EngineCollector(Collector):
    """Scrape-time gauges from the bound engine (none while loading)."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self._seen_labels: set[str] = set()  # keep a class's series at 0 once seen

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        if engine is None:
            return
        stats = engine.stats()
        by_label: dict[str, dict[str, int]] = {}
        for priority, counts in stats.by_priority.items():
            summed = by_label.setdefault(priority_label(priority), {})
            for state, count in counts.items():
                summed[state] = summed.get(state, 0) + count
        self._seen_labels.update(by_label)
        queues = {
            "waiting": GaugeMetricFamily(
                "slipstream_queue_depth", "Requests waiting to be scheduled", labels=["priority"]
            ),
            "running": GaugeMetricFamily(
                "slipstream_running_requests", "Requests in the running batch", labels=["priority"]
            ),
            "swapped": GaugeMetricFamily(
                "slipstream_swapped_requests",
                "Preempted requests whose KV is in the host pool",
                labels=["priority"],
            ),
        }
        for label in sorted(self._seen_labels):
            counts = by_label.get(label, {})
            for state, family in queues.items():
                family.add_metric([label], counts.get(state, 0))
        yield from queues.values()
        blocks = GaugeMetricFamily(
            "slipstream_kv_blocks", "KV cache blocks", labels=["pool", "state"]
        )
        for pool, pool_stats in (("device", stats.device_blocks), ("host", stats.host_blocks)):
            blocks.add_metric([pool, "used"], pool_stats.used)
            blocks.add_metric([pool, "free"], pool_stats.free)
        yield blocks
        yield from _picker_gauges(stats.waiting, stats.running, stats.device_blocks)
        yield CounterMetricFamily("slipstream_engine_steps", "Engine steps run", value=stats.step)
        host = CounterMetricFamily(
            "slipstream_engine_host_seconds",
            "The engine thread's time by phase of its steps (planning ahead on a GPU, a "
            "device_wait near zero: the host's work sets the step's pace, not the device)",
            labels=["phase"],
        )
        for phase, seconds in stats.host_times.as_dict().items():
            host.add_metric([phase], seconds)
        yield host
        preemptions = CounterMetricFamily(
            "slipstream_preemptions", "Preemptions by kind", labels=["kind"]
        )
        preemptions.add_metric(["swap"], stats.swap_preemptions)
        preemptions.add_metric(["recompute"], stats.recompute_preemptions)
        yield preemptions
        overload = CounterMetricFamily(
            "slipstream_overload_refused",
            "Arrivals turned away at the door as overloaded (classes above 0, the least urgent "
            "and heaviest first), by priority class",
            labels=["priority"],
        )
        for label, count in sorted(_by_label(stats.overload_refused).items()):
            overload.add_metric([label], count)
        yield overload
        yield from _capacity_metrics(stats)
        if stats.step_time_pace is not None:
            yield GaugeMetricFamily(
                "slipstream_step_time_pace",
                "Measured over predicted engine step time, a moving average, kept within "
                "[0.1, 10] (near 1: the step-time model deadlines are judged with is right; well "
                "below 1: it predicts steps slower than they run and refuses work that would fit)",
                value=stats.step_time_pace,
            )
        if stats.device_memory is not None:
            memory = GaugeMetricFamily(
                "slipstream_device_memory_bytes",
                "The GPU's memory as its driver reports it (used by any process, free)",
                labels=["state"],
            )
            memory.add_metric(["used"], stats.device_memory.used)
            memory.add_metric(["free"], stats.device_memory.free)
            yield memory
        yield from _prefix_cache_metrics(stats.prefix_cache)
        yield from _speculative_metrics(stats)


class _GcCollector(Collector):
    """Scrape-time histogram of the process's collector pauses (``gc_pauses.py``)."""

    def __init__(self, pauses: GcPauses) -> None:
        self._pauses = pauses

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "slipstream_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector, by generation (2: a full collection); "
            "every thread stops while one runs",
            labels=["generation"],
        )
        bounds = [*(repr(b) for b in GC_PAUSE_BUCKETS), "+Inf"]
        for generation, (counts, total) in enumerate(self._pauses.snapshot()):
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([str(generation)], buckets, total)
        yield family


def _capacity_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Refusals at the door for capacity by class and reason, and the load
    estimate that decides the ``overloaded`` ones."""
    refusals = CounterMetricFamily(
        "slipstream_capacity_refusals",
        "Arrivals refused at the door for capacity, by priority class and reason "
        "(overloaded: the engine full and offered more than it serves; queue_full: the "
        "waiting queue at its bound)",
        labels=["priority", "reason"],
    )
    summed: dict[tuple[str, str], int] = {}
    for (priority, reason), count in stats.capacity_refusals.items():
        key = (priority_label(priority), reason)
        summed[key] = summed.get(key, 0) + count
    for (label, reason), count in sorted(summed.items()):
        refusals.add_metric([label, reason], count)
    yield refusals
    estimate = stats.overload_estimate
    if estimate is not None:
        yield GaugeMetricFamily(
            "slipstream_overload_estimate",
            "Offered work over the work the engine serves (at most 1 while its batch has room)",
            value=estimate,
        )


def _prefix_cache_metrics(stats: PrefixCacheStats) -> Iterator[Metric]:
    """The hit rate an endpoint picker can scrape, and the counters it comes
    from (``rate(hit) / rate(queried)`` gives it over a window)."""
    yield CounterMetricFamily(
        "slipstream_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache at admission",
        value=stats.queried_tokens,
    )
    yield CounterMetricFamily(
        "slipstream_prefix_cache_hit_tokens",
        "Looked-up tokens found in the prefix cache (not prefilled)",
        value=stats.hit_tokens,
    )
    yield CounterMetricFamily(
        "slipstream_prefix_cache_waits",
        "Steps a waiting request sat out because another request's chunk that step computed"
        " its next prefix blocks (it starts on the next with them cached)",
        value=stats.waits,
    )
    yield GaugeMetricFamily(
        "slipstream_prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache / prompt tokens, over requests admitted"
        " since start (their cached_tokens; a re-admission after a preemption is not a"
        " look-up; 0 before any)",
        value=stats.hit_rate,
    )
    yield GaugeMetricFamily(
        "slipstream_prefix_cache_blocks",
        "Device KV blocks in the prefix cache (held or evictable)",
        value=stats.cached_blocks,
    )


def _speculative_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Speculative decoding's counters (``--speculative-tokens``; 0 while
    off): ``rate(accepted) / rate(drafts)`` is the acceptance rate."""
    yield CounterMetricFamily(
        "slipstream_spec_draft_tokens",
        "Draft tokens (prompt lookup) verified in decode steps",
        value=stats.spec_draft_tokens,
    )
    yield CounterMetricFamily(
        "slipstream_spec_accepted_tokens",
        "Draft tokens the model agreed with: each a token its request got without a step "
        "of its own",
        value=stats.spec_accepted_tokens,
    )


def _picker_gauges(waiting: int, running: int, device: PoolStats) -> Iterator[Metric]:
    """Totals over every class, for an endpoint picker."""
    yield GaugeMetricFamily(
        "slipstream_num_requests_waiting", "Requests waiting to be scheduled", value=waiting
    )
    yield GaugeMetricFamily(
        "slipstream_num_requests_running", "Requests in the running batch", value=running
    )
    total = device.used + device.free
    yield GaugeMetricFamily(
        "slipstream_kv_cache_usage_ratio",
        "Fraction of the device KV cache blocks in use (0 to 1)",
        value=device.used / total if total else 0.0,
    )


class ServerMetrics:
    """The engine observer behind ``/metrics``; thread-safe."""

    def __init__(self) -> None:
        # Every counter's and histogram's child would also export a _created
        # sample, which the text format shows as a gauge family of its own:
        # twice the families, read by nothing here. (A process-wide switch.)
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self._engine_collector = _EngineCollector()
        self.registry.register(self._engine_collector)
        self.registry.register(_GcCollector(gc_pauses()))
        labels = ["priority"]
        self.rejections = Counter(
            "slipstream_rejections",
            "Requests refused at the door or rejected after queueing, by cause; and calls "
            "refused whole (unauthenticated, loading, draining) and HTTP connections over the "
            "cap (too_many_connections), which submitted no request",
            ["reason"],
            registry=self.registry,
        )
        self.finished = Counter(
            "slipstream_requests_finished",
            "Requests finished, by priority class and finish reason; every request once, "
            "refusals at the door included (reason rejected), so summed they are all requests",
            ["priority", "reason"],
            registry=self.registry,
        )
        self.shed = Counter(
            "slipstream_shed",
            "Queued requests shed from a full queue for a more urgent one, by priority class",
            labels,
            registry=self.registry,
        )
        self.deadline_requests = Counter(
            "slipstream_deadline_requests",
            "Finished requests that had a deadline and were judged against it (not "
            "cancelled or failed; not refused at the door)",
            labels,
            registry=self.registry,
        )
        self.deadline_misses = Counter(
            "slipstream_deadline_misses",
            "Requests with a deadline that expired, finished after it, or were rejected as "
            "unable to meet it after queueing",
            labels,
            registry=self.registry,
        )
        self.held_back = Counter(
            "slipstream_held_back_steps",
            "Steps finished requests were held back by the batch shaper for more urgent work",
            labels,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token",
            "Time from arrival to the first output token",
            labels,
            unit="seconds",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token",
            "Mean time per output token after the first",
            labels,
            unit="seconds",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "gen_ai_server_request_duration",
            "Time from arrival to the end of the request",
            labels,
            unit="seconds",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        # Where a slow request's time went, by class: waiting for its first
        # step, and off the batch after a preemption (both 0 for most).
        self.queue_time = Histogram(
            "slipstream_request_queue_time",
            "Time from arrival to the request's first step",
            labels,
            unit="seconds",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.preempted_time = Histogram(
            "slipstream_request_preempted_time",
            "Time the request spent preempted (swapped out or dropped for recompute)",
            labels,
            unit="seconds",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tenant_finished = Counter(
            "slipstream_tenant_requests_finished",
            "Requests finished, by tenant and finish reason",
            ["tenant", "reason"],
            registry=self.registry,
        )
        self.tenant_rejections = Counter(
            "slipstream_tenant_rejections",
            "Submits refused, by tenant and reason",
            ["tenant", "reason"],
            registry=self.registry,
        )
        self.tenant_tokens = Counter(
            "slipstream_tenant_tokens",
            "Prompt and output tokens of finished requests, by tenant",
            ["tenant", "kind"],
            registry=self.registry,
        )
        # req_id -> (priority class, absolute deadline, tenant): written on
        # the submitting thread, read on the engine thread.
        self._requests: dict[str, tuple[str, float | None, str]] = {}
        self._lock = threading.Lock()

    def bind_engine(self, engine: Engine) -> None:
        self._engine_collector.engine = engine

    def is_ready(self) -> bool:
        """An engine is bound (loaded), its thread can step, and it is not draining."""
        engine = self._engine_collector.engine
        return engine is not None and engine.is_started and not engine.stats().is_draining

    def rejected(self, reason: str, tenant: str = "", priority: int | None = None) -> None:
        """A submit refused at the door: a rejection by ``reason``, and a request
        finished ``rejected``, as one the scheduler rejects after queueing is, so
        the finished requests summed over reasons are every request submitted."""
        label = UNKNOWN_PRIORITY if priority is None else priority_label(priority)
        self.rejections.labels(reason).inc()
        self.finished.labels(label, _REJECTED).inc()
        if tenant:
            self.tenant_rejections.labels(tenant, reason).inc()
            self.tenant_finished.labels(tenant, _REJECTED).inc()

    def call_refused(self, reason: str) -> None:
        """A whole call refused before any request of it was read (``unauthenticated``,
        ``loading``, ``draining``): a rejection, and no finished request (none was
        submitted)."""
        self.rejections.labels(reason).inc()

    def unadmitted(self, event: FinishEvent, tenant: str = "") -> None:
        """A request that finished before the engine took it, counted as the
        engine's finished requests are (event loop)."""
        with self._lock:
            self._requests[event.req_id] = (priority_label(event.priority), None, tenant)
        self.on_finish(event)

    # -- engine thread (EngineObserver) -----------------------------------

    def on_submit(self, request: RequestSpec, state: Request) -> None:
        with self._lock:
            self._requests[request.req_id] = (
                priority_label(request.priority),
                request.deadline,
                request.tenant,
            )

    def on_step(
        self, plan: StepPlan, outputs: list[RequestOutput], started: float, ended: float
    ) -> None:
        pass  # everything per step is read from the engine at scrape time

    def on_finish(self, event: FinishEvent) -> None:
        with self._lock:
            priority, deadline, tenant = self._requests.pop(
                event.req_id, (UNKNOWN_PRIORITY, None, "")
            )
        reason = event.reason.name.lower()
        self.finished.labels(priority, reason).inc()
        if event.num_held_back:
            self.held_back.labels(priority).inc(event.num_held_back)
        if tenant:
            self.tenant_finished.labels(tenant, reason).inc()
            self.tenant_tokens.labels(tenant, "prompt").inc(event.num_prompt_tokens)
            self.tenant_tokens.labels(tenant, "output").inc(event.num_output_tokens)
        if event.reason is FinishReason.REJECTED:
            cause = event.reject_cause
            self.rejections.labels(rejection_label(cause)).inc()
            if cause is RejectCause.SHED:
                self.shed.labels(priority).inc()
            if tenant:
                self.tenant_rejections.labels(tenant, rejection_label(cause)).inc()
            if deadline is not None and cause is RejectCause.DEADLINE_INFEASIBLE:
                # Accepted with its deadline, then given up on: a miss. (A refusal
                # at the door never held a deadline the server took on: not judged.)
                self.deadline_requests.labels(priority).inc()
                self.deadline_misses.labels(priority).inc()
            return
        if event.ttft_s is not None:
            self.ttft.labels(priority).observe(event.ttft_s)
            if event.num_output_tokens > 1:
                per_token = (event.total_s - event.ttft_s) / (event.num_output_tokens - 1)
                self.tpot.labels(priority).observe(per_token)
        self.duration.labels(priority).observe(event.total_s)
        self.queue_time.labels(priority).observe(event.queue_wait_s)
        self.preempted_time.labels(priority).observe(event.preempted_s)
        if deadline is not None and event.reason in _JUDGED:
            self.deadline_requests.labels(priority).inc()
            # on_finish runs right as the request ends, so now is its finish time.
            if event.reason is FinishReason.DEADLINE_EXCEEDED or time.monotonic() > deadline:
                self.deadline_misses.labels(priority).inc()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per scrape or health check is noise


def metrics_app(
    registry: CollectorRegistry, is_ready: Callable[[], bool] | None = None
) -> Callable[[WSGIEnvironment, StartResponse], Iterable[bytes]]:
    """``/ready`` (when ``is_ready`` is given), everything else ``/metrics``."""
    metrics = make_wsgi_app(registry)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if is_ready is not None and environ.get("PATH_INFO") == "/ready":
            ready = is_ready()
            status = "200 OK" if ready else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [b"SERVING\n" if ready else b"NOT_SERVING\n"]
        return metrics(environ, start_response)

    return app


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    is_ready: Callable[[], bool] | None = None,
) -> tuple[WSGIServer, int]:
    """Starts ``/metrics`` (and ``/ready``) on a daemon thread; returns the
    server and its port (``port`` 0 picks a free one)."""

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = make_server(
        host, port, metrics_app(registry, is_ready), Server, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="slipstream-metrics", daemon=True).start()
    return server, server.server_port

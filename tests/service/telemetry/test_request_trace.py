"""``RequestTracer`` driven by hand-made plans, no model: the timeline
arithmetic (queue wait across a swap preemption, swapped bytes, prefill
chunks) and what it costs to not trace."""

from __future__ import annotations

from dataclasses import replace

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from slipstream.scheduler.plan import RequestOutput, ScheduledSeq, StepPlan
from slipstream.scheduler.request import (
    ExpiredLimit,
    FinishReason,
    RejectCause,
    Request,
    RequestStatus,
    SamplingParams,
)
from slipstream.service.engine.events import FinishEvent, RequestSpec
from slipstream.service.telemetry import request_trace
from slipstream.service.telemetry.request_trace import RequestTracer

BYTES_PER_BLOCK = 1024


def seq(req_id: str, start: int, num: int) -> ScheduledSeq:
    return ScheduledSeq(req_id, [7] * num, start, [0], True, 0, SamplingParams())


def traced(sampler: object = None) -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler) if sampler else TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(provider.get_tracer("t"), "m", BYTES_PER_BLOCK), exporter


def submit(tracer: RequestTracer) -> Request:
    request = RequestSpec("a", [1, 2, 3, 4, 5, 6], max_new_tokens=3, arrival_time=100.0)
    tracer.begin(request, "client-a", trace.set_span_in_context(trace.INVALID_SPAN))
    state = Request("a", [1, 2, 3, 4, 5, 6], 3, arrival_time=100.0)
    tracer.on_submit(request, state)
    return state


def test_a_swap_preemption_adds_its_wait_to_later_tokens() -> None:
    tracer, exporter = traced()
    state = submit(tracer)
    out = RequestOutput
    tracer.on_step(StepPlan(1, [seq("a", 0, 4)]), [], 100.5, 100.6)  # queued 0.5 s, chunk 1
    tracer.on_step(StepPlan(2, [seq("a", 4, 2), seq("b", 9, 1)]), [out("a", [9])], 100.6, 100.7)
    state.status, state.host_block_ids = RequestStatus.SWAPPED, [3, 4]
    tracer.on_step(StepPlan(3, [seq("b", 10, 1)], preempted_req_ids=["a"]), [], 101.0, 101.1)
    state.status = RequestStatus.RUNNING
    tracer.on_step(StepPlan(4, [seq("a", 6, 1)]), [out("a", [8, 9])], 103.0, 103.1)
    tracer.on_finish(
        FinishEvent("a", FinishReason.MAX_TOKENS, num_output_tokens=3, num_held_back=2)
    )
    assert tracer.flush(timeout=10)

    spans = {s.name: s for s in exporter.get_finished_spans()}
    request = spans["text_completion m"]
    attrs = request.attributes
    assert attrs["slipstream.preemptions"] == 0  # from the FinishEvent, which said 0 here
    assert attrs["slipstream.held_back_steps"] == 2  # likewise
    assert attrs["slipstream.swapped_bytes"] == 2 * BYTES_PER_BLOCK
    assert abs(attrs["slipstream.queue.wait_ms"] - 2500.0) < 1e-6  # 0.5 s queued + 2 s swapped
    tokens = [e.attributes for e in request.events if e.name == "slipstream.token"]
    assert [t["slipstream.token.index"] for t in tokens] == [0, 1, 2]
    assert [round(t["slipstream.queue.wait_ms"]) for t in tokens] == [500, 2500, 2500]
    assert [t["slipstream.batch.size"] for t in tokens] == [2, 1, 1]
    assert [t["slipstream.step"] for t in tokens] == [2, 4, 4]
    assert spans["slipstream.preempted"].attributes["slipstream.preemption.kind"] == "swap"
    pause = spans["slipstream.preempted"]
    assert (pause.end_time - pause.start_time) / 1e9 == 2.0
    prefills = [s for s in exporter.get_finished_spans() if s.name == "slipstream.prefill"]
    assert [s.attributes["slipstream.prefill.num_tokens"] for s in prefills] == [4, 2]


def test_a_decode_with_drafts_is_no_prefill_and_each_of_its_tokens_an_event() -> None:
    tracer, exporter = traced()
    submit(tracer)
    tracer.on_step(StepPlan(1, [seq("a", 0, 6)]), [RequestOutput("a", [9])], 100.0, 100.1)
    drafting = seq("a", 6, 3)._replace(output_index=1, num_drafts=2)  # [9, d1, d2]
    tracer.on_step(StepPlan(2, [drafting]), [RequestOutput("a", [4, 5])], 100.1, 100.2)
    tracer.on_finish(FinishEvent("a", FinishReason.MAX_TOKENS, num_output_tokens=3))
    assert tracer.flush(timeout=10)

    prefills = [s for s in exporter.get_finished_spans() if s.name == "slipstream.prefill"]
    assert [s.attributes["slipstream.prefill.num_tokens"] for s in prefills] == [6]
    [request] = [s for s in exporter.get_finished_spans() if s.name == "text_completion m"]
    tokens = [e.attributes for e in request.events if e.name == "slipstream.token"]
    assert [t["slipstream.step"] for t in tokens] == [1, 2, 2]


def test_a_resume_carries_the_step_that_rescheduled_it() -> None:
    tracer, exporter = traced()
    state = submit(tracer)
    tracer.on_step(StepPlan(1, [seq("a", 0, 6)]), [RequestOutput("a", [9])], 100.0, 100.1)
    state.status, state.host_block_ids = RequestStatus.SWAPPED, [3]
    tracer.on_step(StepPlan(2, [seq("b", 0, 1)], preempted_req_ids=["a"]), [], 100.1, 100.2)
    tracer.on_step(StepPlan(3, [seq("b", 1, 1)]), [], 100.2, 100.3)  # still out
    state.status = RequestStatus.RUNNING
    tracer.on_step(StepPlan(4, [seq("a", 7, 1)]), [RequestOutput("a", [8])], 100.3, 100.4)
    tracer.on_finish(FinishEvent("a", FinishReason.MAX_TOKENS, num_output_tokens=2))
    assert tracer.flush(timeout=10)

    [request] = [s for s in exporter.get_finished_spans() if s.name == "text_completion m"]
    events = {e.name: e.attributes for e in request.events if e.name != "slipstream.token"}
    assert events["slipstream.preempt"]["slipstream.step"] == 2
    assert events["slipstream.resume"]["slipstream.step"] == 4  # the batch it rejoined
    tokens = [e.attributes for e in request.events if e.name == "slipstream.token"]
    assert tokens[-1]["slipstream.batch.id"] == events["slipstream.resume"]["slipstream.step"]


def test_a_recompute_resume_found_whole_in_the_prefix_cache_has_its_prefill_span() -> None:
    tracer, exporter = traced()
    state = submit(tracer)  # 6 prompt tokens, 4-token blocks in the engine
    tracer.on_step(StepPlan(1, [seq("a", 0, 6)]), [RequestOutput("a", [9])], 100.0, 100.1)
    tracer.on_step(StepPlan(2, [seq("a", 6, 1)]), [RequestOutput("a", [8])], 100.1, 100.2)
    state.status = RequestStatus.WAITING  # dropped: recompute
    tracer.on_step(StepPlan(3, [seq("b", 0, 1)], preempted_req_ids=["a"]), [], 100.2, 100.3)
    # Its 8 computed tokens are two cached blocks: the resume computes only
    # the one token a decode step would have.
    state.status = RequestStatus.RUNNING
    tracer.on_step(StepPlan(4, [seq("a", 8, 1)]), [RequestOutput("a", [7])], 100.4, 100.5)
    tracer.on_finish(FinishEvent("a", FinishReason.MAX_TOKENS, num_output_tokens=3))
    assert tracer.flush(timeout=10)

    prefills = [s for s in exporter.get_finished_spans() if s.name == "slipstream.prefill"]
    chunks = [
        (
            s.attributes["slipstream.step"],
            s.attributes["slipstream.prefill.start_pos"],
            s.attributes["slipstream.prefill.num_tokens"],
            s.attributes["slipstream.prefill.cached_tokens"],
        )
        for s in prefills
    ]
    assert chunks == [(1, 0, 6, 0), (4, 8, 1, 8)]  # not step 2's decode


def test_a_swap_resume_and_a_continued_chunk_are_no_cache_hits() -> None:
    tracer, exporter = traced()
    state = submit(tracer)
    tracer.on_step(StepPlan(1, [seq("a", 0, 4)]), [], 100.0, 100.1)
    tracer.on_step(StepPlan(2, [seq("a", 4, 2)]), [RequestOutput("a", [9])], 100.1, 100.2)
    state.status, state.host_block_ids = RequestStatus.SWAPPED, [3, 4]
    tracer.on_step(StepPlan(3, [seq("b", 0, 1)], preempted_req_ids=["a"]), [], 100.2, 100.3)
    state.status = RequestStatus.RUNNING
    tracer.on_step(StepPlan(4, [seq("a", 6, 1)]), [RequestOutput("a", [8])], 100.4, 100.5)
    tracer.on_finish(FinishEvent("a", FinishReason.MAX_TOKENS, num_output_tokens=2))
    assert tracer.flush(timeout=10)

    prefills = [s for s in exporter.get_finished_spans() if s.name == "slipstream.prefill"]
    assert [s.attributes["slipstream.step"] for s in prefills] == [1, 2]  # swapped back: decodes
    assert [s.attributes["slipstream.prefill.cached_tokens"] for s in prefills] == [0, 0]


def test_a_preemptions_span_and_event_name_their_attributes_alike() -> None:
    tracer, exporter = traced()
    state = submit(tracer)
    tracer.on_step(StepPlan(1, [seq("a", 0, 6)]), [RequestOutput("a", [9])], 100.0, 100.1)
    state.status, state.host_block_ids = RequestStatus.SWAPPED, [3, 4]
    tracer.on_step(StepPlan(2, [seq("b", 0, 1)], preempted_req_ids=["a"]), [], 100.1, 100.2)
    tracer.on_finish(FinishEvent("a", FinishReason.CANCELLED, num_output_tokens=1))
    assert tracer.flush(timeout=10)

    spans = {s.name: s for s in exporter.get_finished_spans()}
    [event] = [e for e in spans["text_completion m"].events if e.name == "slipstream.preempt"]
    expected = {
        "slipstream.preemption.kind": "swap",
        "slipstream.preemption.swapped_blocks": 2,
        "slipstream.step": 2,
    }
    assert dict(spans["slipstream.preempted"].attributes) == expected
    assert dict(event.attributes) == expected


def test_a_sampled_out_request_is_not_tracked() -> None:
    tracer, exporter = traced(ALWAYS_OFF)
    submit(tracer)
    assert not tracer._timelines  # on_step returns at once: sampling never slows a step
    tracer.on_step(StepPlan(1, [seq("a", 0, 6)]), [RequestOutput("a", [9])], 1.0, 1.1)
    tracer.on_finish(FinishEvent("a", FinishReason.EOS))
    assert tracer.flush(timeout=10)
    assert exporter.get_finished_spans() == ()


class _Lines:
    """Stands in for the module's logger: structlog's loggers are cached on
    first use once configured, so capture_logs would not see them."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **fields: object) -> None:
        self.lines.append((event, fields))

    def exception(self, event: str, **fields: object) -> None:
        raise AssertionError(f"{event} {fields}")


@pytest.mark.parametrize(
    ("finish", "label", "limits"),
    [
        (
            FinishEvent(
                "a",
                FinishReason.REJECTED,
                "shed from a full queue for a more urgent request; retry after 4.000s",
                reject_cause=RejectCause.SHED,
                retry_after_s=4.0,
            ),
            "shed",
            {"retry_after_ms": 4000},
        ),
        (
            FinishEvent(
                "a",
                FinishReason.REJECTED,
                "cannot meet deadline: 431 ms left, an estimated 900 ms needed",
                reject_cause=RejectCause.DEADLINE_INFEASIBLE,
                expired_limit=ExpiredLimit.DEADLINE,
            ),
            "deadline_infeasible",
            {"expired_limit": "deadline"},
        ),
    ],
)
def test_a_rejection_after_queueing_is_logged_and_tagged_as_one_at_the_door(
    monkeypatch: pytest.MonkeyPatch, finish: FinishEvent, label: str, limits: dict[str, object]
) -> None:
    from slipstream.service.api.status import finish_status

    lines = _Lines()
    monkeypatch.setattr(request_trace, "log", lines)
    tracer, exporter = traced()
    tracer.finish_status = finish_status
    submit(tracer)
    tracer.on_finish(replace(finish, queue_wait_s=0.068, total_s=0.068, num_prompt_tokens=6))
    assert tracer.flush(timeout=10)

    [(event, fields)] = lines.lines  # one line a request, as at the door
    assert event == "request_rejected"
    assert fields["reason"] == label and fields["detail"] == finish.message
    assert {k: fields[k] for k in limits} == limits
    assert fields["request_id"] == "a" and fields["client_request_id"] == "client-a"
    assert fields["queue_wait_ms"] == 68.0
    [span] = [s for s in exporter.get_finished_spans() if s.name == "text_completion m"]
    assert span.attributes["slipstream.rejection.reason"] == label  # a tag search finds it
    assert finish.message in span.status.description


@pytest.mark.parametrize("cause", list(RejectCause))
def test_a_causes_label_is_its_wire_reject_reason(cause: RejectCause) -> None:
    from slipstream.service.api.status import rejection_for_cause
    from slipstream.service.telemetry.request_trace import rejection_label

    assert rejection_label(cause) == rejection_for_cause(cause).reason_name


def test_a_finished_line_says_where_the_time_went_and_why_it_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = _Lines()
    monkeypatch.setattr(request_trace, "log", lines)
    tracer, _ = traced()
    submit(tracer)
    tracer.on_finish(
        FinishEvent(
            "a",
            FinishReason.DEADLINE_EXCEEDED,
            "cannot meet deadline: 188 ms left, an estimated 424 ms needed",
            num_prompt_tokens=6,
            num_cached_tokens=4,
            queue_wait_s=0.2269,
            total_s=1.0969,
            num_preemptions=2,
            preempted_s=0.7026,
            priority=3,
            expired_limit=ExpiredLimit.DEADLINE,
        )
    )
    tracer.on_finish(FinishEvent("b", FinishReason.EOS, num_output_tokens=2, priority=9))
    assert tracer.flush(timeout=10)

    (_, late), (_, done) = lines.lines
    assert late["reason"] == "deadline_exceeded" and late["priority"] == 3
    assert late["message"] == "cannot meet deadline: 188 ms left, an estimated 424 ms needed"
    assert late["expired_limit"] == "deadline"
    assert late["cached_tokens"] == 4
    # The wait before first being scheduled and the waits while preempted, apart.
    assert (late["queue_wait_ms"], late["preempted_ms"]) == (226.9, 702.6)
    assert done["priority"] == 9 and done["preempted_ms"] == 0.0
    assert "message" not in done and "expired_limit" not in done  # an OK outcome

"""The engine reports which limit ended a request and why the scheduler
rejected one it had queued (shed from a full queue), on the ``tiny`` model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from slipstream.scheduler.errors import QueueFull
from slipstream.scheduler.request import ExpiredLimit, FinishReason, RejectCause
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import Event, FinishEvent, RequestSpec


@pytest.fixture(scope="module")
def engine() -> Iterator[object]:
    from slipstream.service.engine.loader import load_engine

    eng = load_engine(
        EngineConfig(
            model="tiny",
            dtype="float32",
            max_num_seqs=1,
            max_queue_len=2,
            reject_infeasible=False,
            abandon_hopeless=False,
        )
    )
    eng.start()
    yield eng
    eng.shutdown()


class Finishes:
    def __init__(self) -> None:
        self.events: dict[str, FinishEvent] = {}
        self._lock = threading.Condition()

    def on_event(self, event: Event) -> None:
        if isinstance(event, FinishEvent):
            with self._lock:
                self.events[event.req_id] = event
                self._lock.notify_all()

    def wait(self, req_id: str) -> FinishEvent:
        with self._lock:
            assert self._lock.wait_for(lambda: req_id in self.events, timeout=60)
            return self.events[req_id]


def request(req_id: str, priority: int, max_new_tokens: int = 4, **kw: object) -> RequestSpec:
    return RequestSpec(req_id, [5, 6, 7], max_new_tokens, ignore_eos=True, priority=priority, **kw)  # type: ignore[arg-type]


def test_shed_and_first_token_expiry_reach_the_finish_event(engine: object) -> None:
    finishes = Finishes()
    submit = engine.submit  # type: ignore[attr-defined]
    submit(request("running", 0, max_new_tokens=400), finishes.on_event)
    deadline = time.monotonic() + 60
    while engine.stats().running == 0:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    submit(request("bg1", 2), finishes.on_event)
    submit(request("bg2", 2), finishes.on_event)  # the queue is full now
    with pytest.raises(QueueFull) as refused:
        submit(request("same", 2), finishes.on_event)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    submit(request("urgent", 0), finishes.on_event)  # sheds the latest class-2 arrival
    shed = finishes.wait("bg2")
    assert shed.reason is FinishReason.REJECTED and shed.reject_cause is RejectCause.SHED
    assert shed.retry_after_s is not None and "retry after" in shed.message
    engine.abort("running")  # type: ignore[attr-defined]
    for req_id in ("urgent", "bg1"):
        assert finishes.wait(req_id).reason is FinishReason.MAX_TOKENS
    late = request("late", 1, first_token_deadline=time.monotonic() - 1.0)
    submit(late, finishes.on_event)
    expired = finishes.wait("late")
    assert expired.reason is FinishReason.DEADLINE_EXCEEDED
    assert expired.expired_limit is ExpiredLimit.FIRST_TOKEN


def test_a_prompt_id_outside_the_vocabulary_is_refused_at_submit(engine: object) -> None:
    """Refused alone at submit; it had reached the step and failed every request
    in it (the embedding's index) when an in-process caller sent it."""
    from slipstream.scheduler.errors import InvalidRequest

    vocab = engine.info.vocab_size  # type: ignore[attr-defined]
    for ids in ([5, vocab], [-1, 5]):
        spec = RequestSpec("oov", ids, 4, ignore_eos=True)
        with pytest.raises(InvalidRequest, match=f"in \\[0, vocab size {vocab}\\)"):
            engine.submit(spec, lambda event: None)  # type: ignore[attr-defined]
    finishes = Finishes()
    engine.submit(request("fine", 0), finishes.on_event)  # type: ignore[attr-defined]
    assert finishes.wait("fine").reason is FinishReason.MAX_TOKENS

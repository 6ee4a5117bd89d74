"""A ``Generate`` stream goes on reading while a submit's prompt is tokenized:
a cancel behind it acts at once, on a running request or on a submit not yet
admitted (traced, logged and counted as a cancelled request), and the
submits behind it are still admitted in order. Tokenizing
is held on an Event (not left to a large prompt's speed), on a real
``grpc.aio`` server on tiny."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from polling import wait_until
from server_thread import ServerThread
from structlog.testing import capture_logs

from slipstream.service.api import servicer, session, wire
from slipstream.service.api.limits import Limits
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import RequestSpec
from slipstream.service.telemetry.metrics import ServerMetrics
from slipstream.service.telemetry.tracing import Telemetry
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

CONFIG = EngineConfig(
    model="tiny",
    dtype="float32",
    reject_infeasible=False,
    abandon_hopeless=False,
    calibrate_cost_model=False,
)
# Prompts over 1 KiB are tokenized on the worker pool.
LIMITS = Limits(inline_prompt_bytes=1024)
LARGE_TEXT = "Hello world. " * 150  # 1,950 bytes
LONG = 960  # tokens: several seconds on tiny, far longer than a cancel takes
PROMPT = pb.TokenIds(ids=[5, 6, 7])


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(engine: object, spans: InMemorySpanExporter) -> Iterator[ServerThread]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    srv = ServerThread(engine, limits=LIMITS, telemetry=Telemetry(provider, ServerMetrics()))
    yield srv
    srv.stop()


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.InferenceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.InferenceStub(channel)


class Tokenizing:
    """Holds the tokenization of every ``big*`` submit until ``release``."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()


@pytest.fixture
def tokenizing(monkeypatch: pytest.MonkeyPatch) -> Iterator[Tokenizing]:
    held = Tokenizing()
    convert = wire.to_generation_request

    def convert_held(submit: pb.Submit, *args: object) -> object:
        if submit.request_id.startswith("big"):
            held.entered.set()
            held.release.wait(30)
        return convert(submit, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(wire, "to_generation_request", convert_held)
    yield held
    held.release.set()


@pytest.fixture
def admitted(engine: object, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The client request ids the engine is handed, in order."""
    seen: list[str] = []
    original = engine.submit  # type: ignore[attr-defined]

    def spy(request: RequestSpec, on_event: object) -> None:
        seen.append(request.req_id.split("/", 1)[1])
        original(request, on_event)

    monkeypatch.setattr(engine, "submit", spy)
    return seen


class Stream:
    """A Generate call written frame by frame; a thread reads its responses."""

    def __init__(self, stub: pb_grpc.InferenceStub) -> None:
        self._frames: queue.Queue[pb.GenerateRequest | None] = queue.Queue()
        self._responses: queue.Queue[pb.GenerateResponse | grpc.RpcError | None] = queue.Queue()
        self.call = stub.Generate(iter(self._frames.get, None), timeout=60)
        self.seen: list[pb.GenerateResponse] = []
        self.status: grpc.StatusCode | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self._responses.put(response)
        except grpc.RpcError as exc:
            self._responses.put(exc)
        self._responses.put(None)

    def send(self, frame: pb.GenerateRequest) -> None:
        self._frames.put(frame)

    def close(self) -> None:
        self._frames.put(None)

    def wait_for(self, request_id: str, event: str, timeout_s: float = 10.0) -> pb.GenerateResponse:
        """The first ``event`` of ``request_id`` from here on; fails after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                response = self._responses.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {event} for {request_id!r} in {timeout_s} s") from None
            assert isinstance(response, pb.GenerateResponse), response
            self.seen.append(response)
            if response.request_id == request_id and response.WhichOneof("event") == event:
                return response

    def read_to_end(self, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while (response := self._responses.get(timeout=end - time.monotonic())) is not None:
            if isinstance(response, grpc.RpcError):
                self.status = response.code()
            else:
                self.seen.append(response)
        self.status = self.status or grpc.StatusCode.OK

    def has_news(self) -> bool:
        """A response (or the call's end) has come that no wait has read yet."""
        return not self._responses.empty()

    def events(self, request_id: str) -> list[str]:
        return [r.WhichOneof("event") for r in self.seen if r.request_id == request_id]


def submit(request_id: str, max_new_tokens: int = 8, **prompt: object) -> pb.GenerateRequest:
    if not prompt:
        prompt = {"token_ids": PROMPT}
    return pb.GenerateRequest(
        submit=pb.Submit(
            request_id=request_id,
            stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
            **prompt,  # type: ignore[arg-type]
        )
    )


def cancel(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(cancel=pb.Cancel(request_id=request_id))


def collapse(events: list[str]) -> list[str]:
    """Runs of chunks as one: ``accepted, chunk, finished``."""
    return [e for i, e in enumerate(events) if e != "chunk" or events[i - 1] != "chunk"]


def test_a_cancel_behind_a_prompt_being_tokenized_stops_a_running_request(
    stub: pb_grpc.InferenceStub, tokenizing: Tokenizing
) -> None:
    stream = Stream(stub)
    stream.send(submit("a", LONG))
    stream.wait_for("a", "chunk")
    stream.send(submit("big", 4, text=LARGE_TEXT))
    assert tokenizing.entered.wait(10)
    stream.send(cancel("a"))
    finished = stream.wait_for("a", "finished").finished
    assert not tokenizing.release.is_set()  # still tokenizing "big"
    assert finished.reason == pb.FINISH_REASON_CANCELLED and finished.status_code == "CANCELLED"
    assert finished.usage.output_tokens < LONG
    tokenizing.release.set()
    stream.close()
    stream.read_to_end()
    assert stream.status is grpc.StatusCode.OK
    assert collapse(stream.events("big")) == ["accepted", "chunk", "finished"]


def test_a_cancel_of_the_submit_being_tokenized_finishes_it_once_unrun(
    server: ServerThread,
    spans: InMemorySpanExporter,
    stub: pb_grpc.InferenceStub,
    tokenizing: Tokenizing,
    admitted: list[str],
) -> None:
    telemetry: Telemetry = server.telemetry
    assert telemetry.metrics is not None
    counted = telemetry.metrics.registry.get_sample_value
    labels = {"priority": "3", "reason": "cancelled"}
    cancelled_before = counted("slipstream_requests_finished_total", labels) or 0.0
    spans.clear()
    stream = Stream(stub)
    big = submit("big", LONG, text=LARGE_TEXT)
    big.submit.priority = 3
    with capture_logs() as logs:
        stream.send(big)
        assert tokenizing.entered.wait(10)
        stream.send(cancel("big"))
        finished = stream.wait_for("big", "finished").finished
        assert telemetry.requests.flush(10)
    # Traced, logged and counted like any cancelled request, though never admitted.
    # (An earlier test's "big" may finish during this one: only the unadmitted one.)
    unadmitted = "cancelled before it was admitted"
    [line] = [
        e for e in logs if e.get("client_request_id") == "big" and e.get("message") == unadmitted
    ]
    assert line["event"] == "request_finished" and line["reason"] == "cancelled"
    assert line["priority"] == 3 and line["message"] == "cancelled before it was admitted"
    [span] = [
        s
        for s in spans.get_finished_spans()
        if s.name.startswith("text_completion") and "gen_ai.usage.input_tokens" not in s.attributes
    ]
    assert span.attributes["slipstream.request.client_id"] == "big"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert counted("slipstream_requests_finished_total", labels) == cancelled_before + 1
    assert not tokenizing.release.is_set()
    assert finished.reason == pb.FINISH_REASON_CANCELLED and finished.status_code == "CANCELLED"
    assert finished.usage.output_tokens == 0
    stream.send(submit("after", 4))
    tokenizing.release.set()  # its tokenization ends; the request is never admitted
    stream.close()
    stream.read_to_end()
    assert stream.status is grpc.StatusCode.OK
    assert stream.events("big") == ["finished"]
    assert collapse(stream.events("after")) == ["accepted", "chunk", "finished"]
    assert admitted == ["after"]


def test_submits_behind_a_prompt_being_tokenized_keep_their_order(
    stub: pb_grpc.InferenceStub, tokenizing: Tokenizing, admitted: list[str]
) -> None:
    stream = Stream(stub)
    stream.send(submit("big", 4, text=LARGE_TEXT))
    assert tokenizing.entered.wait(10)
    for request_id in ("first", "second", "big", "third"):  # "big" again: a duplicate
        stream.send(submit(request_id, 4))
    stream.send(cancel("second"))  # waiting: finished at once, never admitted
    assert stream.wait_for("second", "finished").finished.reason == pb.FINISH_REASON_CANCELLED
    assert not tokenizing.release.is_set()
    assert [r.request_id for r in stream.seen] == ["second"]  # nothing admitted before "big"
    tokenizing.release.set()
    stream.close()
    stream.read_to_end()
    assert stream.status is grpc.StatusCode.OK
    assert admitted == ["big", "first", "third"]
    accepted = [r.request_id for r in stream.seen if r.WhichOneof("event") == "accepted"]
    assert accepted == ["big", "first", "third"]
    assert stream.events("second") == ["finished"]
    # The duplicate is refused after "big" is accepted; "big" goes on.
    big = [r for r in stream.seen if r.request_id == "big"]
    assert big[0].WhichOneof("event") == "accepted"
    reasons = [(r.finished.reason, r.finished.reject_reason) for r in big if r.finished.reason]
    assert sorted(reasons) == [
        (pb.FINISH_REASON_MAX_TOKENS, pb.REJECT_REASON_UNSPECIFIED),
        (pb.FINISH_REASON_REJECTED, pb.REJECT_REASON_DUPLICATE_REQUEST_ID),
    ]


def test_a_submit_behind_a_prompt_being_tokenized_counts_that_wait_as_its_own(
    server: ServerThread,
    spans: InMemorySpanExporter,
    stub: pb_grpc.InferenceStub,
    tokenizing: Tokenizing,
) -> None:
    """Its clock starts when the stream read it: the wait behind the big
    prompt shows in its queue wait and total, its deadline runs, and a
    refusal's span and log line cover that wait too."""
    spans.clear()
    stream = Stream(stub)
    stream.send(submit("big", 4, text=LARGE_TEXT))
    assert tokenizing.entered.wait(10)
    stream.send(submit("small", 4))
    timed = submit("timed", 4)
    timed.submit.timeout.FromMilliseconds(300)
    bad = submit("bad", 4)
    bad.submit.priority = 2
    bad.submit.sampling.temperature = -1.0  # refused at the door
    with capture_logs() as logs:
        stream.send(timed)
        stream.send(bad)
        time.sleep(0.6)
        tokenizing.release.set()
        stream.close()
        stream.read_to_end()
        assert server.telemetry.requests.flush(10)
    finished = {
        r.request_id: r.finished for r in stream.seen if r.WhichOneof("event") == "finished"
    }
    small = finished["small"]
    assert small.reason == pb.FINISH_REASON_MAX_TOKENS
    assert small.timings.queue_wait.ToTimedelta().total_seconds() >= 0.5
    assert small.timings.total.ToTimedelta().total_seconds() >= 0.5
    assert finished["timed"].status_code == "DEADLINE_EXCEEDED", finished["timed"]
    assert finished["bad"].status_code == "INVALID_ARGUMENT", finished["bad"]
    [line] = [e for e in logs if e.get("client_request_id") == "bad"]
    assert line["event"] == "request_rejected" and line["reason"] == "invalid"
    assert line["priority"] == 2 and line["total_ms"] >= 500
    [span] = [
        s
        for s in spans.get_finished_spans()
        if s.attributes.get("slipstream.request.client_id") == "bad"
    ]
    assert span.attributes["slipstream.request.priority"] == 2
    assert (span.end_time - span.start_time) / 1e9 >= 0.5


def test_the_stream_ends_after_its_pending_submit_is_answered(
    stub: pb_grpc.InferenceStub, tokenizing: Tokenizing
) -> None:
    stream = Stream(stub)
    stream.send(submit("big", 4, text=LARGE_TEXT))
    stream.close()  # half-closed while "big" is tokenized
    assert tokenizing.entered.wait(10)
    time.sleep(0.2)
    assert not stream.has_news()  # the call has not ended
    tokenizing.release.set()
    stream.read_to_end()
    assert stream.status is grpc.StatusCode.OK
    assert collapse(stream.events("big")) == ["accepted", "chunk", "finished"]


def test_a_stream_whose_pending_submit_is_cancelled_ends_while_it_is_tokenized(
    stub: pb_grpc.InferenceStub, tokenizing: Tokenizing, admitted: list[str]
) -> None:
    stream = Stream(stub)
    stream.send(submit("big", 4, text=LARGE_TEXT))
    assert tokenizing.entered.wait(10)
    stream.send(cancel("big"))
    stream.close()
    stream.read_to_end(timeout_s=10)
    assert not tokenizing.release.is_set()
    assert stream.status is grpc.StatusCode.OK
    assert stream.events("big") == ["finished"]
    tokenizing.release.set()
    time.sleep(0.2)
    assert admitted == []


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[session.StreamSession]:
    """The sessions of the calls the server takes from here on."""
    made: list[session.StreamSession] = []

    class Recorded(session.StreamSession):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(servicer, "StreamSession", Recorded)
    return made


@pytest.fixture
def call_ended(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a session has ended its call (``abort_all``)."""
    ended = threading.Event()
    abort_all = session.StreamSession.abort_all

    def noted(self: session.StreamSession) -> None:
        abort_all(self)
        ended.set()

    monkeypatch.setattr(session.StreamSession, "abort_all", noted)
    return ended


def finished_count(server: ServerThread, reason: str, priority: int = 1) -> float:
    """``slipstream_requests_finished_total`` at ``priority``: the tests of
    calls that end use class 1, which no other test here ends."""
    metrics = server.telemetry.metrics
    labels = {"priority": str(priority), "reason": reason}
    return metrics.registry.get_sample_value("slipstream_requests_finished_total", labels) or 0.0


def test_a_call_that_ends_finishes_its_pending_submits_unadmitted(
    server: ServerThread,
    stub: pb_grpc.InferenceStub,
    tokenizing: Tokenizing,
    admitted: list[str],
    call_ended: threading.Event,
    sessions: list[session.StreamSession],
) -> None:
    """The submit being tokenized and those waiting behind it are never
    admitted, yet each ends visibly: a ``request_finished`` line and a count,
    CANCELLED, as a cancel before admission is; a duplicate waiting there is
    refused, as it would have been in its turn."""
    cancelled_before = finished_count(server, "cancelled")
    rejected_before = finished_count(server, "rejected")
    stream = Stream(stub)
    frames = [
        submit("big", 4, text=LARGE_TEXT),
        submit("behind", 4),
        submit("behind", 4),  # a duplicate of a waiting submit
    ]
    for frame in frames:
        frame.submit.priority = 1
    with capture_logs() as logs:
        for frame in frames:
            stream.send(frame)
        assert tokenizing.entered.wait(10)
        # The reader goes on while "big" is tokenized: all three are read.
        assert wait_until(lambda: [s.num_waiting for s in sessions] == [3])
        stream.call.cancel()
        stream.read_to_end()
        # The client's cancel reaches the server a moment later: from then on.
        assert call_ended.wait(10)
        assert server.telemetry.requests.flush(10)
    assert stream.status is grpc.StatusCode.CANCELLED
    ended = [e for e in logs if e.get("client_request_id") in ("big", "behind")]
    finished = sorted(
        (e["client_request_id"], e["reason"], e["message"])
        for e in ended
        if e["event"] == "request_finished"
    )
    message = session.CALL_ENDED_UNADMITTED
    assert finished == [("behind", "cancelled", message), ("big", "cancelled", message)]
    [refused] = [e for e in ended if e["event"] == "request_rejected"]
    assert refused["client_request_id"] == "behind"
    assert refused["reason"] == "duplicate_request_id"
    assert finished_count(server, "cancelled") == cancelled_before + 2
    assert finished_count(server, "rejected") == rejected_before + 1
    tokenizing.release.set()
    time.sleep(0.3)
    assert admitted == []


def test_a_generate_one_call_that_ends_while_its_prompt_is_tokenized_counts_it(
    server: ServerThread,
    stub: pb_grpc.InferenceStub,
    tokenizing: Tokenizing,
    admitted: list[str],
    call_ended: threading.Event,
) -> None:
    cancelled_before = finished_count(server, "cancelled")
    one = submit("big-one", 4, text=LARGE_TEXT).submit
    one.priority = 1
    with capture_logs() as logs:
        call = stub.GenerateOne(one, timeout=60)
        assert tokenizing.entered.wait(10)
        call.cancel()
        assert call_ended.wait(10)
        assert server.telemetry.requests.flush(10)
    assert call.code() is grpc.StatusCode.CANCELLED
    [line] = [e for e in logs if e.get("client_request_id") == "big-one"]
    assert line["event"] == "request_finished" and line["reason"] == "cancelled"
    assert line["message"] == session.CALL_ENDED_UNADMITTED and line["priority"] == 1
    assert finished_count(server, "cancelled") == cancelled_before + 1
    tokenizing.release.set()
    time.sleep(0.3)
    assert admitted == []


def test_the_reader_stops_at_the_bound_on_waiting_submits(
    stub: pb_grpc.InferenceStub, tokenizing: Tokenizing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Submits piling up behind a tokenization hold memory: past the bound
    the reader waits (flow control holds the client back), as it did behind
    every tokenization before."""
    monkeypatch.setattr(session, "MAX_WAITING_SUBMITS", 2)
    stream = Stream(stub)
    stream.send(submit("big", 4, text=LARGE_TEXT))
    stream.send(submit("behind", 4))  # the second waiting submit: the reader stops
    assert tokenizing.entered.wait(10)
    stream.send(cancel("behind"))
    time.sleep(0.3)
    assert not stream.has_news()  # the cancel is not read yet
    tokenizing.release.set()
    stream.close()
    stream.read_to_end()
    assert stream.status is grpc.StatusCode.OK
    # Read only once "big" was admitted and "behind" after it: too late to
    # find "behind" waiting.
    assert stream.events("big")[0] == "accepted"
    assert stream.events("behind")[0] == "accepted"
    assert [r.request_id for r in stream.seen if r.WhichOneof("event") == "finished"].count(
        "behind"
    ) == 1


def test_an_unexpected_error_in_admission_fails_the_call(
    stub: pb_grpc.InferenceStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while admitting ends the call (UNKNOWN) at once, rather than
    leaving it open with the submits behind it never answered."""
    convert = wire.to_generation_request

    def broken(submit: pb.Submit, *args: object) -> object:
        if submit.request_id == "broken":
            raise RuntimeError("a bug")
        return convert(submit, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(wire, "to_generation_request", broken)
    stream = Stream(stub)
    stream.send(submit("broken", 4, text=LARGE_TEXT))
    stream.send(submit("behind", 4))
    stream.read_to_end(timeout_s=10)  # without closing the stream
    assert stream.status is grpc.StatusCode.UNKNOWN

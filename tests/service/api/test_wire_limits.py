"""Time limits, shedding and retry hints on the wire: pure conversions of
``service/api/wire.py`` (no server, no engine) and the client's submit."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from slipstream.clients.wire import GenerateOptions, build_submit
from slipstream.scheduler.errors import DeadlineInfeasible, Overloaded, QueueFull
from slipstream.scheduler.request import ExpiredLimit, FinishReason, RejectCause
from slipstream.service.api import wire
from slipstream.service.api.limits import Limits
from slipstream.service.api.status import rejection_for
from slipstream.service.engine.events import FinishEvent, ModelInfo
from slipstream.v1 import inference_pb2 as pb

INFO = ModelInfo(
    name="m",
    path="/m",
    architecture="llama",
    max_model_len=256,
    vocab_size=100,
    dtype="float32",
    block_size=16,
    attention_backend="torch",
    eos_token_ids=[0],
)


def submit(**fields: object) -> pb.Submit:
    return pb.Submit(request_id="r", token_ids=pb.TokenIds(ids=[1, 2, 3]), **fields)


def convert(message: pb.Submit, call_deadline: float | None = None) -> object:
    return wire.to_generation_request(message, "s/r", None, INFO, 100.0, call_deadline)


def test_an_empty_stop_sequence_is_a_format_error() -> None:
    message = submit(stopping=pb.StoppingCriteria(stop_sequences=["end", ""]))
    with pytest.raises(ValueError, match="stop sequences must be non-empty"):
        wire.check_limits(pb.GenerateRequest(submit=message), message, Limits())


def test_first_token_timeout_becomes_an_absolute_first_token_deadline() -> None:
    request = convert(submit(first_token_timeout=Duration(seconds=1, nanos=500_000_000)))
    assert request.first_token_deadline == pytest.approx(101.5)  # type: ignore[attr-defined]
    assert request.deadline is None  # type: ignore[attr-defined]
    assert convert(submit()).first_token_deadline is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "timeout", [Duration(seconds=-1), Duration(seconds=10**13), Duration(nanos=-5)]
)
def test_bad_first_token_timeout_is_a_clear_error(timeout: Duration) -> None:
    with pytest.raises(ValueError, match="first_token_timeout"):
        convert(submit(first_token_timeout=timeout))


def test_the_server_and_the_client_bound_durations_by_one_constant() -> None:
    """The server kept a copy of the client's bound: one could move alone."""
    from slipstream import v1
    from slipstream.clients import wire as client_wire

    assert wire.DURATION_RANGE[1] is client_wire.MAX_DURATION_S is v1.MAX_DURATION_S
    assert wire.DURATION_RANGE[0] == -v1.MAX_DURATION_S
    largest = v1.MAX_DURATION_S
    convert(submit(first_token_timeout=Duration(seconds=largest)))
    with pytest.raises(ValueError, match=r"^first_token_timeout is out of range$"):
        convert(submit(first_token_timeout=Duration(seconds=largest + 1)))
    with pytest.raises(ValueError, match="first_token_timeout_s must be a finite number"):
        build_submit("r", "hi", GenerateOptions(first_token_timeout_s=largest + 1))


@pytest.mark.parametrize("field", ["timeout", "first_token_timeout"])
@pytest.mark.parametrize(
    "duration", [Duration(seconds=1, nanos=-5), Duration(seconds=-1, nanos=5)], ids=["+-", "-+"]
)
def test_a_duration_whose_nanos_differ_in_sign_is_invalid(field: str, duration: Duration) -> None:
    with pytest.raises(ValueError, match=f"^{field} is invalid: its nanos") as caught:
        convert(submit(**{field: duration}))
    rejection = rejection_for(caught.value)
    assert rejection is not None and rejection.status is grpc.StatusCode.INVALID_ARGUMENT


def test_a_timestamp_before_1970_keeps_its_positive_nanos() -> None:
    from google.protobuf.timestamp_pb2 import Timestamp

    # Valid per the spec (nanos count forward); long past, so the deadline is too.
    request = convert(submit(deadline=Timestamp(seconds=-1, nanos=5)))
    assert request.deadline < 100.0  # type: ignore[attr-defined]


def finish(**fields: object) -> pb.Finished:
    event = FinishEvent(req_id="s/r", **fields)  # type: ignore[arg-type]
    return wire.finished("r", event).finished


def test_finished_says_which_limit_expired() -> None:
    done = finish(reason=FinishReason.DEADLINE_EXCEEDED, expired_limit=ExpiredLimit.FIRST_TOKEN)
    assert done.reason == pb.FINISH_REASON_DEADLINE_EXCEEDED
    assert done.expired_limit == pb.EXPIRED_LIMIT_FIRST_TOKEN
    assert done.status_code == "DEADLINE_EXCEEDED"
    whole = finish(reason=FinishReason.DEADLINE_EXCEEDED, expired_limit=ExpiredLimit.DEADLINE)
    assert whole.expired_limit == pb.EXPIRED_LIMIT_DEADLINE
    assert finish(reason=FinishReason.EOS).expired_limit == pb.EXPIRED_LIMIT_UNSPECIFIED


def test_finished_counts_the_steps_the_request_was_held_back_in() -> None:
    event = FinishEvent("r", FinishReason.MAX_TOKENS, num_preemptions=1, num_held_back=7)
    usage = wire.finished("r", event).finished.usage
    assert (usage.preemptions, usage.held_back_steps) == (1, 7)


def test_shed_request_finishes_rejected_shed_with_a_retry_hint() -> None:
    done = finish(
        reason=FinishReason.REJECTED,
        message="shed; retry after 0.250s",
        reject_cause=RejectCause.SHED,
        retry_after_s=0.25,
    )
    assert done.reason == pb.FINISH_REASON_REJECTED
    assert done.reject_reason == pb.REJECT_REASON_SHED
    assert done.status_code == grpc.StatusCode.RESOURCE_EXHAUSTED.name
    assert done.retry_after_ms == 250
    assert finish(reason=FinishReason.EOS).retry_after_ms == 0


def test_queued_request_rejected_as_infeasible_keeps_its_limit() -> None:
    done = finish(
        reason=FinishReason.REJECTED,
        reject_cause=RejectCause.DEADLINE_INFEASIBLE,
        expired_limit=ExpiredLimit.FIRST_TOKEN,
    )
    assert done.reject_reason == pb.REJECT_REASON_DEADLINE_INFEASIBLE
    assert done.status_code == "DEADLINE_EXCEEDED"
    assert done.expired_limit == pb.EXPIRED_LIMIT_FIRST_TOKEN


def reject(error: Exception) -> pb.Finished:
    rejection = rejection_for(error)
    assert rejection is not None
    response = wire.rejected("r", rejection.reject_reason, rejection.status.name, str(error), error)
    return response.finished


def test_submit_rejections_carry_the_limit_and_the_retry_hint() -> None:
    full = reject(QueueFull("queue is full; retry after 1.500s", 1.5))
    assert full.reject_reason == pb.REJECT_REASON_QUEUE_FULL
    assert full.retry_after_ms == 1500
    infeasible = reject(DeadlineInfeasible("too tight", ExpiredLimit.FIRST_TOKEN))
    assert infeasible.reject_reason == pb.REJECT_REASON_DEADLINE_INFEASIBLE
    assert infeasible.expired_limit == pb.EXPIRED_LIMIT_FIRST_TOKEN
    assert infeasible.retry_after_ms == 0
    overloaded = reject(Overloaded("overloaded (1.30x): ...; retry after 0.250s", 0.25, 1.3))
    assert overloaded.reject_reason == pb.REJECT_REASON_OVERLOADED  # not QUEUE_FULL
    assert overloaded.status_code == "RESOURCE_EXHAUSTED"
    assert overloaded.retry_after_ms == 250
    assert overloaded.message.startswith("overloaded (1.30x")


def test_every_front_door_names_an_overload_refusal_alike() -> None:
    """One status table: gRPC reason, HTTP code, metric label and the
    clients' spelling agree, and differ from a full queue's."""
    from slipstream.clients.wire import reject_reason_name
    from slipstream.service.api.http.errors import from_domain

    for error, name in (
        (Overloaded("overloaded (2.00x ...)", 0.5, 2.0), "overloaded"),
        (QueueFull("waiting queue is full", 0.5), "queue_full"),
    ):
        rejection = rejection_for(error)
        assert rejection is not None and rejection.reason_name == name
        assert reject_reason_name(rejection.reject_reason) == name
        answer = from_domain(error)
        assert answer is not None and answer.status == 429 and answer.code == name


def test_client_sends_the_first_token_timeout() -> None:
    message = build_submit("r", "hi", GenerateOptions(first_token_timeout_s=0.25, deadline_s=2.0))
    assert message.submit.first_token_timeout.ToNanoseconds() == 250_000_000
    assert message.submit.timeout.ToNanoseconds() == 2_000_000_000
    assert not build_submit("r", "hi", GenerateOptions()).submit.HasField("first_token_timeout")

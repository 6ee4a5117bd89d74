"""The Python clients against a scripted server: multiplexing, cancel,
results, whole-call errors, metadata and OpenTelemetry propagation."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from unittest import mock

import grpc
import pytest
from conftest import (
    ABORT_CALL_PROMPT,
    DUPLICATE_PROMPT,
    OVER_QUOTA_PROMPT,
    OVER_QUOTA_RETRY_MS,
    TOKEN_INTERVAL_S,
    ScriptedServer,
)
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from polling import wait_until

from slipstream.clients import (
    TLS,
    AsyncClient,
    AsyncStream,
    Chunk,
    Client,
    Generation,
    Result,
    Stream,
    StreamError,
)
from slipstream.clients.wire import (
    CLIENT_CLOSED,
    GenerateOptions,
    build_submit,
    finish_reason_name,
)
from slipstream.scheduler.request import FinishReason
from slipstream.service.api.status import wire_finish
from slipstream.service.cli import main


def test_sync_client_multiplexes_iterates_and_cancels(scripted: ScriptedServer) -> None:
    with Client(scripted.target) as client:
        short = client.generate("a", max_tokens=3)
        long = client.generate("b", max_tokens=1000)
        chunks = list(short)
        assert [c.token_ids for c in chunks] == [[0], [1], [2], []]  # then Finished.text's
        assert "".join(c.text for c in chunks) == "t0 t1 t2 !"
        first = next(iter(long))
        long.cancel()
        result, short_result = long.result(timeout=5), short.result(timeout=5)
    assert first.index == 0
    assert result.finish_reason == "cancelled" and len(result.token_ids) < 1000
    assert short_result.text == "t0 t1 t2 !"  # chunks then Finished.text
    assert short_result.finish_reason == "max_tokens"
    assert len(scripted.servicer.recorded.metadata) == 1, "one shared stream"
    assert scripted.servicer.recorded.cancels == [long.request_id]


def _assert_counts_what_arrived(result: Result, num_seen: int) -> None:
    assert (result.finish_reason, result.status_code) == ("cancelled", "CANCELLED")
    assert result.prompt_tokens == 3  # as the server's Accepted counted them
    assert result.output_tokens == len(result.token_ids) >= num_seen
    assert result.ttft_s is not None and result.ttft_s > 0
    # Four chunks sent TOKEN_INTERVAL_S apart came after the first (the first
    # may reach the client late and the rest on time: 39.3 ms for 4 x 10 seen).
    assert result.total_s - result.ttft_s >= 3 * TOKEN_INTERVAL_S


def test_a_cancelled_call_says_what_arrived_before_the_cancel(scripted: ScriptedServer) -> None:
    """No Finished ends a cancelled GenerateOne call: its result counts the
    tokens and times the client saw, as a cancel on a stream reports them."""
    with Client(scripted.target) as client:
        generation = client.generate_one("a b c", max_tokens=1000)
        num_seen = 0
        for chunk in generation:
            num_seen += len(chunk.token_ids)
            if num_seen == 5:
                generation.cancel()
        _assert_counts_what_arrived(generation.result(timeout=5), num_seen)

    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            generation = await client.generate_one([5, 6, 7], max_tokens=1000)
            num_seen = 0
            async for chunk in generation:
                num_seen += len(chunk.token_ids)
                if num_seen == 5:
                    await generation.cancel()
            _assert_counts_what_arrived(await generation.result(), num_seen)

    asyncio.run(scenario())


def test_a_refused_call_carries_the_servers_retry_hint(scripted: ScriptedServer) -> None:
    """A GenerateOne refusal ends the call; its trailers name the reason and
    when a retry may succeed, as a Generate stream's Finished does."""

    def assert_refused(result: Result) -> None:
        assert (result.finish_reason, result.reject_reason) == ("rejected", "quota_exceeded")
        assert result.status_code == "RESOURCE_EXHAUSTED"
        assert result.retry_after_s == OVER_QUOTA_RETRY_MS / 1000

    with Client(scripted.target) as client:
        assert_refused(client.generate_one(OVER_QUOTA_PROMPT).result(timeout=5))

    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            assert_refused(await (await client.generate_one(OVER_QUOTA_PROMPT)).result())

    asyncio.run(scenario())


def test_cancel_after_close_still_reaches_the_server(scripted: ScriptedServer) -> None:
    with Client(scripted.target) as client:
        stream = client.stream()
        long = stream.generate("a", max_tokens=1000)
        stream.close()
        with pytest.raises(RuntimeError):
            stream.generate("b", max_tokens=1)
        next(iter(long))
        long.cancel()
        assert long.result(timeout=5).finish_reason == "cancelled"


def test_closing_a_client_after_its_shared_stream_raises_in_no_thread(
    scripted: ScriptedServer,
) -> None:
    """gRPC's connectivity poller, watching the shared stream's connection,
    raised "Channel closed!" in its thread when the channel closed under it
    (grpc/grpc#18995): a third of the closes right after a submit, two in
    three against a real server. The channel now closes once the poller has
    left."""
    errors: list[BaseException | None] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        for _ in range(20):
            with Client(scripted.target) as client:
                client.generate("a", max_tokens=1)  # the shared stream opens; close at once
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(
            t.name == "slipstream-channel-close" for t in threading.enumerate()
        ):
            time.sleep(0.05)
        time.sleep(0.3)  # a poller of the last channel, had it outlived its close, would fail now
    finally:
        threading.excepthook = hook
    assert errors == []


def test_result_without_iterating(scripted: ScriptedServer) -> None:
    with Client(scripted.target) as client:
        assert client.generate([5, 6], max_tokens=4).result(timeout=5).token_ids == [0, 1, 2, 3]
    assert list(scripted.servicer.recorded.submits[0].token_ids.ids) == [5, 6]


def test_a_result_says_why_it_waited() -> None:
    from slipstream.clients.wire import Accumulator
    from slipstream.v1 import inference_pb2 as pb

    usage = pb.Usage(prompt_tokens=3, output_tokens=2, preemptions=1, held_back_steps=9)
    result = Accumulator("r").finish(pb.Finished(reason=pb.FINISH_REASON_MAX_TOKENS, usage=usage))
    assert (result.preemptions, result.held_back_steps) == (1, 9)


def test_whole_call_error_fails_pending_requests(scripted: ScriptedServer) -> None:
    with Client(scripted.target) as client:
        stream = client.stream()
        pending = stream.generate("x", max_tokens=1000)
        stream.generate(ABORT_CALL_PROMPT, max_tokens=1)
        with pytest.raises(StreamError) as err:
            pending.result(timeout=5)
        assert err.value.code == "UNAVAILABLE"
        with pytest.raises(StreamError):
            list(pending)
        # No hidden reconnection of that stream; a new one is the caller's call.
        with pytest.raises(StreamError):
            stream.generate("y", max_tokens=1)
        assert client.stream().generate("z", max_tokens=2).result(timeout=5).token_ids == [0, 1]


def test_a_duplicate_submits_rejection_does_not_end_the_accepted_request(
    scripted: ScriptedServer,
) -> None:
    """The server answers a second submit under a running request's id with
    Finished(DUPLICATE_REQUEST_ID) under that id; the running request goes on."""
    with Client(scripted.target) as client:
        generation = client.generate(DUPLICATE_PROMPT, max_tokens=3)
        assert [c.token_ids for c in generation] == [[0], [1], [2], []]
        result = generation.result(timeout=5)
    assert (result.finish_reason, result.status_code) == ("max_tokens", "OK")

    async def main() -> None:
        async with AsyncClient(scripted.target) as client:
            stream = client.stream()
            generation = await stream.generate(DUPLICATE_PROMPT, max_tokens=3)
            result = await generation.result()
            await stream.close()
        assert (result.finish_reason, result.token_ids) == ("max_tokens", [0, 1, 2])

    asyncio.run(main())


def test_keyword_arguments_reach_the_wire() -> None:
    options = GenerateOptions(
        max_tokens=7,
        temperature=0.5,
        seed=3,
        priority=2,
        deadline_s=1.5,
        expected_tokens=40,
        stop=("\n",),
        ignore_eos=True,
    )
    submit = build_submit("id", "hi", options).submit
    assert (submit.request_id, submit.text, submit.priority) == ("id", "hi", 2)
    assert submit.stopping.max_new_tokens == 7 and submit.stopping.ignore_eos
    assert list(submit.stopping.stop_sequences) == ["\n"]
    assert submit.sampling.temperature == 0.5 and submit.sampling.seed == 3
    assert not submit.sampling.HasField("top_p")
    assert submit.timeout.ToNanoseconds() == 1_500_000_000
    assert submit.expected_output_tokens == 40
    bare = build_submit("b", [1, 2], GenerateOptions()).submit
    assert not bare.HasField("timeout") and not bare.HasField("expected_output_tokens")
    assert not bare.stopping.HasField("max_new_tokens")


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    ("options", "constraint"),
    [
        ({"json_schema": SCHEMA}, {"json_schema": SCHEMA}),
        ({"json_schema": '{"enum": ["yes", "no"]}'}, {"json_schema": {"enum": ["yes", "no"]}}),
        ({"json_schema": True}, {"json_schema": True}),
        ({"json_object": True}, {"json_object": True}),
        ({"regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
        ({"json_object": False, "regex": None}, None),
    ],
    ids=["schema", "schema_text", "schema_true", "json_object", "regex", "none"],
)
def test_a_constraint_reaches_the_wire_from_every_call(
    scripted: ScriptedServer, options: dict[str, object], constraint: dict[str, object] | None
) -> None:
    """``json_schema`` (a dict, a bool or its JSON text), ``json_object`` or
    ``regex`` is the submit's ``constraint``, on a stream, a
    ``generate_one`` call and the asyncio client alike."""
    with Client(scripted.target) as client:
        client.generate("a", max_tokens=1, **options).result(5)  # type: ignore[arg-type]
        client.generate_one("b", max_tokens=1, **options).result(5)  # type: ignore[arg-type]
        stream = client.stream()
        stream.generate("c", max_tokens=1, **options).result(5)  # type: ignore[arg-type]
        stream.close()

    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            await (await client.generate("d", max_tokens=1, **options)).result()  # type: ignore[arg-type]
            await (await client.generate_one("e", max_tokens=1, **options)).result()  # type: ignore[arg-type]

    asyncio.run(scenario())
    submits = scripted.servicer.recorded.submits
    assert len(submits) == 5
    for submit in submits:
        if constraint is None:
            assert not submit.HasField("constraint")
            continue
        ((kind, value),) = constraint.items()
        assert submit.constraint.WhichOneof("kind") == kind
        sent = getattr(submit.constraint, kind)
        assert (json.loads(sent) if kind == "json_schema" else sent) == value


# Nested deeper than Python's stack: json.loads raised RecursionError.
DEEP_SCHEMA = '{"not":' * 6000 + "{}" + "}" * 6000


def _nested(schema: dict[str, object], depth: int) -> dict[str, object]:
    for _ in range(depth):
        schema = {"not": schema}
    return schema


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"json_schema": SCHEMA, "regex": "x"}, ValueError, "not json_schema and regex"),
        ({"json_object": True, "regex": "x"}, ValueError, "not json_object and regex"),
        ({"json_schema": {"enum": {1, 2}}}, ValueError, "json_schema is not JSON-serialisable"),
        ({"json_schema": {"maximum": math.nan}}, ValueError, "json_schema is not JSON-serialis"),
        ({"json_schema": '{"type": "object"'}, ValueError, "json_schema is not valid JSON"),
        ({"json_schema": DEEP_SCHEMA}, ValueError, "json_schema is nested too deeply"),
        ({"json_schema": _nested({}, 6000)}, ValueError, "json_schema is nested too deeply"),
        ({"json_schema": ["object"]}, TypeError, "json_schema must be a dict"),
        ({"regex": ""}, ValueError, "regex is empty"),
        ({"regex": b"[0-9]"}, TypeError, "regex must be a str"),
        ({"json_object": "yes"}, TypeError, "json_object must be a bool"),
    ],
)
def test_a_constraint_that_cannot_be_right_is_refused_before_sending(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        build_submit("a", "hi", GenerateOptions(**options))  # type: ignore[arg-type]
    with Client("127.0.0.1:1") as client, pytest.raises(error, match=message):
        client.generate_one("hi", **options)  # type: ignore[arg-type]


ADJUSTMENTS = {
    "presence_penalty": 1.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.25,
    "logit_bias": {7: -100, 11: 2.5},
}


@pytest.mark.parametrize(
    "options", [ADJUSTMENTS, {"repetition_penalty": None, "logit_bias": None}], ids=["set", "unset"]
)
def test_sampling_adjustments_reach_the_wire_from_every_call(
    scripted: ScriptedServer, options: dict[str, object]
) -> None:
    """The penalties and the bias are the submit's ``sampling`` fields on
    every call that takes the options, sync and asyncio; unset, the
    repetition penalty is left for the server's 1 and no token is biased."""
    messages = [("user", "hi")]
    with Client(scripted.target) as client:
        client.generate("a", max_tokens=1, **options).result(5)  # type: ignore[arg-type]
        client.generate_one("b", max_tokens=1, **options).result(5)  # type: ignore[arg-type]
        client.chat(messages, max_tokens=1, **options).result(5)  # type: ignore[arg-type]
        stream = client.stream()
        stream.generate("c", max_tokens=1, **options).result(5)  # type: ignore[arg-type]
        stream.chat(messages, max_tokens=1, **options).result(5)  # type: ignore[arg-type]
        stream.close()

    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            await (await client.generate("d", max_tokens=1, **options)).result()  # type: ignore[arg-type]
            await (await client.generate_one("e", max_tokens=1, **options)).result()  # type: ignore[arg-type]
            await (await client.chat(messages, max_tokens=1, **options)).result()  # type: ignore[arg-type]
            stream = client.stream()
            await (await stream.generate("f", max_tokens=1, **options)).result()  # type: ignore[arg-type]
            await stream.close()

    asyncio.run(scenario())
    submits = scripted.servicer.recorded.submits
    assert len(submits) == 9
    for submit in submits:
        sampling = submit.sampling
        if options is ADJUSTMENTS:
            assert (sampling.presence_penalty, sampling.frequency_penalty) == (1.5, -0.5)
            assert sampling.repetition_penalty == 1.25
            assert dict(sampling.logit_bias) == {7: -100.0, 11: 2.5}
        else:
            assert (sampling.presence_penalty, sampling.frequency_penalty) == (0, 0)
            assert not sampling.HasField("repetition_penalty") and not sampling.logit_bias


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"presence_penalty": 2.5}, ValueError, r"^presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3}, ValueError, r"^frequency_penalty must be in \[-2, 2\], got -3"),
        ({"frequency_penalty": math.nan}, ValueError, "frequency_penalty must be in"),
        ({"presence_penalty": "1"}, TypeError, "presence_penalty must be a number, got '1'"),
        ({"presence_penalty": None}, TypeError, "presence_penalty must be a number, got None"),
        ({"frequency_penalty": True}, TypeError, "frequency_penalty must be a number"),
        ({"repetition_penalty": 0}, ValueError, "repetition_penalty must be in"),
        ({"repetition_penalty": 1e38}, ValueError, "repetition_penalty must be in"),
        ({"repetition_penalty": -1.2}, ValueError, "repetition_penalty must be in"),
        ({"repetition_penalty": math.inf}, ValueError, "repetition_penalty must be in"),
        ({"repetition_penalty": "1.2"}, TypeError, "repetition_penalty must be a number"),
        ({"logit_bias": [(5, 1.0)]}, TypeError, "logit_bias must be a dict of token ids"),
        ({"logit_bias": {"5": 1.0}}, TypeError, r"logit_bias keys must be token ids \(ints\)"),
        ({"logit_bias": {True: 1.0}}, TypeError, "logit_bias keys must be token ids"),
        ({"logit_bias": {-1: 1.0}}, ValueError, r"logit_bias: -1 is not a token id in \[0, 2"),
        ({"logit_bias": {2**32: 1.0}}, ValueError, "logit_bias: 4294967296 is not a token id"),
        ({"logit_bias": {5: "-100"}}, TypeError, r"logit_bias\[5\] must be a number"),
        ({"logit_bias": {5: 100.5}}, ValueError, r"logit_bias\[5\] must be in \[-100, 100\]"),
        ({"logit_bias": {5: -math.inf}}, ValueError, r"logit_bias\[5\] must be in"),
        ({"logit_bias": {5: math.nan}}, ValueError, r"logit_bias\[5\] must be in"),
        ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, ValueError, "more than the 1024"),
    ],
)
def test_a_sampling_adjustment_that_cannot_be_right_is_refused_before_sending(
    scripted: ScriptedServer, options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        build_submit("a", "hi", GenerateOptions(**options))  # type: ignore[arg-type]
    with Client(scripted.target) as client:
        with pytest.raises(error, match=message):
            client.generate_one("hi", **options)  # type: ignore[arg-type]
        with pytest.raises(error, match=message):
            client.generate("hi", **options)  # type: ignore[arg-type]
        client.generate("sent", max_tokens=1).result(5)  # the stream is open: it went nowhere
    assert [s.text for s in scripted.servicer.recorded.submits] == ["sent"]


def test_the_clients_adjustment_bounds_are_the_servers() -> None:
    """The client mirrors them (it does not import the scheduler)."""
    from slipstream.clients import wire
    from slipstream.scheduler import request

    bounds = ("MAX_PENALTY", "MAX_LOGIT_BIAS", "MAX_LOGIT_BIAS_TOKENS", "MAX_REPETITION_PENALTY")
    bounds += ("MAX_STOP_TOKEN_IDS",)
    for name in bounds:
        assert getattr(wire, name) == getattr(request, name), name


def test_a_bias_at_the_servers_bounds_is_sent() -> None:
    bias = {i: (-100.0 if i % 2 else 100) for i in range(1024)}
    options = GenerateOptions(presence_penalty=-2, frequency_penalty=2.0, logit_bias=bias)
    sampling = build_submit("a", "hi", options).submit.sampling
    assert dict(sampling.logit_bias) == bias
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-2, 2)


def test_a_stop_string_is_one_stop_sequence() -> None:
    """A str is a Sequence[str]: taken as such, stop="END" stopped at an E."""
    submit = build_submit("a", "hi", GenerateOptions(stop="END")).submit
    assert list(submit.stopping.stop_sequences) == ["END"]
    submit = build_submit("a", "hi", GenerateOptions(stop=["END", "\n"])).submit
    assert list(submit.stopping.stop_sequences) == ["END", "\n"]
    assert not build_submit("a", "hi", GenerateOptions(stop=None)).submit.stopping.stop_sequences


@pytest.mark.parametrize(
    ("stop", "message"),
    [(b"END", "stop must be a str or a sequence of str"), (["END", 7], r"stop\[1\] must be a str")],
)
def test_a_stop_that_is_not_text_is_refused_naming_it(stop: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        build_submit("a", "hi", GenerateOptions(stop=stop))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value", "field_range"),
    [
        ("max_tokens", -1, "[0, 4294967295]"),
        ("expected_tokens", -5, "[0, 4294967295]"),
        ("top_k", 2**32, "[0, 4294967295]"),
        ("seed", -1, "[0, 18446744073709551615]"),
    ],
)
def test_a_count_the_wire_cannot_carry_is_refused_by_name(
    option: str, value: int, field_range: str
) -> None:
    """Protobuf's own error ("Value out of range: -1") names no argument."""
    options = GenerateOptions(**{option: value})
    with pytest.raises(
        ValueError, match=rf"^{option} must be in \{field_range[:-1]}\], got {value}$"
    ):
        build_submit("a", "hi", options)


@pytest.mark.parametrize(("prompt", "bad"), [([-1], "prompt[0]"), ([5, 2**32], "prompt[1]")])
def test_a_token_id_the_wire_cannot_carry_is_refused_by_name(prompt: list[int], bad: str) -> None:
    message = rf"^{re.escape(bad)} must be a token id in \[0, 2\*\*32\), got {prompt[-1]}$"
    with pytest.raises(ValueError, match=message):
        build_submit("a", prompt, GenerateOptions())
    with Client("127.0.0.1:1") as client, pytest.raises(ValueError, match=message):
        client.generate_one(prompt)  # refused before any call


def test_finish_reason_names_match_the_domain() -> None:
    for reason in FinishReason:
        wire_reason, _ = wire_finish(reason)
        # SHUTDOWN goes out as CANCELLED (status UNAVAILABLE): no value to learn.
        name = "cancelled" if reason is FinishReason.SHUTDOWN else reason.name.lower()
        assert finish_reason_name(wire_reason) == name


def test_metadata_and_trace_context_are_propagated(scripted: ScriptedServer) -> None:
    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    with Client(scripted.target, metadata={"x-team": "search"}) as client:
        with trace.use_span(tracer.start_span("caller"), end_on_exit=True) as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            client.generate("a", max_tokens=1, metadata=[("x-request-tag", "t1")]).result(5)
            client.generate("b", max_tokens=1).result(5)
        client.generate("c", max_tokens=1).result(5)
    recorded = scripted.servicer.recorded
    dedicated, shared = recorded.metadata
    assert dedicated["x-team"] == "search" and dedicated["x-request-tag"] == "t1"
    assert trace_id in dedicated["traceparent"] and trace_id in shared["traceparent"]
    contexts = [dict(s.trace_context) for s in recorded.submits]
    assert trace_id in contexts[0]["traceparent"] and trace_id in contexts[1]["traceparent"]
    assert "traceparent" not in contexts[2], "no active span, no trace context"


def test_async_client(scripted: ScriptedServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            gens = [await client.generate(f"p{i}", max_tokens=3 + i) for i in range(4)]
            victim = await client.generate("v", max_tokens=1000, priority=1, deadline_s=30)
            async for _ in victim:
                await victim.cancel()
            assert (await victim.result()).finish_reason == "cancelled"
            results = await asyncio.gather(*(g.result() for g in gens))
            assert [len(r.token_ids) for r in results] == [3, 4, 5, 6]
            chunks = [c async for c in gens[0]]
            assert [c.index for c in chunks] == [0, 1, 2, 3]  # the last: Finished.text
            assert "".join(c.text for c in chunks) == results[0].text == "t0 t1 t2 !"
            assert (await client.model_info()).name == "scripted"

    asyncio.run(scenario())
    submit = scripted.servicer.recorded.submits[-1]
    assert submit.priority == 1 and submit.timeout.seconds == 30


def test_both_clients_ask_for_batches_and_read_them_in_order(scripted: ScriptedServer) -> None:
    with Client(scripted.target) as client:
        gens = [client.generate(f"s{i}", max_tokens=8) for i in range(6)]
        results = [g.result(10) for g in gens]
    assert [r.token_ids for r in results] == [list(range(8))] * 6

    async def scenario() -> list[list[int]]:
        async with AsyncClient(scripted.target) as client:
            gens = [await client.generate(f"a{i}", max_tokens=8) for i in range(6)]
            return [(await g.result()).token_ids for g in gens]

    assert asyncio.run(scenario()) == [list(range(8))] * 6
    recorded = scripted.servicer.recorded
    assert all(m.get("slipstream-batch") == "1" for m in recorded.metadata)
    assert recorded.batches > 0, "the scripted server sent every event alone"


def test_cancelling_a_task_that_waits_for_a_stream_to_close_cancels_the_task(
    scripted: ScriptedServer,
) -> None:
    """The wait swallowed the caller's CancelledError: the task ran on past
    ``asyncio.timeout()``, ``wait_for`` or a TaskGroup's cancel."""

    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            stream = client.stream()
            generation = await stream.generate("a", max_tokens=1000)
            await stream.close()
            waiter = asyncio.create_task(stream.wait_closed())
            await asyncio.sleep(0.1)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert not generation.done, "the stream went on"
            stream.abort()

    asyncio.run(scenario())


def test_closing_either_client_cancels_its_unfinished_requests(scripted: ScriptedServer) -> None:
    """Both clients close at once, cancelling what is unfinished; the asyncio
    one used to wait for every request to finish by itself (here 10 s)."""

    def assert_cut_off(generation: object, outcome: object) -> None:
        assert isinstance(outcome, StreamError), f"{generation}: {outcome}"
        assert (outcome.code, outcome.details) == ("CANCELLED", CLIENT_CLOSED)

    started = time.monotonic()
    with Client(scripted.target) as client:
        shared = client.generate("a", max_tokens=1000)
        own = client.generate_one("b", max_tokens=1000)
        yours = client.stream().generate("e", max_tokens=1000)  # a stream you opened
        tagged = client.generate("f", max_tokens=1000, metadata=[("k", "v")])  # its own stream
        next(iter(shared)), next(iter(own)), next(iter(yours)), next(iter(tagged))
    for generation in (shared, own, yours, tagged):
        with pytest.raises(StreamError) as err:
            generation.result(timeout=5)
        assert_cut_off(generation, err.value)

    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            shared = await client.generate("c", max_tokens=1000)
            own = await client.generate_one("d", max_tokens=1000)
            yours = await client.stream().generate("g", max_tokens=1000)
            tagged = await client.generate("h", max_tokens=1000, metadata=[("k", "v")])
            for generation in (shared, own, yours, tagged):
                await anext(aiter(generation))
        for generation in (shared, own, yours, tagged):
            assert generation.done, "settled when close() returns"
            with pytest.raises(StreamError) as err:
                await generation.result()
            assert_cut_off(generation, err.value)

    asyncio.run(scenario())
    assert time.monotonic() - started < 5


def _drain_within(generation: Generation, seconds: float) -> list[Chunk] | StreamError:
    """A loop over ``generation`` (its chunks, or the error it raised), on a
    daemon thread: a loop that hangs fails the test instead of hanging it."""
    outcome: list[list[Chunk] | StreamError] = []

    def drain() -> None:
        try:
            outcome.append(list(generation))
        except StreamError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, "the loop did not end"
    return outcome[0]


def test_a_second_loop_over_a_generation_ends_at_once(scripted: ScriptedServer) -> None:
    """The first loop took the end off the queue: a second one waited forever."""
    with Client(scripted.target) as client:
        generation = client.generate("a", max_tokens=3)
        assert len(list(generation)) == 4
        assert _drain_within(generation, 5) == []
        stream = client.stream()
        failed = stream.generate("x", max_tokens=1000)
        stream.generate(ABORT_CALL_PROMPT, max_tokens=1)
        first, second = _drain_within(failed, 5), _drain_within(failed, 5)
        assert isinstance(first, StreamError) and first.code == "UNAVAILABLE"
        assert second is first, "the same error again"

    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            generation = await client.generate("b", max_tokens=3)
            assert len([c async for c in generation]) == 4
            assert [c async for c in generation] == []

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_an_async_client_built_outside_an_event_loop_says_so() -> None:
    """Built outside the loop that used it, its calls never completed."""
    with pytest.raises(RuntimeError, match="inside a running event loop"):
        AsyncClient("127.0.0.1:1")


def test_a_calls_own_deadline_ends_its_request_as_the_servers_would(
    scripted: ScriptedServer,
) -> None:
    """The scripted server ignores the call's deadline, as a server does that
    has not seen it pass yet: the client's gRPC deadline fires first. It
    raised StreamError("Stream removed"); a server's expiry is a Result."""

    def assert_expired(result: Result) -> None:
        assert (result.finish_reason, result.status_code) == (
            "deadline_exceeded",
            "DEADLINE_EXCEEDED",
        )
        assert result.output_tokens == len(result.token_ids) > 0
        assert result.prompt_tokens == 2  # as the server's Accepted counted them

    with Client(scripted.target) as client:
        expiring = client.generate_one("a b", max_tokens=1000, timeout=0.3)
        assert_expired(expiring.result(timeout=5))

    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            generation = await client.generate_one([5, 6], max_tokens=1000, timeout=0.3)
            assert_expired(await generation.result())

    asyncio.run(scenario())


def test_a_stream_whose_call_ended_leaves_nothing_waiting_to_write_it(
    scripted: ScriptedServer,
) -> None:
    """gRPC's writer of a Generate call (a thread; a task in grpc.aio) waits
    on the stream's queue for the next message. A call that ended without
    the client's half-close (its deadline here; the server's end or a lost
    connection alike) left it waiting for good: a thread per ended stream,
    or a task asyncio destroyed pending, with an error line, once the
    stream was gone."""
    with Client(scripted.target) as client:
        client.model_info()  # the channel's own threads are up
        num_threads = threading.active_count()
        for _ in range(3):
            stream = client.stream(timeout=0.3)
            with pytest.raises(StreamError, match="DEADLINE_EXCEEDED"):
                stream.generate("a", max_tokens=1000).result(timeout=5)
        assert wait_until(lambda: threading.active_count() == num_threads)

    async def scenario() -> None:
        async with AsyncClient(scripted.target) as client:
            await client.model_info()
            tasks = asyncio.all_tasks()
            stream = client.stream(timeout=0.3)
            generation = await stream.generate("b", max_tokens=1000)
            with pytest.raises(StreamError, match="DEADLINE_EXCEEDED"):
                await generation.result()
            await stream.wait_closed()
            for _ in range(100):
                if asyncio.all_tasks() == tasks:
                    break
                await asyncio.sleep(0.01)
            assert asyncio.all_tasks() == tasks

    asyncio.run(scenario())


class _StreamRemoved(grpc.RpcError):
    """What gRPC raises for an HTTP/2 stream that ended with no grpc-status:
    a proxy resetting it when its backend died (tests/ops/test_fleet.py)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        return "Stream removed"

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_a_stream_that_ends_with_no_status_is_unavailable_as_a_call_is() -> None:
    """generate_one said UNAVAILABLE for it; a stream's requests said
    UNKNOWN 'Stream removed'."""

    def removed(requests: Iterator[object]) -> Iterator[object]:
        next(requests)
        raise _StreamRemoved()
        yield

    stub = mock.Mock()
    stub.Generate.side_effect = lambda requests, **_: removed(requests)
    stream = Stream(stub)
    with pytest.raises(StreamError) as err:
        stream.generate("a").result(timeout=5)
    assert err.value.code == "UNAVAILABLE", err.value
    assert "the connection to the server was lost" in err.value.details

    async def removed_async(requests: AsyncIterator[object]) -> AsyncIterator[object]:
        await anext(requests)
        raise _StreamRemoved()
        yield

    async def scenario() -> None:
        stub = mock.Mock()
        stub.Generate.side_effect = lambda requests, **_: removed_async(requests)
        stream = AsyncStream(stub)
        generation = await stream.generate("b")
        with pytest.raises(StreamError) as err:
            await generation.result()
        assert err.value.code == "UNAVAILABLE", err.value

    asyncio.run(scenario())


def test_a_call_that_ends_before_its_accepted_counts_no_prompt_tokens() -> None:
    """As for a request the server never admitted: 0 prompt tokens, not a
    guess; once Accepted came, the server's count."""
    from slipstream.clients.wire import Accumulator
    from slipstream.v1 import inference_pb2 as pb

    unanswered = Accumulator("r")
    assert unanswered.cancelled_by_caller().prompt_tokens == 0
    assert unanswered.deadline_passed().prompt_tokens == 0
    answered = Accumulator("r")
    answered.accept(pb.Accepted(queue_position=2, num_prompt_tokens=11))
    assert answered.deadline_passed().prompt_tokens == 11
    result = answered.cancelled_by_caller()
    assert (result.prompt_tokens, result.queue_position, result.output_tokens) == (11, 2, 0)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"deadline_s": math.inf}, ValueError, "deadline_s must be a finite number of seconds"),
        ({"deadline_s": math.nan}, ValueError, "deadline_s must be a finite number of seconds"),
        ({"deadline_s": 1e30}, ValueError, "deadline_s must be a finite number of seconds"),
        ({"first_token_timeout_s": math.inf}, ValueError, "first_token_timeout_s must be"),
        ({"deadline_s": "2"}, TypeError, "deadline_s must be a number of seconds, got '2'"),
        ({"priority": 2**40}, ValueError, r"priority must be in \[-2147483648, 2147483647\]"),
        ({"max_tokens": "8"}, TypeError, "max_tokens must be an int, got '8'"),
    ],
)
def test_a_duration_or_priority_the_wire_cannot_carry_is_refused_by_name(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    """They raised OverflowError, "cannot convert float NaN to integer" or
    "Value out of range", naming no argument."""
    with pytest.raises(error, match=message):
        build_submit("a", "hi", GenerateOptions(**options))  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 1e10])
def test_a_call_timeout_grpc_cannot_keep_is_refused(timeout: float) -> None:
    """gRPC took these as a deadline already passed."""
    with Client("127.0.0.1:1") as client, pytest.raises(ValueError, match=r"^timeout must be"):
        client.generate_one("hi", timeout=timeout)


@pytest.mark.parametrize(
    ("prompt", "message"), [(b"hi", "not bytes"), (None, "got None"), (5, "got 5")]
)
def test_a_prompt_that_is_neither_text_nor_token_ids_is_refused(
    prompt: object, message: str
) -> None:
    """Bytes went out as token ids [104, 105]; None failed as "not iterable"."""
    with pytest.raises(
        TypeError, match=f"^prompt must be a str or a sequence of token ids.*{message}"
    ):
        build_submit("a", prompt, GenerateOptions())  # type: ignore[arg-type]


def test_a_certificate_without_its_key_is_refused_in_words_for_api_and_cli(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It said "needs both cert_file and key_file" to `chat --tls-cert a.pem`."""
    with pytest.raises(ValueError, match="cert_file with key_file"):
        TLS(cert_file="a.pem")
    with pytest.raises(SystemExit):
        main(["stats", "--server", "127.0.0.1:1", "--tls-cert", "a.pem"])
    assert "--tls-cert with --tls-key" in capsys.readouterr().err


@pytest.mark.parametrize("own_call", [True, False], ids=["generate_one", "own_stream"])
def test_a_request_racing_close_is_told_the_client_closed(
    scripted: ScriptedServer, own_call: bool
) -> None:
    """A call opened while another thread closed the client raised gRPC's
    "Channel closed!" (three races in four): close() closed the channel under
    a call it had not yet seen. Each race now ends in the client's own word."""
    outcomes: set[str] = set()
    for i in range(100):
        client = Client(scripted.target)
        barrier = threading.Barrier(2)

        def submit(client: Client = client, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                if own_call:
                    generation = client.generate_one("a", max_tokens=1000)
                else:
                    generation = client.generate("a", max_tokens=1000, metadata=[("k", "v")])
                outcomes.add(repr(generation.result(timeout=5)))
            except (RuntimeError, StreamError, ValueError) as exc:
                outcomes.add(str(exc))

        thread = threading.Thread(target=submit)
        thread.start()
        barrier.wait()
        time.sleep((i % 50) * 20e-6)  # close at each point of the call's opening
        client.close()
        thread.join(10)
    assert outcomes <= {"the client is closed", f"CANCELLED: {CLIENT_CLOSED}"}


def test_a_closed_client_says_it_is_closed(scripted: ScriptedServer) -> None:
    """It said "the stream is closed for new requests", of a stream the
    caller never opened; tokenize() still went out."""
    client = Client(scripted.target)
    client.generate("a", max_tokens=1).result(timeout=5)
    client.close()
    for call in (
        lambda: client.generate("b", max_tokens=1),
        lambda: client.generate_one("c", max_tokens=1),
        lambda: client.model_info(),
    ):
        with pytest.raises(RuntimeError, match=r"^the client is closed$"):
            call()

    async def scenario() -> None:
        client = AsyncClient(scripted.target)
        await (await client.generate("d", max_tokens=1)).result()
        await client.close()
        with pytest.raises(RuntimeError, match=r"^the client is closed$"):
            await client.generate("e", max_tokens=1)
        with pytest.raises(RuntimeError, match=r"^the client is closed$"):
            await client.model_info()

    asyncio.run(scenario())

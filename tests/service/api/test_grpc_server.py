"""End to end over a real ``grpc.aio`` server on a loopback port, with the
real engine on the ``tiny`` model: multiplexing, cancel, disconnect,
deadlines, per-request rejection, health, reflection, and freshly generated
stubs."""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import polling
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_thread import ServerThread, hold_every_submit

from slipstream.clients import Client, StreamError
from slipstream.kernels.cpu_features import detect
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.events import RequestSpec
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[3]
# fp32 so greedy output cannot depend on how requests happen to be batched.
# Early rejection and early abandonment of hopeless deadlines are off so the
# expiry path is what the deadline tests exercise;
# test_infeasible_deadline_is_rejected_early covers rejection on an engine of
# its own.
CONFIG = EngineConfig(
    model="tiny",
    dtype="float32",
    max_queue_len=4096,
    reject_infeasible=False,
    abandon_hopeless=False,
)
LONG = 960  # tokens: outlives anything a test does to it (tiny: ~5 s alone)


@pytest.fixture(scope="module")
def server(engine: object) -> Iterator[ServerThread]:
    srv = ServerThread(engine)
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target) as c:
        yield c


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.InferenceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.InferenceStub(channel)


# The shared poll, with this file's own patience.
wait_until = functools.partial(polling.wait_until, timeout_s=5.0)


def engine_idle(client: Client) -> bool:
    stats = client.server_stats()
    return (stats.waiting, stats.running, stats.swapped, stats.kv_blocks_used.device) == (
        0,
        0,
        0,
        0,
    )


def prompts(n: int) -> list[list[int]]:
    return [[5 + (i * 37 + j * 11) % 4000 for j in range(3 + i % 29)] for i in range(n)]


def local_greedy(
    engine: object, token_prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    requests = [
        RequestSpec(req_id=f"local-{i}", prompt_token_ids=p, max_new_tokens=max_tokens)
        for i, p in enumerate(token_prompts)
    ]
    return [r.token_ids for r in engine.generate(requests)]  # type: ignore[attr-defined]


# ---------------------------------------------------------------- multiplexing


def test_64_concurrent_requests_on_one_stream(client: Client, engine: object) -> None:
    token_prompts = prompts(64)
    stream = client.stream()
    generations = [stream.generate(p, max_tokens=12 + i % 5) for i, p in enumerate(token_prompts)]
    stream.close()
    results = [g.result(timeout=60) for g in generations]
    by_length: dict[int, list[list[int]]] = {}
    for i, p in enumerate(token_prompts):
        by_length.setdefault(12 + i % 5, []).append(p)
    expected = {n: iter(local_greedy(engine, ps, n)) for n, ps in by_length.items()}
    for i, result in enumerate(results):
        assert result.finish_reason in ("max_tokens", "eos"), result
        assert result.token_ids == next(expected[12 + i % 5])
        assert result.prompt_tokens == len(token_prompts[i])
    assert wait_until(lambda: engine_idle(client))


def test_64_requests_across_16_streams(client: Client) -> None:
    streams = [client.stream() for _ in range(16)]
    generations = [
        (s, s.generate(p, max_tokens=8, ignore_eos=True))
        for i, p in enumerate(prompts(64))
        for s in [streams[i % 16]]
    ]
    for s in streams:
        s.close()
    chunks_seen = [sum(len(c.token_ids) for c in g) for _, g in generations]
    results = [g.result(timeout=60) for _, g in generations]
    assert all(r.finish_reason == "max_tokens" and len(r.token_ids) == 8 for r in results)
    assert chunks_seen == [8] * 64
    assert wait_until(lambda: engine_idle(client))


def test_events_interleave_and_are_tagged(stub: pb_grpc.InferenceStub) -> None:
    def requests() -> Iterator[pb.GenerateRequest]:
        for rid in ("a", "b"):
            yield pb.GenerateRequest(
                submit=pb.Submit(
                    request_id=rid,
                    token_ids=pb.TokenIds(ids=[7, 8, 9]),
                    # long enough that "a" is still running when "b" arrives on a busy machine
                    stopping=pb.StoppingCriteria(max_new_tokens=200, ignore_eos=True),
                )
            )

    events = [(r.request_id, r.WhichOneof("event")) for r in stub.Generate(requests(), timeout=30)]
    for rid in ("a", "b"):
        kinds = [kind for eid, kind in events if eid == rid]
        assert kinds[0] == "accepted" and kinds[-1] == "finished"
        assert kinds.count("finished") == 1
    order = [eid for eid, kind in events if kind == "chunk"]
    first_b, last_a = order.index("b"), len(order) - 1 - order[::-1].index("a")
    assert first_b < last_a, "requests on one stream should run concurrently"


def test_a_stream_that_asks_for_batches_reads_the_same_events(
    stub: pb_grpc.InferenceStub,
) -> None:
    """``slipstream-batch: 1``: several events a message, never nested; taken
    apart in order they are each request's accepted, its tokens, its finish."""
    submits = [
        _submit(f"r{i}", token_ids=pb.TokenIds(ids=[7 + i, 8, 9]),
                stopping=pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True))
        for i in range(8)
    ]  # fmt: skip
    messages = list(stub.Generate(iter(submits), metadata=[("slipstream-batch", "1")], timeout=30))
    events = []
    for message in messages:
        if message.WhichOneof("event") == "batch":
            assert not message.request_id and len(message.batch.responses) >= 2
            assert all(r.WhichOneof("event") != "batch" for r in message.batch.responses)
            events.extend(message.batch.responses)
        else:
            events.append(message)
    assert len(messages) < len(events), "the stream's events went out one a message"
    for i in range(8):
        mine = [r for r in events if r.request_id == f"r{i}"]
        assert mine[0].WhichOneof("event") == "accepted"
        assert mine[-1].WhichOneof("event") == "finished"
        chunks = [r.chunk for r in mine[1:-1]]
        assert all(r.WhichOneof("event") == "chunk" for r in mine[1:-1])
        assert [c.index for c in chunks] == list(
            itertools.accumulate([len(c.token_ids) for c in chunks[:-1]], initial=0)
        )
        assert sum(len(c.token_ids) for c in chunks) == 12


# ---------------------------------------------------------------- local parity


def json_lines(out: str) -> list[dict]:
    """The CLI's JSON lines from captured stdout, where the server running in
    this process may log lines of its own."""
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_greedy_over_the_wire_matches_local_cli(
    server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from slipstream.service.cli import main

    lines = ['"Hello there"', '{"prompt": "The quick brown fox", "max_tokens": 9}']
    lines += [json.dumps({"prompt_token_ids": p}) for p in prompts(6)]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(lines) + "\n")
    common = ["--prompts-file", str(prompts_file), "--max-tokens", "16", "--json"]
    outputs = {}
    for where in (
        ["--server", server.target],
        ["--local", "--model", "tiny", "--dtype", "float32"],
    ):
        assert main(["generate", *where, *common]) == 0
        outputs[where[0]] = json_lines(capsys.readouterr().out)
    assert outputs["--server"] == outputs["--local"]
    assert [o["index"] for o in outputs["--local"]] == list(range(8))
    assert len(outputs["--local"][1]["token_ids"]) <= 9
    assert all(o["token_ids"] for o in outputs["--local"])


def test_cli_logprobs_over_the_wire_match_local(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    from slipstream.service.cli import main

    common = ["--prompt", "Hello there", "--max-tokens", "6", "--json", "--logprobs", "2"]
    outputs = {}
    for where in (
        ["--server", server.target],
        ["--local", "--model", "tiny", "--dtype", "float32"],
        ["--server", server.target, "--per-request", "--cancel-after", "3"],
    ):
        assert main(["generate", *where, *common]) == 0
        outputs[len(outputs)] = json_lines(capsys.readouterr().out)[0]
    remote, local, cut = outputs.values()
    assert remote["token_ids"] == local["token_ids"] and len(local["logprobs"]) == 6
    for got, want in zip(remote["logprobs"], local["logprobs"], strict=True):
        assert got["token_id"] == want["token_id"] == want["top"][0][0]
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-5)  # float32 on the wire
        assert [t for t, _ in got["top"]] == [t for t, _ in want["top"]] and len(got["top"]) == 2
    # Cut after the chunk that brought 3 (a chunk may carry several tokens).
    assert 3 <= len(cut["token_ids"]) == len(cut["logprobs"])
    assert cut["logprobs"] == remote["logprobs"][: len(cut["token_ids"])]


# ---------------------------------------------------------------- cancel / disconnect


def test_logprobs_over_the_wire(client: Client, engine: object) -> None:
    """Each token's log-probability and its alternatives reach the client,
    greedy and sampled alike; a request that did not ask gets none."""
    prompt = prompts(1)[0]
    greedy = client.generate(prompt, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)
    sampled = client.generate(prompt, max_tokens=12, ignore_eos=True, temperature=1.0, seed=4,
                              logprobs=True)  # fmt: skip
    plain = client.generate(prompt, max_tokens=12, ignore_eos=True).result()
    result = greedy.result()
    assert result.token_ids == plain.token_ids and plain.logprobs == []
    assert [t.token_id for t in result.logprobs] == result.token_ids
    for token in result.logprobs:
        assert len(token.top) == 3 and token.top[0] == (token.token_id, token.logprob)
        assert token.logprob <= 0 and [lp for _, lp in token.top] == sorted(
            (lp for _, lp in token.top), reverse=True
        )
    drawn = sampled.result()
    assert [t.token_id for t in drawn.logprobs] == drawn.token_ids
    assert all(t.top == [] and t.logprob <= 0 for t in drawn.logprobs)


def test_cancel_mid_stream_frees_blocks(client: Client) -> None:
    stream = client.stream()
    victim = stream.generate(prompts(1)[0], max_tokens=LONG, ignore_eos=True)
    neighbour = stream.generate(prompts(2)[1], max_tokens=10, ignore_eos=True)
    seen, cancelled = 0, False
    for chunk in victim:
        seen += len(chunk.token_ids)
        if seen >= 3 and not cancelled:  # a chunk may hold several tokens
            victim.cancel()
            cancelled = True
    result = victim.result(timeout=10)
    assert result.finish_reason == "cancelled" and result.status_code == "CANCELLED"
    assert 3 <= len(result.token_ids) < LONG
    assert neighbour.result(timeout=30).finish_reason == "max_tokens"
    stream.close()
    assert wait_until(lambda: engine_idle(client), timeout_s=1.0)


def test_cli_cancel_after(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    from slipstream.service.cli import main

    argv = ["generate", "--server", server.target, "--prompt", "Hello", "--prompt", "Bye"]
    argv += ["--max-tokens", str(LONG), "--ignore-eos", "--cancel-after", "3", "--json"]
    assert main(argv) == 0
    outputs = json_lines(capsys.readouterr().out)
    assert [o["finish_reason"] for o in outputs] == ["cancelled", "cancelled"]
    assert all(3 <= len(o["token_ids"]) < LONG for o in outputs)


def test_cli_first_token_timeout(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    from slipstream.service.cli import main

    argv = ["generate", "--server", server.target, "--prompt", "Hello", "--json"]
    assert main([*argv, "--max-tokens", "4", "--first-token-timeout", "0.000001"]) == 1
    assert main([*argv, "--max-tokens", "4", "--first-token-timeout", "60000"]) == 0
    late, ok = json_lines(capsys.readouterr().out)
    assert late["finish_reason"] == "deadline_exceeded" and late["token_ids"] == []
    assert late["status_code"] == "DEADLINE_EXCEEDED"
    assert ok["finish_reason"] in ("max_tokens", "eos") and "status_code" not in ok


def test_cli_says_why_a_request_failed_and_exits_1(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refused prompt's line carries the status, reason and message the
    server gave (the same from the in-process engine); the others print as
    before, and the exit status says one failed."""
    from slipstream.service.cli import main

    common = ["--prompt", "", "--prompt", "Hello", "--max-tokens", "4", "--json"]
    outputs = {}
    for where in (
        ["--server", server.target],
        ["--local", "--model", "tiny", "--dtype", "float32"],
    ):
        assert main(["generate", *where, *common]) == 1
        captured = capsys.readouterr()
        outputs[where[0]] = json_lines(captured.out)
        assert "slipstream: error: 1 of 2 requests did not finish OK" in captured.err
        assert "INVALID_ARGUMENT: prompt text is empty" in captured.err
    assert outputs["--server"] == outputs["--local"]
    refused, fine = outputs["--server"]
    assert refused["finish_reason"] == "rejected" and refused["status_code"] == "INVALID_ARGUMENT"
    assert refused["reject_reason"] == "invalid" and refused["message"] == "prompt text is empty"
    assert fine["token_ids"] and set(fine) == {"index", "token_ids", "text", "finish_reason"}
    # the text form says the same
    assert main(["generate", "--server", server.target, "--prompt", ""]) == 1
    out = capsys.readouterr().out
    assert "\n[0] (rejected, INVALID_ARGUMENT, invalid: prompt text is empty)" in "\n" + out


def test_client_disconnect_aborts_all_its_requests(client: Client, server: ServerThread) -> None:
    with Client(server.target) as other:
        stream = other.stream()
        generations = [stream.generate(p, max_tokens=LONG, ignore_eos=True) for p in prompts(4)]
        next(iter(generations[0]))  # running
        assert client.server_stats().running + client.server_stats().waiting >= 1
        stream.abort()
        for g in generations:
            with pytest.raises(StreamError) as err:
                g.result(timeout=10)
            assert err.value.code == "CANCELLED"
    assert wait_until(lambda: engine_idle(client), timeout_s=1.0)


def test_dropped_channel_aborts_requests(server: ServerThread, client: Client) -> None:
    # The whole connection goes away without a cancel, as when a client dies.
    other = Client(server.target)
    stream = other.stream()
    g = stream.generate(prompts(1)[0], max_tokens=LONG, ignore_eos=True)
    next(iter(g))
    other._channel.close()
    assert wait_until(lambda: engine_idle(client), timeout_s=1.0)


# ---------------------------------------------------------------- deadlines


def test_infeasible_deadline_is_rejected_early() -> None:
    # With early rejection on (the default), a deadline that even a request
    # running alone cannot meet is answered at once, and only that request fails.
    from slipstream.service.engine.loader import load_engine

    eng = load_engine(EngineConfig(model="tiny", dtype="float32"))
    eng.start()
    srv = ServerThread(eng)
    try:
        with Client(srv.target) as c:
            stream = c.stream()
            doomed = stream.generate(
                prompts(1)[0], max_tokens=900, ignore_eos=True, deadline_s=0.01
            )
            neighbour = stream.generate(prompts(2)[1], max_tokens=5, ignore_eos=True)
            stream.close()
            result = doomed.result(timeout=10)
            assert result.finish_reason == "rejected", result
            assert result.reject_reason == "deadline_infeasible"
            assert result.token_ids == []
            assert neighbour.result(timeout=30).finish_reason == "max_tokens"
    finally:
        srv.stop()
        eng.shutdown()


def test_request_deadline_finishes_deadline_exceeded(client: Client) -> None:
    stream = client.stream()
    late = stream.generate(prompts(1)[0], max_tokens=LONG, ignore_eos=True, deadline_s=0.3)
    neighbour = stream.generate(prompts(2)[1], max_tokens=10, ignore_eos=True)
    stream.close()
    result = late.result(timeout=10)
    assert result.finish_reason == "deadline_exceeded", result
    assert 0.25 <= result.total_s < 2.0
    assert len(result.token_ids) < LONG
    assert neighbour.result(timeout=30).finish_reason == "max_tokens"
    assert wait_until(lambda: engine_idle(client))


def test_first_token_timeout_expires_and_says_so(stub: pb_grpc.InferenceStub) -> None:
    # Early rejection is off on this engine: the limit passes in the queue.
    late = _submit("ft", first_token_timeout=Duration(nanos=1))
    neighbour = _submit("ok", first_token_timeout=Duration(seconds=60))
    finished = {
        r.request_id: r.finished
        for r in stub.Generate(iter([late, neighbour]), timeout=30)
        if r.WhichOneof("event") == "finished"
    }
    assert finished["ft"].reason == pb.FINISH_REASON_DEADLINE_EXCEEDED
    assert finished["ft"].expired_limit == pb.EXPIRED_LIMIT_FIRST_TOKEN
    assert finished["ok"].reason in (pb.FINISH_REASON_MAX_TOKENS, pb.FINISH_REASON_EOS)
    assert finished["ok"].expired_limit == pb.EXPIRED_LIMIT_UNSPECIFIED


def test_call_deadline_bounds_every_request(
    client: Client, engine: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold_every_submit(engine, monkeypatch)  # no request may finish before the deadline
    stream = client.stream(timeout=0.5)
    generations = [stream.generate(p, max_tokens=LONG, ignore_eos=True) for p in prompts(3)]
    for g in generations:
        try:
            outcome = g.result(timeout=10).finish_reason
        except StreamError as exc:
            outcome = exc.code
        assert outcome in ("DEADLINE_EXCEEDED", "deadline_exceeded")
    assert wait_until(lambda: engine_idle(client), timeout_s=1.0)


# ---------------------------------------------------------------- rejection


def _submit(request_id: str, **fields: object) -> pb.GenerateRequest:
    fields.setdefault("token_ids", pb.TokenIds(ids=[11, 12, 13]))
    fields.setdefault("stopping", pb.StoppingCriteria(max_new_tokens=8))
    return pb.GenerateRequest(submit=pb.Submit(request_id=request_id, **fields))


def _with_unknown_field() -> pb.GenerateRequest:
    message = _submit("unknown-field")
    raw = message.submit.SerializeToString() + bytes([0xF8, 0x3E, 0x01])  # field 999, varint 1
    message.submit.Clear()
    message.submit.MergeFromString(raw)
    message.submit.request_id = "unknown-field"
    return message


def _with_nested_unknown_field() -> pb.GenerateRequest:
    # The unknown field sits inside the token ids, not on the submit itself.
    message = _submit("nested-unknown")
    raw = message.submit.token_ids.SerializeToString() + bytes([0xF8, 0x3E, 0x01])
    message.submit.token_ids.Clear()
    message.submit.token_ids.MergeFromString(raw)
    return message


LONG_ID = "x" * 129  # one byte over the limit

MALFORMED = {
    "empty-text": (_submit("empty-text", text="", token_ids=None), pb.REJECT_REASON_INVALID),
    "no-prompt": (
        pb.GenerateRequest(submit=pb.Submit(request_id="no-prompt")),
        pb.REJECT_REASON_INVALID,
    ),
    "too-long": (
        _submit("too-long", token_ids=pb.TokenIds(ids=[9] * 1100)),
        pb.REJECT_REASON_PROMPT_TOO_LONG,
    ),
    "zero-tokens": (
        _submit("zero-tokens", stopping=pb.StoppingCriteria(max_new_tokens=0)),
        pb.REJECT_REASON_INVALID,
    ),
    "huge-tokens": (
        _submit("huge-tokens", stopping=pb.StoppingCriteria(max_new_tokens=10**6)),
        pb.REJECT_REASON_INVALID,
    ),
    "negative-priority": (_submit("negative-priority", priority=-1), pb.REJECT_REASON_INVALID),
    "bad-token": (
        _submit("bad-token", token_ids=pb.TokenIds(ids=[1, 10**6])),
        pb.REJECT_REASON_INVALID,
    ),
    "negative-temperature": (
        _submit("negative-temperature", sampling=pb.SamplingParams(temperature=-1)),
        pb.REJECT_REASON_INVALID,
    ),
    "zero-top-p": (
        _submit("zero-top-p", sampling=pb.SamplingParams(top_p=0.0)),
        pb.REJECT_REASON_INVALID,
    ),
    "too-many-top-logprobs": (
        _submit("too-many-top-logprobs", return_logprobs=True, top_logprobs=21),
        pb.REJECT_REASON_INVALID,
    ),
    "top-logprobs-alone": (_submit("top-logprobs-alone", top_logprobs=2), pb.REJECT_REASON_INVALID),
    "empty-stop-sequence": (  # the wire's format check
        _submit("empty-stop-sequence", stopping=pb.StoppingCriteria(stop_sequences=["end", ""])),
        pb.REJECT_REASON_INVALID,
    ),
    "unknown-field": (_with_unknown_field(), pb.REJECT_REASON_INVALID),
    "nested-unknown": (_with_nested_unknown_field(), pb.REJECT_REASON_INVALID),
    # ~1e14 s once raised OverflowError and ended the whole stream UNKNOWN.
    "huge-timeout": (
        _submit("huge-timeout", timeout=Duration(seconds=10**14)),
        pb.REJECT_REASON_INVALID,
    ),
    "max-duration-timeout": (  # the largest valid Duration is accepted as a deadline
        _submit("max-duration-timeout", timeout=Duration(seconds=315_576_000_000)),
        None,
    ),
    "negative-timeout": (
        _submit("negative-timeout", timeout=Duration(seconds=-1)),
        pb.REJECT_REASON_INVALID,
    ),
    "huge-deadline": (
        _submit("huge-deadline", deadline=Timestamp(seconds=10**15)),
        pb.REJECT_REASON_INVALID,
    ),
    LONG_ID: (_submit(LONG_ID), pb.REJECT_REASON_INVALID),
    "neighbour": (  # a duplicate of the running neighbour's id
        _submit("neighbour"),
        pb.REJECT_REASON_DUPLICATE_REQUEST_ID,
    ),
    "": (_submit(""), pb.REJECT_REASON_INVALID),
}


def test_each_malformed_submit_is_rejected_alone(
    stub: pb_grpc.InferenceStub, client: Client
) -> None:
    neighbour = _submit(
        "neighbour", stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True)
    )
    finished: dict[str, pb.Finished] = {}
    chunks: dict[str, int] = {}
    for response in stub.Generate(
        iter([neighbour, *(m for m, _ in MALFORMED.values())]), timeout=30
    ):
        kind = response.WhichOneof("event")
        if kind == "chunk":
            chunks[response.request_id] = chunks.get(response.request_id, 0) + 1
        elif kind == "finished":
            finished.setdefault(response.request_id, response.finished)
    # The neighbour's own Finished is the first one under its id; the duplicate's
    # rejection arrives while it is still running.
    rejected = {rid: f for rid, f in finished.items() if f.reason == pb.FINISH_REASON_REJECTED}
    for rid, (_, reason) in MALFORMED.items():
        if reason is None:  # well-formed after all: it runs to completion
            assert finished[rid].reason in (pb.FINISH_REASON_MAX_TOKENS, pb.FINISH_REASON_EOS), rid
            continue
        if rid == "neighbour":
            continue
        assert rid in rejected, rid
        assert rejected[rid].reject_reason == reason, (rid, rejected[rid])
        assert rejected[rid].message
    # The scheduler's own checks speak of the request, not of its stream-scoped id.
    assert rejected["negative-priority"].message == "priority must be >= 0"
    assert rejected["negative-temperature"].message == "temperature must be >= 0"
    assert chunks.get("neighbour", 0) >= 1


def test_duplicate_id_rejected_while_original_finishes(stub: pb_grpc.InferenceStub) -> None:
    original = _submit("dup", stopping=pb.StoppingCriteria(max_new_tokens=30, ignore_eos=True))
    responses = list(stub.Generate(iter([original, _submit("dup")]), timeout=30))
    finished = [r.finished for r in responses if r.WhichOneof("event") == "finished"]
    assert sorted((f.reason, f.reject_reason) for f in finished) == [
        (pb.FINISH_REASON_MAX_TOKENS, pb.REJECT_REASON_UNSPECIFIED),
        (pb.FINISH_REASON_REJECTED, pb.REJECT_REASON_DUPLICATE_REQUEST_ID),
    ]
    # Its message says which request it answers: the running one goes on.
    rejected = next(f for f in finished if f.reject_reason)
    assert rejected.status_code == "ALREADY_EXISTS"
    assert rejected.message == (
        "request_id 'dup' is already running on this stream; "
        "that request goes on, this submit is refused"
    )


def test_message_without_submit_or_cancel_fails_the_call(stub: pb_grpc.InferenceStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(iter([pb.GenerateRequest()]), timeout=10))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- unary, health, reflection


def test_unary_calls(client: Client, engine: object) -> None:
    info = client.model_info()
    assert (info.name, info.max_context, info.vocab_size) == ("tiny", 1024, 4096)
    assert info.block_size == 32 and info.dtype == "float32"
    assert info.cpu.model and info.cpu.torch_capability  # the CPU that decided the dtype
    assert info.requested_dtype == CONFIG.dtype
    assert info.weights_packed == detect().can_pack_fp32
    assert client.tokenize("Hello world") == engine.tokenizer.encode("Hello world")  # type: ignore[attr-defined]
    stats = client.server_stats()
    assert stats.kv_blocks_free.device > 0 and not stats.draining


def test_health_serving(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "slipstream.v1.Inference"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_services_and_serves_descriptors(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        asks = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="slipstream.v1.Inference"
            ),
        ]
        listed, described = list(reflection.ServerReflectionInfo(iter(asks), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {"slipstream.v1.Inference", "grpc.health.v1.Health"} <= names
    assert any("reflection" in n for n in names)
    files = described.file_descriptor_response.file_descriptor_proto
    protos = [descriptor_pb2.FileDescriptorProto.FromString(f) for f in files]
    services = {s.name for p in protos for s in p.service}
    assert "Inference" in services


# ---------------------------------------------------------------- freshly generated stubs

# Runs with no site-packages .pth files (python -S), so `slipstream` can only
# be the freshly generated folder: the path a team in any language takes.
DRIVER = textwrap.dedent(
    """
    import json, sys
    import grpc
    from slipstream.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
    assert pb.__file__.startswith(sys.argv[2]), pb.__file__
    channel = grpc.insecure_channel(sys.argv[1])
    stub = pb_grpc.InferenceStub(channel)
    def requests():
        for rid in ("x", "y"):
            yield pb.GenerateRequest(submit=pb.Submit(
                request_id=rid, text="Hello from a fresh stub",
                stopping=pb.StoppingCriteria(max_new_tokens=6, ignore_eos=True)))
        yield pb.GenerateRequest(cancel=pb.Cancel(request_id="y"))
    out = {"ids": {}, "reasons": {}}
    for r in stub.Generate(requests(), timeout=30):
        if r.HasField("chunk"):
            out["ids"].setdefault(r.request_id, []).extend(r.chunk.token_ids)
        elif r.HasField("finished"):
            out["reasons"][r.request_id] = pb.FinishReason.Name(r.finished.reason)
    out["vocab"] = stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
    print(json.dumps(out))
    """
)


def test_freshly_generated_stubs_drive_the_server(server: ServerThread, tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "protos" / "generate.py"), "--out", str(tmp_path)], check=True
    )
    assert (tmp_path / "slipstream" / "v1" / "inference_pb2_grpc.py").exists()
    assert (tmp_path / "slipstream" / "v1" / "inference_pb2.pyi").exists()
    site = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{site}"}
    done = subprocess.run(
        [sys.executable, "-S", "-c", DRIVER, server.target, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["vocab"] == 4096
    assert out["reasons"]["x"] == "FINISH_REASON_MAX_TOKENS" and len(out["ids"]["x"]) == 6
    assert out["reasons"]["y"] in ("FINISH_REASON_CANCELLED", "FINISH_REASON_MAX_TOKENS")

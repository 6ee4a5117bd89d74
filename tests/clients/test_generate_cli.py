"""``slipstream generate --cancel-after N`` prints a request's first N
tokens in every mode: from a scripted server that made them all before the
cancel reached it, on a stream or a call of its own, and from a local engine
that made one step more."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from conftest import BURST_PROMPT, ScriptedServer, ScriptedServicer

from slipstream.scheduler.request import FinishReason, SamplingParams
from slipstream.service.cli import main
from slipstream.service.cli.generate import Output, _LocalCollector
from slipstream.service.engine.events import FinishEvent, RequestSpec, TokenEvent
from slipstream.v1 import inference_pb2 as pb


def _generate(scripted: ScriptedServer, capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    argv = ["generate", "--server", scripted.target, "--prompt", BURST_PROMPT, "--json"]
    assert main([*argv, *flags]) == 0
    [output] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return output


@pytest.mark.parametrize("mode", [[], ["--per-request"]])
def test_the_first_n_tokens_are_printed_and_no_more(
    scripted: ScriptedServer, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    output = _generate(scripted, capsys, *mode, "--max-tokens", "10", "--cancel-after", "3")
    assert output == {
        "index": 0,
        "token_ids": [0, 1, 2],
        "text": "t0 t1 t2 ",
        "finish_reason": "cancelled",
    }


def test_a_request_that_ended_at_its_nth_token_keeps_its_reason(
    scripted: ScriptedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    output = _generate(scripted, capsys, "--max-tokens", "3", "--cancel-after", "3")
    assert (output["token_ids"], output["text"]) == ([0, 1, 2], "t0 t1 t2 !")
    assert output["finish_reason"] == "max_tokens"


def test_the_local_engine_prints_the_first_n_tokens_too() -> None:
    aborted: list[str] = []
    collector = _LocalCollector(SimpleNamespace(abort=aborted.append), "0", cancel_after=3)
    for i in range(5):  # a step planned ahead made two tokens after the abort
        collector.on_event(TokenEvent("0", [i], f"t{i} ", i, i, i, 1, 0.0))
    collector.on_event(FinishEvent("0", FinishReason.CANCELLED))
    output = collector.wait(0)
    assert aborted == ["0"]
    assert (output.token_ids, output.text, output.finish_reason) == (
        [0, 1, 2],
        "t0 t1 t2 ",
        "cancelled",
    )


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (
            ["--server", "127.0.0.1:1", "--model", "smollm2", "--dtype", "float32"],
            "--model, --dtype apply only to --local, not with --server",
        ),
        (["--server", "127.0.0.1:1", "--threads", "2"], "--threads applies only to --local"),
        (
            ["--local", "--per-request", "--balanced", "--token", "x", "--tls"],
            "--tls, --token, --per-request, --balanced apply only to --server, not with --local",
        ),
        (["--local", "--tls-ca", "ca.pem"], "--tls-ca applies only to --server"),
        (["--server", "127.0.0.1:1", "--logprobs", "2"], "--logprobs shows in the JSON lines"),
    ],
)
def test_a_flag_the_mode_would_ignore_is_refused(
    flags: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were ignored: --model smollm2 with --server printed the server's
    model's text and exit 0."""
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--prompt", "hi", *flags])
    assert exited.value.code == 2
    assert f"slipstream: error: {complaint}" in capsys.readouterr().err


def test_a_token_from_the_environment_is_not_a_flag_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import slipstream.service.cli.generate as generate

    monkeypatch.setenv("SLIPSTREAM_TOKEN", "from-the-environment")
    ran = []

    def run_local(specs: list, args: object) -> list[Output]:
        ran.append(specs)
        return [Output(0, [1], "x", "max_tokens")]

    monkeypatch.setattr(generate, "run_local", run_local)
    assert main(["generate", "--local", "--prompt", "hi", "--model", "tiny"]) == 0
    assert len(ran) == 1 and capsys.readouterr().out == "[0] (max_tokens) x\n"


SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}}'


@pytest.mark.parametrize(
    ("flags", "kind", "value"),
    [
        (["--json-schema", SCHEMA], "json_schema", SCHEMA),
        (["--json-schema", "FILE"], "json_schema", SCHEMA),
        (["--json-object"], "json_object", True),
        (["--regex", "[0-9]+"], "regex", "[0-9]+"),
    ],
    ids=["schema", "schema_file", "json_object", "regex"],
)
@pytest.mark.parametrize("mode", [[], ["--per-request"]], ids=["stream", "per_request"])
def test_a_constraint_flag_reaches_the_submit(
    scripted: ScriptedServer,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    flags: list[str],
    kind: str,
    value: object,
    mode: list[str],
) -> None:
    (tmp_path / "schema.json").write_text(SCHEMA)
    flags = [str(tmp_path / "schema.json") if f == "FILE" else f for f in flags]
    _generate(scripted, capsys, *mode, "--max-tokens", "2", *flags)
    [submit] = scripted.servicer.recorded.submits
    assert submit.constraint.WhichOneof("kind") == kind
    assert getattr(submit.constraint, kind) == value


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--json-schema", '{"type":'], "argument --json-schema: not JSON"),
        (["--json-schema", "/no/such/schema.json"], "/no/such/schema.json: cannot read it"),
        (["--regex", "x", "--json-object"], "not allowed with argument"),
    ],
)
def test_a_constraint_flag_that_cannot_be_right_is_refused(
    capsys: pytest.CaptureFixture[str], flags: list[str], complaint: str
) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--server", "127.0.0.1:1", "--prompt", "hi", *flags])
    assert complaint in capsys.readouterr().err


def test_the_local_engine_follows_a_constraint_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """tiny's random weights never write three digits unasked."""
    argv = ["generate", "--local", "--prompt", "hi", "--prompt", "Once", "--json"]
    argv += ["--max-tokens", "8", "--regex", "[0-9]{3}"]
    assert main([*argv, "--dtype", "float32", "--no-calibrate", "--kv-memory", "lazy"]) == 0
    outputs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["finish_reason"] for o in outputs] == ["stop_sequence"] * 2
    assert all(re.fullmatch("[0-9]{3}", o["text"]) for o in outputs), outputs


SAMPLING_FLAGS = ["--presence-penalty", "1.5", "--frequency-penalty", "-0.5"]
SAMPLING_FLAGS += ["--repetition-penalty", "1.25"]
SAMPLING_FLAGS += ["--logit-bias", "7=-100", "--logit-bias", "11=2.5"]


@pytest.mark.parametrize("mode", [[], ["--per-request"]], ids=["stream", "per_request"])
def test_the_sampling_flags_reach_the_submit(
    scripted: ScriptedServer, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    _generate(scripted, capsys, *mode, "--max-tokens", "2", *SAMPLING_FLAGS)
    _generate(scripted, capsys, *mode, "--max-tokens", "2")
    adjusted, bare = (s.sampling for s in scripted.servicer.recorded.submits)
    assert (adjusted.presence_penalty, adjusted.frequency_penalty) == (1.5, -0.5)
    assert adjusted.repetition_penalty == 1.25
    assert dict(adjusted.logit_bias) == {7: -100.0, 11: 2.5}
    assert (bare.presence_penalty, bare.frequency_penalty) == (0, 0)
    assert not bare.HasField("repetition_penalty") and not bare.logit_bias


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> list[RequestSpec]:
    """What ``generate --local`` submits, to an engine that ends each request at once."""
    import slipstream.service.engine.loader as loader

    submitted: list[RequestSpec] = []

    class Engine:
        tokenizer = None

        def start(self) -> None: ...
        def shutdown(self) -> None: ...

        def submit(self, request: RequestSpec, on_event: Callable[[object], None]) -> None:
            submitted.append(request)
            on_event(FinishEvent(request.req_id, FinishReason.MAX_TOKENS))

    monkeypatch.setattr(loader, "load_engine", lambda config: Engine())
    return submitted


def test_the_local_engine_is_given_the_sampling_flags(
    submitted: list[RequestSpec], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "prompts.jsonl").write_text('{"prompt_token_ids": [1, 2]}\n')
    argv = ["generate", "--local", "--prompts-file", str(tmp_path / "prompts.jsonl")]
    assert main([*argv, *SAMPLING_FLAGS]) == 0
    assert main(argv) == 0
    adjusted, bare = (r.sampling for r in submitted)
    assert adjusted == SamplingParams(
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.25,
        logit_bias=((7, -100.0), (11, 2.5)),
    )
    assert bare == SamplingParams() and not bare.has_logit_adjustments


def test_the_local_engine_follows_a_logit_bias_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """A bias of 100 makes token 7 the only choice, at every step."""
    argv = ["generate", "--local", "--prompt", "hi", "--json", "--max-tokens", "3"]
    argv += ["--ignore-eos", "--logit-bias", "7=100"]
    assert main([*argv, "--dtype", "float32", "--no-calibrate", "--kv-memory", "lazy"]) == 0
    [output] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert output["token_ids"] == [7, 7, 7], output


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--presence-penalty", "2.5"], "argument --presence-penalty: must be in [-2, 2], got 2.5"),
        (["--frequency-penalty", "nan"], "argument --frequency-penalty: must be in [-2, 2]"),
        (["--repetition-penalty", "0"], "argument --repetition-penalty: must be in [0.01, 100]"),
        (["--logit-bias", "7"], "argument --logit-bias: expected ID=BIAS, got '7'"),
        (["--logit-bias", "x=1"], "argument --logit-bias: expected a token id before '='"),
        (["--logit-bias", "7=-101"], "argument --logit-bias: must be in [-100, 100], got -101"),
        (["--logit-bias", "7=big"], "argument --logit-bias: expected a number, got 'big'"),
        (["--logit-bias", f"{2**32}=1"], "argument --logit-bias: 4294967296 is not a token id"),
        (["--logit-bias", "7=1", "--logit-bias", "7=-1"], "token 7 is biased twice"),
        (["--min-p", "1.5"], "argument --min-p: must be in [0, 1], got 1.5"),
        (["--min-p", "nan"], "argument --min-p: must be in [0, 1], got nan"),
        (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
        (["--top-k", "-1"], "argument --top-k: must be in [0, 4294967295], got -1"),
        (["--min-tokens", "-1"], "argument --min-tokens: must be in [0, 4294967295], got -1"),
        (["--stop-token-id", "x"], "argument --stop-token-id: expected a token id, got 'x'"),
        (["--stop-token-id", "-1"], "argument --stop-token-id: -1 is not a token id"),
        ([f for i in range(65) for f in ("--stop-token-id", str(i))], "at most 64 ids"),
        (["--max-tokens", "3", "--min-tokens", "4"], "--min-tokens (4) must be at most"),
    ],
)
def test_a_sampling_flag_that_cannot_be_right_is_refused(
    capsys: pytest.CaptureFixture[str], flags: list[str], complaint: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--server", "127.0.0.1:1", "--prompt", "hi", *flags])
    assert exited.value.code == 2
    assert complaint in capsys.readouterr().err


def test_more_biased_tokens_than_the_server_takes_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = [f for i in range(1025) for f in ("--logit-bias", f"{i}=1")]
    with pytest.raises(SystemExit):
        main(["generate", "--server", "127.0.0.1:1", "--prompt", "hi", *flags])
    assert "argument --logit-bias: at most 1024 tokens" in capsys.readouterr().err


NEW_FLAGS = ["--top-p", "0.9", "--top-k", "5", "--min-p", "0.1", "--min-tokens", "1"]
NEW_FLAGS += ["--stop-token-id", "3", "--stop-token-id", "8"]


@pytest.mark.parametrize("mode", [[], ["--per-request"]], ids=["stream", "per_request"])
def test_the_new_sampling_flags_reach_the_submit(
    scripted: ScriptedServer, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    _generate(scripted, capsys, *mode, "--max-tokens", "2", *NEW_FLAGS)
    _generate(scripted, capsys, *mode, "--max-tokens", "2")
    given, bare = scripted.servicer.recorded.submits
    assert given.sampling.top_p == pytest.approx(0.9) and given.sampling.top_k == 5
    assert given.sampling.min_p == pytest.approx(0.1)
    assert given.stopping.min_tokens == 1 and list(given.stopping.stop_token_ids) == [3, 8]
    assert not bare.sampling.HasField("top_p") and not bare.sampling.HasField("min_p")
    assert bare.sampling.top_k == bare.stopping.min_tokens == 0
    assert not bare.stopping.stop_token_ids


def test_the_local_engine_is_given_the_new_sampling_flags(
    submitted: list[RequestSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["generate", "--local", "--prompt", "hi", "--max-tokens", "4"]
    monkeypatch.setattr(
        "slipstream.service.cli.generate._local_prompt_ids", lambda spec, tokenizer: [1, 2]
    )
    assert main([*argv, *NEW_FLAGS]) == 0
    [request] = submitted
    assert request.sampling == SamplingParams(
        top_p=0.9, top_k=5, min_p=0.1, min_tokens=1, stop_token_ids=(3, 8)
    )


def test_local_says_which_model_it_runs_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """tiny, the default, answers noise: a line says so, and stdout stays JSON."""
    argv = ["generate", "--local", "--prompt", "hi", "--max-tokens", "2", "--json"]
    assert main([*argv, "--dtype", "float32", "--no-calibrate", "--kv-memory", "lazy"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["index"] == 0
    assert "slipstream: generating on model tiny (random weights: its text is noise" in err


@pytest.mark.parametrize(("command", "model"), [("generate", "tiny"), ("serve", "smollm2")])
def test_model_help_gives_the_command_s_default(
    command: str, model: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # one line a flag
    with pytest.raises(SystemExit):
        main([command, "--help"])
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("--model")]
    assert line.endswith(f"(default: {model})")


def test_json_output_writes_non_ascii_text_as_itself() -> None:
    """It was valid JSON of \\u escapes: unreadable CJK and emoji in a terminal."""
    line = Output(0, [1, 2], "日本 🎉", "max_tokens").to_json()
    assert "日本 🎉" in line and json.loads(line)["text"] == "日本 🎉"


@pytest.mark.parametrize("mode", [[], ["--per-request"]])
def test_an_unreachable_server_is_named(
    mode: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """As stats and chat name it."""
    assert main(["generate", "--server", "127.0.0.1:1", "--prompt", "hi", *mode]) == 1
    assert capsys.readouterr().err.startswith("slipstream: error: 127.0.0.1:1: UNAVAILABLE")


class _BreakingServicer(ScriptedServicer):
    """Finishes a request of 1 token; sends one token of any other, then
    the call breaks (UNAVAILABLE, as when the server dies)."""

    NUM_REQUESTS = 2  # on a stream: answered once all have arrived

    async def Generate(
        self, request_iterator: AsyncIterator[pb.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        submits = []
        async for message in request_iterator:  # the client half-closes only when all finish
            submits.append(message.submit)
            if len(submits) == self.NUM_REQUESTS:
                break
        for submit in sorted(submits, key=lambda s: s.stopping.max_new_tokens):
            for response in self._answer(submit):
                yield response
        await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    async def GenerateOne(
        self, submit: pb.Submit, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        for response in self._answer(submit):
            yield response
        if submit.stopping.max_new_tokens > 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    @staticmethod
    def _answer(submit: pb.Submit) -> Iterator[pb.GenerateResponse]:
        rid = submit.request_id
        yield pb.GenerateResponse(request_id=rid, accepted=pb.Accepted())
        chunk = pb.TokenChunk(token_ids=[7], text="t7 ", index=0)
        yield pb.GenerateResponse(request_id=rid, chunk=chunk)
        if submit.stopping.max_new_tokens == 1:
            finished = pb.Finished(reason=pb.FINISH_REASON_MAX_TOKENS, status_code="OK")
            yield pb.GenerateResponse(request_id=rid, finished=finished)


class _BreakingServer(ScriptedServer):
    async def _start(self) -> tuple[grpc.aio.Server, int]:
        self.servicer = _BreakingServicer()
        return await super()._start()


@pytest.mark.parametrize("mode", [[], ["--per-request"]])
def test_a_broken_call_still_prints_the_requests_that_finished(
    mode: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing was printed but the call's error, not even the requests
    that had finished before it broke."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a", "max_tokens": 1}\n{"prompt": "b", "max_tokens": 9}\n')
    server = _BreakingServer()
    try:
        argv = ["generate", "--server", server.target, "--prompts-file", str(prompts), *mode]
        assert main(argv) == 1
    finally:
        server.stop()
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "[0] (max_tokens) t7 ",
        "[1] (error, UNAVAILABLE: Socket closed) t7 ",
    ]
    assert "1 of 2 requests did not finish OK (the first, [1]: UNAVAILABLE" in err


def _interrupted(
    command: list[str], tmp_path: Path, started: Callable[[str], bool]
) -> tuple[int, str, str]:
    """Runs ``slipstream COMMAND`` in a child process, sends it SIGINT (as
    Ctrl-C does) once ``started(what it wrote to stderr so far)``, and
    returns its exit status, stdout and stderr."""
    argv = [sys.executable, "-m", "slipstream.service.cli", *command]
    err = tmp_path / "stderr"
    with err.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            deadline = time.monotonic() + 60
            while not started(err.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, "it never started"
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    return proc.returncode, out, err.read_text()


@pytest.mark.parametrize("mode", [[], ["--per-request"]])
def test_ctrl_c_while_generating_is_one_line_and_exit_130(
    scripted: ScriptedServer, mode: list[str], tmp_path: Path
) -> None:
    """It printed a 30-line traceback (CancelledError, then KeyboardInterrupt)."""
    submits = scripted.servicer.recorded.submits
    command = ["generate", "--server", scripted.target, "--prompt", "hi", "--prompt", "ho"]
    ended = _interrupted(
        [*command, "--max-tokens", "100000", *mode], tmp_path, lambda _: len(submits) == 2
    )
    assert ended == (130, "", "slipstream: interrupted\n")


def test_ctrl_c_while_a_local_engine_loads_is_one_line_and_exit_130(tmp_path: Path) -> None:
    command = ["generate", "--local", "--prompt", "hi", "--max-tokens", "1000"]
    # The line it prints before it loads the model.
    returncode, out, err = _interrupted(command, tmp_path, lambda err: "on model tiny" in err)
    assert (returncode, out) == (130, "")
    assert err.endswith("\nslipstream: interrupted\n") and "Traceback" not in err

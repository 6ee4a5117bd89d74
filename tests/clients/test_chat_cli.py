"""``slipstream chat`` and the clients' ``chat`` against the scripted server:
the conversation is kept across turns, Ctrl-C cancels only the current
answer, and a conversation reaches the wire as ``Submit.messages``."""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ScriptedServer

from slipstream.clients import AsyncClient, Client
from slipstream.clients.wire import Conversation, GenerateOptions, build_submit
from slipstream.service.cli import main
from slipstream.service.cli.chat import ChatSession, chat_loop


def _feed(lines: list[str]) -> object:
    """A ``read_line`` that answers the prompts with ``lines``, then EOF."""
    pending: Iterator[str] = iter(lines)

    def read_line(prompt: str) -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    return read_line


def _sent(scripted: ScriptedServer) -> list[list[tuple[str, str]]]:
    return [
        [(m.role, m.content) for m in submit.messages.messages]
        for submit in scripted.servicer.recorded.submits
    ]


def test_the_conversation_is_kept_across_turns(scripted: ScriptedServer) -> None:
    out = io.StringIO()
    with Client(scripted.target) as client:
        session = ChatSession(client, out, system="Be brief.", options={"max_tokens": 3})
        assert chat_loop(session, _feed(["hello", "", "and then?"]), out) == 0  # type: ignore[arg-type]
    answer = "t0 t1 t2 !"  # the scripted tokens, then Finished.text
    assert _sent(scripted) == [
        [("system", "Be brief."), ("user", "hello")],
        [("system", "Be brief."), ("user", "hello"), ("assistant", answer), ("user", "and then?")],
    ]
    assert session.messages[-1] == ("assistant", answer)
    assert out.getvalue().count(answer) == 2, "each answer streamed, tail included"


def test_reset_and_exit(scripted: ScriptedServer) -> None:
    out = io.StringIO()
    with Client(scripted.target) as client:
        session = ChatSession(client, out, options={"max_tokens": 1})
        chat_loop(session, _feed(["one", "/reset", "two", "/exit", "never sent"]), out)  # type: ignore[arg-type]
    assert _sent(scripted) == [[("user", "one")], [("user", "two")]]
    assert "(new conversation)" in out.getvalue()


class _InterruptOnFirstToken(io.StringIO):
    """Raises KeyboardInterrupt at the first streamed text, as Ctrl-C would."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def write(self, text: str) -> int:
        if self.armed and text.startswith("t"):
            self.armed = False
            raise KeyboardInterrupt
        return super().write(text)


def test_ctrl_c_cancels_only_the_current_answer(scripted: ScriptedServer) -> None:
    out = _InterruptOnFirstToken()
    with Client(scripted.target) as client:
        session = ChatSession(client, out, options={"max_tokens": 1000})
        out.armed = True
        cancelled = session.ask("a long story please")
        assert cancelled.finish_reason == "cancelled"
        assert len(cancelled.token_ids) < 1000
        assert session.messages == [], "a cancelled exchange stays out of the conversation"
        session.options["max_tokens"] = 2
        answered = session.ask("short, then")
    assert answered.finish_reason == "max_tokens"
    assert scripted.servicer.recorded.cancels == [cancelled.request_id]
    assert _sent(scripted)[-1] == [("user", "short, then")]
    assert session.messages == [("user", "short, then"), ("assistant", "t0 t1 !")]


def test_ctrl_c_at_the_prompt_ends_the_chat(scripted: ScriptedServer) -> None:
    def interrupted(prompt: str) -> str:
        raise KeyboardInterrupt

    with Client(scripted.target) as client:
        out = io.StringIO()
        assert chat_loop(ChatSession(client, out), interrupted, out) == 0
    assert scripted.servicer.recorded.submits == []


def test_chat_messages_as_pairs_or_dicts_reach_the_wire() -> None:
    pairs = build_submit("a", Conversation.of([("user", "hi")]), GenerateOptions()).submit
    dicts = build_submit(
        "a", Conversation.of([{"role": "user", "content": "hi"}]), GenerateOptions()
    ).submit
    assert pairs == dicts and pairs.WhichOneof("prompt") == "messages"
    empty = build_submit("b", Conversation.of([]), GenerateOptions()).submit
    assert empty.WhichOneof("prompt") == "messages", "empty is sent (the server rejects it)"


@pytest.mark.parametrize(
    "bad", [[("user",)], [{"role": "user"}], [{"role": "user", "content": 1}], ["hello"]]
)
def test_malformed_messages_are_refused_before_sending(bad: list) -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        Conversation.of(bad)


def test_async_client_chat_sends_messages(scripted: ScriptedServer) -> None:
    async def run() -> str:
        async with AsyncClient(scripted.target) as client:
            generation = await client.chat([{"role": "user", "content": "hi"}], max_tokens=2)
            return (await generation.result()).text

    assert asyncio.run(run()) == "t0 t1 !"
    assert _sent(scripted) == [[("user", "hi")]]


def test_a_lost_server_ends_the_chat_with_one_line() -> None:
    out = io.StringIO()
    with Client("127.0.0.1:1") as client:  # nothing listens there
        assert chat_loop(ChatSession(client, out), _feed(["hello"]), out) == 1  # type: ignore[arg-type]
    assert "the connection to the server failed (UNAVAILABLE" in out.getvalue()


@pytest.mark.parametrize("flag", [[], ["--token", "from-the-flag"]])
def test_the_command_presents_the_token_like_the_other_commands(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch, flag: list[str]
) -> None:
    """$SLIPSTREAM_TOKEN, or --token over it, goes with every call (a server
    with tenants refuses a chat without it)."""
    monkeypatch.setenv("SLIPSTREAM_TOKEN", "from-the-env")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--server", scripted.target, "--max-tokens", "2", *flag]) == 0
    recorded = scripted.servicer.recorded
    expected = f"Bearer {flag[1] if flag else 'from-the-env'}"
    calls = [*recorded.info_metadata, *recorded.metadata]
    assert len(calls) == 2 and all(m.get("authorization") == expected for m in calls)


def test_an_unreadable_tls_file_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = f"{tmp_path}/ca.pem"
    assert main(["chat", "--server", "127.0.0.1:1", "--tls-ca", missing]) == 1
    error = f"slipstream: error: cannot read {missing}: No such file or directory\n"
    assert capsys.readouterr().err == error


def test_a_server_that_cannot_be_reached_is_one_line_with_its_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The status alone ("UNAVAILABLE") does not say why; grpc's details do.
    assert main(["chat", "--server", "127.0.0.1:1"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("slipstream: error: 127.0.0.1:1: UNAVAILABLE: ") and len(line) > 45


CHAT_SAMPLING_FLAGS = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "40"]
CHAT_SAMPLING_FLAGS += ["--min-p", "0.05", "--seed", "11", "--presence-penalty", "0.5"]
CHAT_SAMPLING_FLAGS += ["--frequency-penalty", "-0.5", "--repetition-penalty", "1.1"]
CHAT_SAMPLING_FLAGS += ["--logit-bias", "7=-100", "--min-tokens", "2"]
CHAT_SAMPLING_FLAGS += ["--stop-token-id", "5", "--stop-token-id", "9", "--regex", "[a-z ]+"]


def test_the_sampling_flags_reach_every_answers_submit(
    scripted: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    argv = ["chat", "--server", scripted.target, "--max-tokens", "3", *CHAT_SAMPLING_FLAGS]
    assert main(argv) == 0
    submits = scripted.servicer.recorded.submits
    assert len(submits) == 2
    for submit in submits:
        sampling, stopping = submit.sampling, submit.stopping
        assert (sampling.temperature, sampling.top_p) == pytest.approx((0.7, 0.9))
        assert (sampling.top_k, sampling.seed) == (40, 11)
        assert sampling.min_p == pytest.approx(0.05)
        assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
        assert sampling.repetition_penalty == pytest.approx(1.1)
        assert dict(sampling.logit_bias) == {7: -100.0}
        assert stopping.min_tokens == 2 and list(stopping.stop_token_ids) == [5, 9]
        assert submit.constraint.regex == "[a-z ]+"


def test_chat_and_generate_share_their_sampling_flags() -> None:
    """One definition (sampling_flags.py): the same flags, types and defaults."""
    from slipstream.service.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]

    def sampling_flags(command: str) -> dict[str, tuple[object, object]]:
        actions = commands[command]._actions
        return {
            a.option_strings[0]: (a.type, a.default)
            for a in actions
            if a.option_strings and a.dest in SAMPLING_DESTS
        }

    chat, generate = sampling_flags("chat"), sampling_flags("generate")
    assert chat == generate and len(chat) == len(SAMPLING_DESTS)


SAMPLING_DESTS = {
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "json_schema",
    "json_object", "regex",
}  # fmt: skip


def test_min_tokens_over_max_tokens_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["chat", "--server", "127.0.0.1:1", "--max-tokens", "4", "--min-tokens", "5"])
    assert exited.value.code == 2
    assert "--min-tokens (5) must be at most --max-tokens (4)" in capsys.readouterr().err

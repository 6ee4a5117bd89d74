"""``slipstream chat``: a conversation with a server's model in the terminal.

Each line typed is a user turn; the answer streams as it is generated and
both join the conversation the next question is asked in. Ctrl-C while an
answer streams cancels that answer alone (a ``Cancel`` on the stream; the
exchange is left out of the conversation); Ctrl-C or Ctrl-D at the prompt
ends the chat. ``/reset`` starts a new conversation, ``/exit`` ends.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import grpc

from slipstream.clients import Client, Result, StreamError
from slipstream.service.cli.arg_types import positive_uint32
from slipstream.service.cli.connect import (
    add_connection_args,
    call_failed,
    client_tls,
    unreadable_file,
)
from slipstream.service.cli.sampling_flags import (
    add_sampling_args,
    check_min_tokens,
    constraint_options,
    sampling_options,
)

PROMPT = "you> "
RESET, EXIT = "/reset", "/exit"
ANSWERED = frozenset({"eos", "max_tokens", "stop_sequence"})  # the answer joins the chat


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "chat",
        help="chat with a server's model in the terminal",
        description="Each line typed is a question; the answer streams as it is generated. "
        f"{RESET} starts a new conversation, {EXIT} ends. Ctrl-C stops an answer (it is "
        "left out of the conversation); Ctrl-C or Ctrl-D at the prompt ends the chat.",
    )
    parser.add_argument(
        "--server",
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="the server's address (default: %(default)s)",
    )
    parser.add_argument("--system", default=None, help="a system message opening the chat")
    parser.add_argument(
        "--max-tokens",
        type=positive_uint32,
        default=512,
        help="most tokens per answer (default: %(default)s)",
    )
    add_sampling_args(parser, "each answer")  # generate's, defined once
    add_connection_args(parser)
    parser.set_defaults(func=run)


@dataclass(slots=True)
class ChatSession:
    """A conversation over one client: ``ask`` streams an answer to ``out``
    and, when it finished normally, appends the exchange to ``messages``."""

    client: Client
    out: TextIO
    system: str | None = None
    options: dict[str, object] = field(default_factory=dict)
    messages: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = [("system", self.system)] if self.system else []

    def ask(self, question: str) -> Result:
        """The answer's result; Ctrl-C (``KeyboardInterrupt``) while it
        streams cancels it and returns its CANCELLED result."""
        turn = [*self.messages, ("user", question)]
        generation = self.client.chat(turn, **self.options)
        num_printed = 0
        try:
            for chunk in generation:
                self.out.write(chunk.text)
                self.out.flush()
                num_printed += len(chunk.text)
        except KeyboardInterrupt:
            generation.cancel()
        while True:
            try:
                result = generation.result()
                break
            except KeyboardInterrupt:  # the cancel is on its way; another Ctrl-C adds nothing
                generation.cancel()
        if result.finish_reason in ANSWERED:
            # Result.text is the chunks' text then whatever Finished held back
            # (an incomplete UTF-8 tail); print that rest.
            self.out.write(result.text[num_printed:])
            self.messages = [*turn, ("assistant", result.text)]
        return result


def chat_loop(session: ChatSession, read_line: Callable[[str], str], out: TextIO) -> int:
    """Questions from ``read_line`` (``input``, or a test's feed) until EOF,
    ``/exit`` or Ctrl-C at the prompt."""
    while True:
        try:
            line = read_line(PROMPT)
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        question = line.strip()
        if not question:
            continue
        if question == EXIT:
            return 0
        if question == RESET:
            session.reset()
            out.write("(new conversation)\n")
            continue
        try:
            result = session.ask(question)
        except StreamError as exc:  # the server went away: say so, no traceback
            out.write(f"\nerror: the connection to the server failed ({exc})\n")
            return 1
        out.write(_status_line(result))
        out.flush()


def _status_line(result: Result) -> str:
    if result.finish_reason == "cancelled":
        return " [cancelled]\n"
    if result.reject_reason == "prompt_too_long":
        return f"error: {result.message}; /reset starts a new conversation\n"
    if result.finish_reason == "rejected":
        return f"error: {result.message} ({result.status_code})\n"
    if not result.is_ok:
        return f"\n[{result.finish_reason}: {result.message}]\n"
    return "\n"


def run(args: argparse.Namespace) -> int:
    check_min_tokens(args)
    options: dict[str, object] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        **sampling_options(args),
        **constraint_options(args),
    }
    try:
        client = Client(args.server, tls=client_tls(args), token=args.token)
    except OSError as exc:  # a --tls-* file
        print(unreadable_file(exc), file=sys.stderr)
        return 1
    with client:
        try:
            info = client.model_info()
        except grpc.RpcError as exc:
            print(call_failed(args.server, exc.code().name, exc.details()), file=sys.stderr)
            return 1
        if not info.has_chat_template:
            print(f"slipstream: error: model {info.name!r} has no chat template", file=sys.stderr)
            return 1
        print(f"chatting with {info.name} at {args.server}; Ctrl-C stops an answer, Ctrl-D ends")
        session = ChatSession(client, sys.stdout, args.system, options)
        return chat_loop(session, input if sys.stdin.isatty() else _echoed_input, sys.stdout)


def _echoed_input(prompt: str) -> str:
    # Questions piped in: show each after its prompt, as a terminal would.
    line = input(prompt)
    print(line)
    return line

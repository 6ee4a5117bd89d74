"""``slipstream generate``: run prompts through an in-process engine
(``--local``) or a server (``--server HOST:PORT``). Both print the same
output, so local and remote runs compare line for line; with ``--json`` one
object per prompt, in prompt order: ``{"index", "token_ids", "text",
"finish_reason"}``, and for a request that did not finish OK its
``status_code``, ``reject_reason`` (if refused) and ``message`` (a
cancelled one: none). A request a broken connection cut off prints what
arrived, finish reason ``error`` and the call's status; the others still
print. The exit status is 1 when any request did not finish OK (cancelled
by ``--cancel-after`` counts as OK).

A prompts file is JSON Lines: each line a JSON string, or an object with
one of ``prompt`` (text), ``prompt_token_ids`` or ``messages`` and
optionally ``max_tokens``, ``temperature``, ``seed``; any other key is an
error, not ignored. A messages file is one conversation, a JSON list
of ``{"role", "content"}`` objects, rendered with the model's chat template.

The sampling flags, ``slipstream chat``'s too, are ``sampling_flags``':
``--top-p``, ``--top-k``, ``--min-p``, the penalties and ``--logit-bias
ID=BIAS`` (repeatable), ``--min-tokens``, ``--stop-token-id ID``
(repeatable), and ``--json-schema``, ``--json-object`` or ``--regex``, which
constrains every prompt's output (structured output, docs/api.md); each
applies to every prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from slipstream.clients.wire import is_token_id
from slipstream.service.cli.arg_types import (
    duration_ms,
    int_at_least,
    non_negative_int32,
    positive_int,
    positive_uint32,
)
from slipstream.service.cli.connect import (
    add_connection_args,
    call_failed,
    client_tls,
    unreadable_file,
)
from slipstream.service.cli.extras import require_server_extra
from slipstream.service.cli.sampling_flags import (
    add_sampling_args,
    check_min_tokens,
    constraint_options,
    sampling_options,
)
from slipstream.service.cli.serve import add_engine_args, engine_config

if TYPE_CHECKING:
    from slipstream.clients import AsyncGeneration, StreamError
    from slipstream.clients.wire import Conversation
    from slipstream.scheduler.request import OutputConstraint


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """One prompt (text, token ids or messages: at most one is set) and its
    per-prompt overrides of the command's flags."""

    text: str | None
    token_ids: list[int] | None
    max_tokens: int
    temperature: float
    seed: int | None
    messages: tuple[tuple[str, str], ...] | None = None


@dataclass(frozen=True, slots=True)
class Output:
    """One prompt's outcome. A request that failed also says why: its gRPC
    status, the reject reason if it was refused, the server's (or the local
    engine's) message. A cancelled one says "cancelled" and no more."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    status_code: str = "OK"
    reject_reason: str | None = None
    message: str = ""
    logprobs: list[dict[str, object]] | None = None  # with --logprobs: one per token id

    def to_json(self) -> str:
        out: dict[str, object] = {
            "index": self.index,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.failed:
            out["status_code"] = self.status_code
            if self.reject_reason is not None:
                out["reject_reason"] = self.reject_reason
            if self.message:
                out["message"] = self.message
        return json.dumps(out, ensure_ascii=False)  # CJK and emoji readable, not \uXXXX

    @property
    def failed(self) -> bool:
        return self.status_code not in ("OK", "CANCELLED")

    def to_text(self) -> str:
        if not self.failed:
            return f"[{self.index}] ({self.finish_reason}) {self.text}"
        why = ", ".join(x for x in (self.status_code, self.reject_reason) if x)
        detail = f": {self.message}" if self.message else ""
        return f"[{self.index}] ({self.finish_reason}, {why}{detail}) {self.text}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("generate", help="generate text locally or from a server")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run an in-process engine")
    where.add_argument(
        "--server",
        metavar="HOST:PORT",
        help="call a slipstream server; several comma-separated IP:PORT addresses "
        "(or --balanced with a dns:/// name) spread calls round-robin over replicas",
    )
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    prompts.add_argument(
        "--prompts-file",
        type=Path,
        help='JSON Lines of prompts: a string, or an object with "prompt", "prompt_token_ids" '
        'or "messages" (a conversation), and optionally max_tokens, temperature, seed',
    )
    prompts.add_argument(
        "--messages-file",
        type=Path,
        help='a conversation: a JSON list of {"role": ..., "content": ...}',
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_uint32,
        default=64,
        help="most tokens to generate per prompt (default: %(default)s)",
    )
    add_sampling_args(parser, "each output")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past the end-of-sequence token, up to --max-tokens",
    )
    parser.add_argument(
        "--logprobs",
        type=int_at_least(0, 20),
        default=None,
        metavar="N",
        help="each output token's log-probability and the N likeliest tokens at its "
        "position (0: none), in the --json output",
    )
    parser.add_argument(
        "--priority",
        type=non_negative_int32,
        default=None,
        help="0 = most urgent (default: the server's, 0 or your tenant's most urgent)",
    )
    parser.add_argument(
        "--deadline-ms", type=duration_ms, default=None, help="per-request deadline"
    )
    parser.add_argument(
        "--first-token-timeout",
        type=duration_ms,
        default=None,
        metavar="MS",
        help="time-to-first-token limit per request, in ms",
    )
    parser.add_argument(
        "--expected-tokens", type=positive_uint32, default=None, help="output-length hint"
    )
    parser.add_argument(
        "--cancel-after",
        type=positive_int,
        default=None,
        metavar="N",
        help="cancel each request once N tokens have arrived; print only those (and the "
        "rest of the chunk that brought the N-th, when several tokens arrive in one)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    connection = add_connection_args(parser)
    connection.add_argument(
        "--per-request",
        action="store_true",
        help="one GenerateOne call per prompt (a load balancer routes each on its own) "
        "instead of one multiplexed stream",
    )
    connection.add_argument(
        "--balanced",
        action="store_true",
        help="round_robin, health checks and retries over every address --server resolves to",
    )
    engine = add_engine_args(parser)
    mode_flags = ModeFlags.of(parser, local=engine, server=connection)
    parser.set_defaults(func=functools.partial(run, mode_flags=mode_flags))


def _local_constraint(args: argparse.Namespace) -> OutputConstraint | None:
    """The constraint flags as the engine's ``OutputConstraint``."""
    from slipstream.scheduler.request import ConstraintKind, OutputConstraint

    if args.json_schema is not None:
        return OutputConstraint(ConstraintKind.JSON_SCHEMA, args.json_schema)
    if args.json_object:
        return OutputConstraint(ConstraintKind.JSON_OBJECT)
    if args.regex is not None:
        return OutputConstraint(ConstraintKind.REGEX, args.regex)
    return None


@dataclass(frozen=True, slots=True)
class ModeFlags:
    """The flags that apply to one mode alone: ``--local``'s engine flags,
    ``--server``'s connection flags, each with its default."""

    local: tuple[tuple[str, str, object], ...]  # (flag, dest, default)
    server: tuple[tuple[str, str, object], ...]

    @classmethod
    def of(
        cls,
        parser: argparse.ArgumentParser,
        local: argparse._ArgumentGroup,
        server: argparse._ArgumentGroup,
    ) -> ModeFlags:
        def flags(group: argparse._ArgumentGroup) -> tuple[tuple[str, str, object], ...]:
            actions = group._group_actions  # argparse keeps no public list of a group's flags
            return tuple((a.option_strings[0], a.dest, parser.get_default(a.dest)) for a in actions)

        return cls(flags(local), flags(server))

    def check(self, args: argparse.Namespace) -> None:
        """ValueError naming the flags given that the mode ignores. A value
        equal to the default counts as not given: $SLIPSTREAM_TOKEN, which
        is --token's default, is not a --token given with --local."""
        mode, other = ("--local", self.server) if args.local else ("--server", self.local)
        given = [flag for flag, dest, default in other if getattr(args, dest) != default]
        if given:
            applies = "--server" if args.local else "--local"
            raise ValueError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to "
                f"{applies}, not with {mode}"
                + ("" if args.local else " (the server runs its own engine)")
            )


def load_prompts(args: argparse.Namespace) -> list[PromptSpec]:
    if args.prompt:
        return [_spec(text, None, {}, args) for text in args.prompt]
    if args.messages_file:
        return [_spec(None, None, {}, args, load_messages(args.messages_file))]
    path = args.prompts_file
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise _refused(f"{path}: cannot read it: {exc.strerror}") from None
    specs = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise _refused(f"{where}: not JSON ({exc})") from None
        if isinstance(item, str):
            specs.append(_spec(item, None, {}, args))
            continue
        if not isinstance(item, dict):
            raise _refused(f"{where}: {_NO_PROMPT}")
        _check_item(item, where)
        if "messages" in item:
            specs.append(_spec(None, None, item, args, _conversation(item["messages"], where)))
        else:
            specs.append(_spec(item.get("prompt"), item.get("prompt_token_ids"), item, args))
    if not specs:  # a script's mistake, not a run of nothing
        raise _refused(f"{path}: no prompts in it")
    return specs


def _refused(message: str) -> SystemExit:
    """A prompts or messages file the command cannot run: one error line, exit 1."""
    return SystemExit(f"slipstream: error: {message}")


_PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
_ITEM_KEYS = (*_PROMPT_KEYS, "max_tokens", "temperature", "seed")
_NO_PROMPT = "need a string or prompt/prompt_token_ids/messages"


def _check_item(item: dict, where: str) -> None:
    """A prompts file's object: known keys only, exactly one prompt, each
    field of the type and range the server takes, else ``SystemExit``
    naming the line and the key. (A line with both ``prompt`` and
    ``prompt_token_ids`` would send the ids with --server, the text with
    --local.)"""

    def integer(value: object, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    unknown = [key for key in item if key not in _ITEM_KEYS]
    if unknown:
        raise _refused(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(_ITEM_KEYS)})")
    prompts = [key for key in _PROMPT_KEYS if key in item]
    if not prompts:
        raise _refused(f"{where}: {_NO_PROMPT}")
    if len(prompts) > 1:
        both = "messages or a prompt" if "messages" in prompts else "prompt or prompt_token_ids"
        raise _refused(f"{where}: {both}, not both")
    prompt, ids = item.get("prompt"), item.get("prompt_token_ids")
    if prompt is not None and not isinstance(prompt, str):
        raise _refused(f"{where}: prompt must be a string")
    if ids is not None and not (isinstance(ids, list) and all(is_token_id(t) for t in ids)):
        raise _refused(f"{where}: prompt_token_ids must be a list of integers in [0, 2**32)")
    for key, low in (("max_tokens", 1), ("seed", 0)):
        if item.get(key) is not None and not integer(item[key], low):
            raise _refused(f"{where}: {key} must be an integer >= {low}")
    temperature = item.get("temperature")
    if temperature is not None and not (
        isinstance(temperature, int | float)
        and not isinstance(temperature, bool)
        and 0 <= temperature < math.inf
    ):
        raise _refused(f"{where}: temperature must be a number, >= 0 and finite")


def load_messages(path: Path) -> tuple[tuple[str, str], ...]:
    """A conversation file; ``SystemExit`` naming the file when unreadable or malformed."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise _refused(f"{path}: cannot read it: {exc.strerror}") from None
    try:
        items = json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError
        raise _refused(f"{path}: not JSON ({exc})") from None
    return _conversation(items, str(path))


def _conversation(items: object, where: str) -> tuple[tuple[str, str], ...]:
    """A JSON list of {"role", "content"} as (role, content) pairs;
    ``SystemExit`` naming ``where`` when malformed."""
    from slipstream.clients.wire import Conversation

    try:
        if not isinstance(items, list):
            raise ValueError('need a JSON list of {"role": ..., "content": ...}')
        return Conversation.of(items).messages
    except ValueError as exc:
        raise _refused(f"{where}: {exc}") from None


def _spec(
    text: str | None,
    token_ids: list[int] | None,
    item: dict,
    args: argparse.Namespace,
    messages: tuple[tuple[str, str], ...] | None = None,
) -> PromptSpec:
    return PromptSpec(
        text=text,
        token_ids=token_ids,
        max_tokens=item.get("max_tokens", args.max_tokens),
        temperature=item.get("temperature", args.temperature),
        seed=item.get("seed", args.seed),
        messages=messages,
    )


# Finish reasons of a request that ended at a token of its own.
_ENDED_AT_A_TOKEN = frozenset({"eos", "max_tokens", "stop_sequence"})


@dataclass(slots=True)
class _Received:
    """A request's chunks under ``--cancel-after N``: those up to the one
    that brings it to N tokens. What the engine made before the cancel
    reached it (a server: often a dozen tokens more) is dropped, so
    ``--local``, ``--server`` and ``--per-request`` print the same N tokens
    when tokens arrive one a chunk. A chunk of several that crosses N is
    kept whole: its text is one delta, which cannot be split by token
    without the tokenizer (a server's client has none)."""

    cancel_after: int | None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, object]] = field(default_factory=list)
    num_dropped: int = 0

    def add(
        self, token_ids: Sequence[int], text: str, logprobs: Sequence[dict[str, object]] = ()
    ) -> bool:
        """Keeps a chunk, or drops it past N; True for the chunk that reached N."""
        if self._is_reached:
            self.num_dropped += len(token_ids)
            return False
        self.token_ids.extend(token_ids)
        self.text.append(text)
        self.logprobs.extend(logprobs)
        return self._is_reached

    def is_cut(self, finish_reason: str) -> bool:
        """Whether the output is the cancelled first N tokens: N arrived,
        unless the request ended by itself at its N-th token."""
        is_own_end = self.num_dropped == 0 and finish_reason in _ENDED_AT_A_TOKEN
        return self._is_reached and not is_own_end

    def cut_output(self, index: int, with_logprobs: bool) -> Output:
        logprobs = self.logprobs if with_logprobs else None
        text = "".join(self.text)
        return Output(index, self.token_ids, text, "cancelled", "CANCELLED", logprobs=logprobs)

    @property
    def _is_reached(self) -> bool:
        return self.cancel_after is not None and len(self.token_ids) >= self.cancel_after


# ---------------------------------------------------------------- local


def run_local(specs: list[PromptSpec], args: argparse.Namespace) -> list[Output]:
    from slipstream.scheduler.request import SamplingParams
    from slipstream.service.engine.events import RequestSpec
    from slipstream.service.engine.loader import load_engine
    from slipstream.service.models.default_models import DEFAULT_MODELS

    config = engine_config(args)
    # On stderr: stdout is the results. tiny, the default, answers noise.
    noise = " (random weights: its text is noise; --model smollm2 is a real one)"
    print(
        f"slipstream: generating on model {config.model}"
        + (noise if config.model in DEFAULT_MODELS else ""),
        file=sys.stderr,
        flush=True,
    )
    constraint = _local_constraint(args)
    engine = load_engine(config)
    engine.start()
    collectors = [
        _LocalCollector(engine, str(i), args.cancel_after, args.logprobs is not None)
        for i in range(len(specs))
    ]
    now = time.monotonic()
    try:
        for spec, collector in zip(specs, collectors, strict=True):
            try:
                request = RequestSpec(
                    req_id=collector.req_id,
                    prompt_token_ids=_local_prompt_ids(spec, engine.tokenizer),
                    max_new_tokens=spec.max_tokens,
                    sampling=SamplingParams(
                        temperature=spec.temperature,
                        seed=spec.seed,
                        logprobs=args.logprobs,
                        presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty,
                        repetition_penalty=args.repetition_penalty or 1.0,  # None: off
                        logit_bias=tuple(sorted((args.logit_bias or {}).items())),
                        top_p=args.top_p or 1.0,  # None: off
                        top_k=args.top_k,
                        min_p=args.min_p,
                        min_tokens=args.min_tokens,
                        stop_token_ids=args.stop_token_ids,
                    ),
                    ignore_eos=args.ignore_eos,
                    priority=args.priority or 0,
                    deadline=None if args.deadline_ms is None else now + args.deadline_ms / 1000,
                    expected_output_tokens=args.expected_tokens,
                    arrival_time=now,
                    first_token_deadline=(
                        None
                        if args.first_token_timeout is None
                        else now + args.first_token_timeout / 1000
                    ),
                    constraint=constraint,  # compiled once, then from the engine's cache
                )
                engine.submit(request, collector.on_event)
            except Exception as exc:  # a bad prompt fails alone, as over the wire
                collector.reject(exc)
        return [c.wait(i) for i, c in enumerate(collectors)]
    finally:
        engine.shutdown()


def _logprob(token_id: int, logprob: float, top: Sequence[tuple[int, float]]) -> dict[str, object]:
    """One token's entry in the JSON output."""
    return {"token_id": token_id, "logprob": logprob, "top": [list(pair) for pair in top]}


def _local_prompt_ids(spec: PromptSpec, tokenizer: object) -> list[int]:
    """The prompt's token ids as the server would make them; ValueError if empty."""
    from slipstream.service.api.wire import encode_prompt
    from slipstream.service.engine.chat import render_chat

    if spec.messages is not None:
        return render_chat(tokenizer, spec.messages)
    if not spec.text and not spec.token_ids:
        raise ValueError("prompt text is empty")  # the server's words
    return list(spec.token_ids) if spec.text is None else encode_prompt(tokenizer, spec.text)


class _LocalCollector:
    def __init__(
        self, engine: object, req_id: str, cancel_after: int | None, with_logprobs: bool = False
    ) -> None:
        self.req_id = req_id
        self._with_logprobs = with_logprobs
        self._engine = engine
        self._received = _Received(cancel_after)
        self._tail = ""  # the finish's text: held back until the end
        self._reason = ""
        self._status = "OK"
        self._reject_reason: str | None = None
        self._message = ""
        self._done = threading.Event()

    def on_event(self, event: object) -> None:
        from slipstream.service.engine.events import FinishEvent

        if isinstance(event, FinishEvent):
            from slipstream.service.api.status import finish_status, rejection_for_cause

            self._tail = event.text
            self._reason = event.reason.name.lower()
            self._status = finish_status(event).name
            if event.reject_cause is not None:
                self._reject_reason = rejection_for_cause(event.reject_cause).reason_name
            self._message = event.message
            self._done.set()
            return
        from slipstream.service.engine.events import TokenEvent

        assert isinstance(event, TokenEvent)
        logprobs = [
            _logprob(
                token_id, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs, strict=True))
            )
            for token_id, lp in zip(event.token_ids, event.logprobs or (), strict=False)
        ]
        if self._received.add(event.token_ids, event.text, logprobs):
            self._engine.abort(self.req_id)  # type: ignore[attr-defined]

    def reject(self, error: Exception) -> None:
        """A submit the engine refused: the status and reason the server's
        table gives the same error."""
        from slipstream.service.api.status import INVALID, rejection_for

        rejection = rejection_for(error) or INVALID
        self._reason = "rejected"
        self._status = rejection.status.name
        self._reject_reason = rejection.reason_name
        self._message = str(error)
        self._done.set()

    def wait(self, index: int) -> Output:
        self._done.wait()
        if self._received.is_cut(self._reason):
            return self._received.cut_output(index, self._with_logprobs)
        return Output(
            index,
            self._received.token_ids,
            "".join(self._received.text) + self._tail,
            self._reason,
            self._status,
            self._reject_reason,
            self._message,
            self._received.logprobs if self._with_logprobs else None,
        )


# ---------------------------------------------------------------- remote


def server_target(server: str) -> str | list[str]:
    """``--server``: one target, or a list for several comma-separated addresses."""
    addresses = [a.strip() for a in server.split(",") if a.strip()]
    return addresses if len(addresses) > 1 else server


async def run_remote(specs: list[PromptSpec], args: argparse.Namespace) -> list[Output]:
    from slipstream.clients import AsyncClient

    target = server_target(args.server)
    balanced = True if getattr(args, "balanced", False) else None
    async with AsyncClient(
        target, tls=client_tls(args), token=args.token, balanced=balanced
    ) as client:
        stream = None if args.per_request else client.stream()
        generations = []
        for i, spec in enumerate(specs):
            prompt = _remote_prompt(spec)
            options = {
                "request_id": str(i),
                "max_tokens": spec.max_tokens,
                "temperature": spec.temperature,
                "seed": spec.seed,
                "ignore_eos": args.ignore_eos,
                "priority": args.priority,
                "deadline_s": None if args.deadline_ms is None else args.deadline_ms / 1000,
                "first_token_timeout_s": (
                    None if args.first_token_timeout is None else args.first_token_timeout / 1000
                ),
                "expected_tokens": args.expected_tokens,
                "logprobs": args.logprobs is not None,
                "top_logprobs": args.logprobs or 0,
                **sampling_options(args),
                **constraint_options(args),
            }
            if stream is None:
                generations.append(await client.generate_one(prompt, **options))  # type: ignore[arg-type]
            else:
                generations.append(await stream.generate(prompt, **options))
        if stream is not None:
            await stream.close()
        followed = await asyncio.gather(
            *(
                _follow(i, g, args.cancel_after, args.logprobs is not None)
                for i, g in enumerate(generations)
            )
        )
    errors = [error for _, error in followed if error is not None]
    if len(errors) == len(followed):  # none got an answer: the call failed (unreachable, TLS)
        raise errors[0]
    return [output for output, _ in followed]


def _remote_prompt(spec: PromptSpec) -> str | list[int] | Conversation:
    from slipstream.clients.wire import Conversation

    if spec.messages is not None:
        return Conversation(spec.messages)
    return spec.token_ids if spec.token_ids is not None else spec.text or ""


async def _follow(
    index: int, generation: AsyncGeneration, cancel_after: int | None, with_logprobs: bool
) -> tuple[Output, StreamError | None]:
    """The request's output, and the error that cut it off if the call
    broke before it finished: then its output is what arrived, as an
    ``error`` that did not finish OK, so the requests that did still print."""
    from slipstream.clients import StreamError

    received = _Received(cancel_after)
    try:
        async for chunk in generation:
            logprobs = [_logprob(lp.token_id, lp.logprob, lp.top) for lp in chunk.logprobs]
            if received.add(chunk.token_ids, chunk.text, logprobs):
                await generation.cancel()
        r = await generation.result()
    except StreamError as exc:
        cut_off = Output(
            index, received.token_ids, "".join(received.text), "error", exc.code,
            message=exc.details, logprobs=received.logprobs if with_logprobs else None,
        )  # fmt: skip
        return cut_off, exc
    if received.is_cut(r.finish_reason):
        return received.cut_output(index, with_logprobs), None
    return Output(
        index, r.token_ids, r.text, r.finish_reason, r.status_code, r.reject_reason, r.message,
        received.logprobs if with_logprobs else None,
    ), None  # fmt: skip


def run(args: argparse.Namespace, mode_flags: ModeFlags | None = None) -> int:
    if mode_flags is not None:
        mode_flags.check(args)
    if args.logprobs is not None and not args.json:
        raise ValueError("--logprobs shows in the JSON lines only: add --json")
    check_min_tokens(args)
    if args.local:
        require_server_extra("generate --local")
        from slipstream.service.telemetry.logs import configure_logging

        # stdout carries the results (JSON lines); logs go to stderr.
        configure_logging(level="warning")
    specs = load_prompts(args)
    if args.local:
        outputs = run_local(specs, args)
    else:
        from slipstream.clients import StreamError

        try:
            outputs = asyncio.run(run_remote(specs, args))
        except StreamError as exc:  # the whole call failed: unreachable, TLS, token
            print(call_failed(args.server, exc.code, exc.details), file=sys.stderr)
            return 1
        except OSError as exc:  # a --tls-* file
            print(unreadable_file(exc), file=sys.stderr)
            return 1
    for out in outputs:
        print(out.to_json() if args.json else out.to_text())
    sys.stdout.flush()
    # Cancelled by --cancel-after is what was asked for; anything else not OK failed.
    asked = {"OK", "CANCELLED"} if args.cancel_after is not None else {"OK"}
    not_ok = [out for out in outputs if out.status_code not in asked]
    if not_ok:
        first = not_ok[0]
        print(
            f"slipstream: error: {len(not_ok)} of {len(outputs)} requests did not finish OK "
            f"(the first, [{first.index}]: {first.status_code}"
            + (f": {first.message}" if first.message else "")
            + ")",
            file=sys.stderr,
        )
        return 1
    return 0

"""The sampling flags ``slipstream generate`` and ``slipstream chat`` share:
each defined once here, and their values as the clients' keyword arguments.

``--temperature``, ``--top-p``, ``--top-k``, ``--min-p``, ``--seed``; the
logit adjustments ``--presence-penalty``, ``--frequency-penalty``,
``--repetition-penalty`` and ``--logit-bias ID=BIAS`` (repeatable);
``--min-tokens`` and ``--stop-token-id ID`` (repeatable); at most one of
``--json-schema``, ``--json-object`` and ``--regex``. Each takes the
server's range, as the clients check it (clients/wire.py), so a value past
it is a usage error naming the flag.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slipstream.clients.wire import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    is_token_id,
)
from slipstream.service.cli.arg_types import (
    float_where,
    fraction,
    int_at_least,
    non_negative_finite_float,
    non_negative_uint64,
)


def add_sampling_args(parser: argparse.ArgumentParser, answer: str) -> None:
    """The sampling flags on ``parser``; ``answer`` names what they shape in
    the help ("each output", "each answer")."""
    parser.add_argument(
        "--temperature",
        type=non_negative_finite_float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default: %(default)s)",
    )
    parser.add_argument(
        "--top-p",
        type=fraction,
        default=None,
        metavar="P",
        help="sample from the likeliest tokens holding P of the probability, in (0, 1] "
        "(default: 1, off)",
    )
    parser.add_argument(
        "--top-k",
        type=uint32,
        default=0,
        metavar="K",
        help="sample from the K likeliest tokens (default: %(default)s, off)",
    )
    parser.add_argument(
        "--min-p",
        type=min_p,
        default=0.0,
        metavar="P",
        help="sample from the tokens at least P times as likely as the likeliest, in [0, 1], "
        "after temperature, before top-k and top-p (default: %(default)s, off)",
    )
    parser.add_argument(
        "--seed", type=non_negative_uint64, default=None, help="sampling seed, for repeatable runs"
    )
    parser.add_argument(
        "--presence-penalty",
        type=penalty,
        default=0.0,
        metavar="X",
        help="subtracted once from the logit of each token generated so far, in [-2, 2] "
        "(default: %(default)s, off)",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=penalty,
        default=0.0,
        metavar="X",
        help="subtracted from a token's logit for each time it was generated so far, "
        "in [-2, 2] (default: %(default)s, off)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=repetition_penalty,
        default=None,
        metavar="X",
        help="divides the positive logits of the prompt's and the output's tokens (multiplies "
        "the others), in [0.01, 100]; above 1 discourages repeats (default: 1, off)",
    )
    parser.add_argument(
        "--logit-bias",
        type=token_bias,
        action=LogitBias,
        default=None,
        metavar="ID=BIAS",
        help="add BIAS, in [-100, 100], to token ID's logit (-100 in effect bans it, "
        "100 makes it the only choice); repeatable",
    )
    parser.add_argument(
        "--min-tokens",
        type=uint32,
        default=0,
        metavar="N",
        help=f"{answer}'s first N tokens are neither EOS nor a --stop-token-id, and no stop "
        "sequence ends it within them; at most --max-tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--stop-token-id",
        type=token_id,
        action=StopTokenIds,
        default=(),
        dest="stop_token_ids",
        metavar="ID",
        help=f"end {answer} when it samples token ID (its text left out); "
        f"repeatable, at most {MAX_STOP_TOKEN_IDS}",
    )
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        type=json_schema_text,
        metavar="FILE_OR_JSON",
        help=f"{answer} is JSON this schema accepts: its JSON text (starting with '{{') "
        "or a file holding it",
    )
    constraint.add_argument("--json-object", action="store_true", help=f"{answer} is a JSON object")
    constraint.add_argument(
        "--regex", help=f"{answer} matches this regular expression (Rust regex syntax)"
    )


def check_min_tokens(args: argparse.Namespace) -> None:
    """ValueError where ``--min-tokens`` is over ``--max-tokens``."""
    if args.min_tokens > args.max_tokens:
        raise ValueError(
            f"--min-tokens ({args.min_tokens}) must be at most --max-tokens ({args.max_tokens})"
        )


def sampling_options(args: argparse.Namespace) -> dict[str, object]:
    """The clients' keyword arguments for the sampling flags but
    ``--temperature`` and ``--seed`` (a prompts file may set its own)."""
    return {
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repetition_penalty,
        "logit_bias": args.logit_bias,
        "min_tokens": args.min_tokens,
        "stop_token_ids": args.stop_token_ids,
    }


def constraint_options(args: argparse.Namespace) -> dict[str, object]:
    """The clients' keyword arguments for the constraint flags (none: {})."""
    if args.json_schema is not None:
        return {"json_schema": args.json_schema}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    return {}


def json_schema_text(value: str) -> str:
    """``--json-schema``: JSON text where it starts with ``{``, else the
    name of a file holding it; the schema's JSON text."""
    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"{value}: cannot read it: {exc.strerror}") from None
    try:
        json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError
        where = "" if text is value else f"{value}: "
        raise argparse.ArgumentTypeError(f"{where}not JSON ({exc})") from None
    return text


# The server's ranges, as the clients check them (clients/wire.py).
uint32 = int_at_least(0, 2**32 - 1)
min_p = float_where(lambda v: 0 <= v <= 1, "in [0, 1]")
penalty = float_where(
    lambda v: -MAX_PENALTY <= v <= MAX_PENALTY, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
)
repetition_penalty = float_where(
    lambda v: 1 / MAX_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
    f"in [{1 / MAX_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]",
)
_bias = float_where(
    lambda v: -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
    f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
)


def token_id(value: str, expected: str = "expected a token id") -> int:
    """A token id the wire carries (the model's vocabulary is the server's
    to check); ``expected`` opens the complaint about a non-number."""
    try:
        parsed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {value!r}") from None
    if not is_token_id(parsed):
        raise argparse.ArgumentTypeError(f"{parsed} is not a token id in [0, 2**32)")
    return parsed


def token_bias(value: str) -> tuple[int, float]:
    """``--logit-bias``: ``ID=BIAS``, a token id and its bias in [-100, 100]."""
    token, is_pair, number = value.partition("=")
    if not is_pair:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, got {value!r}")
    return token_id(token, "expected a token id before '='"), _bias(number)


class LogitBias(argparse.Action):
    """Collects the ``--logit-bias`` pairs into one dict: a token biased
    twice (the sampler would add both) or more than 1024 tokens is a usage
    error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, tuple)  # token_bias's (token id, bias)
        token, bias = values
        biases = dict(getattr(namespace, self.dest) or {})
        if token in biases:
            raise argparse.ArgumentError(self, f"token {token} is biased twice")
        biases[token] = bias
        if len(biases) > MAX_LOGIT_BIAS_TOKENS:
            raise argparse.ArgumentError(self, f"at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        setattr(namespace, self.dest, biases)


class StopTokenIds(argparse.Action):
    """Collects the ``--stop-token-id`` ids into a tuple, at most the server's count."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, int)  # token_id's
        ids = (*getattr(namespace, self.dest), values)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise argparse.ArgumentError(self, f"at most {MAX_STOP_TOKEN_IDS} ids")
        setattr(namespace, self.dest, ids)

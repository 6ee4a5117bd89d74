"""The ``slipstream`` command. Flags and environment variables are read here
and nowhere else; each subcommand lives in its own module and registers itself
through ``add_parser(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable

# Subcommand modules, each exposing add_parser(subparsers) that sets a `func`
# default taking the parsed args and returning an exit code.
COMMAND_MODULES = (
    "slipstream.service.cli_model",
    "slipstream.service.cli_generate",
    "slipstream.service.cli_serve",
    "slipstream.service.cli_stats",
    "slipstream.service.cli_bench",
)


def register_subcommands(subparsers: argparse._SubParsersAction, modules: Iterable[str]) -> None:  # type: ignore[type-arg]
    """Lets each module add its subcommand: ``module.add_parser(subparsers)``."""
    for name in modules:
        importlib.import_module(name).add_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description=__doc__)
    register_subcommands(parser.add_subparsers(dest="command", required=True), COMMAND_MODULES)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad model path, unsupported checkpoint, backend, flags
        parser.exit(2, f"slipstream: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())

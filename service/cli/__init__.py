"""The ``slipstream`` command. Flags and environment variables are read here
and nowhere else; each subcommand lives in its own module and registers itself
through ``add_parser(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterable, MutableMapping

from slipstream.kernels.cpu_answer import prepare_environment
from slipstream.service.cli.extras import ServerExtraMissing, missing_server_modules

# Subcommand modules, each exposing add_parser(subparsers) that sets a `func`
# default taking the parsed args and returning an exit code.
COMMAND_MODULES = (
    "slipstream.service.cli.model",
    "slipstream.service.cli.generate",
    "slipstream.service.cli.chat",
    "slipstream.service.cli.serve",
    "slipstream.service.cli.stats",
    "slipstream.service.cli.bench",
    "slipstream.service.cli.kernels",
)


def register_subcommands(subparsers: argparse._SubParsersAction, modules: Iterable[str]) -> None:  # type: ignore[type-arg]
    """Lets each module add its subcommand: ``module.add_parser(subparsers)``.
    A module that cannot be imported for want of the server extra still gets a
    subcommand, which says what to install."""
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            if not missing_server_modules():
                raise  # a real bug, not a light install
            _add_unavailable(subparsers, name.rpartition(".")[2].replace("_", "-"))
            continue
        module.add_parser(subparsers)


class _Unavailable:
    """The ``func`` of a subcommand whose module needs the server extra:
    whatever follows it on the command line, it says what to install."""

    def __init__(self, command: str) -> None:
        self.command = command  # the whole command: "bench step"

    def __call__(self, args: argparse.Namespace) -> int:
        raise ServerExtraMissing(self.command, missing_server_modules())


def _add_unavailable(subparsers: argparse._SubParsersAction, command: str) -> None:  # type: ignore[type-arg]
    # No arguments of its own: main() lets it take any (its options, --help)
    # so that `bench step --model tiny` says what to install too.
    parser = subparsers.add_parser(command, help="(needs slipstream[server])", add_help=False)
    parser.set_defaults(func=_Unavailable(parser.prog.removeprefix("slipstream ")))


def add_commands(parser: argparse.ArgumentParser, dest: str) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    """``parser``'s subcommands, stored in ``dest``. Without one, a usage
    error names them ('slipstream model: error: choose a command: init,
    path, import-gguf'), where argparse's own would name ``dest``
    ('required: model_command')."""
    commands = parser.add_subparsers(dest=dest)

    def choose(args: argparse.Namespace) -> int:
        parser.error(f"choose a command: {', '.join(commands.choices)}")

    parser.set_defaults(func=choose)  # a subcommand's own func replaces it
    return commands


DESCRIPTION = (
    "Slipstream: LLM inference over gRPC and an OpenAI-compatible HTTP API, with "
    "deadline-aware continuous batching. `slipstream COMMAND --help` gives a command's flags."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    register_subcommands(add_commands(parser, dest="command"), COMMAND_MODULES)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("slipstream")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "(not installed)"


def _command_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the innermost command ``args`` ran: ``slipstream bench step``'s."""
    for action in parser._actions:  # argparse keeps no public list of subcommands
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _command_parser(action.choices[name], args)
    return parser


def quiet_grpc_logs(environ: MutableMapping[str, str], argv: list[str]) -> None:
    """Turns gRPC's native log lines off (``E1129 … ssl_transport_security.cc:
    …] Could not load any root certificate.`` before the command's own error
    line): a client command says what failed in one line. ``serve`` keeps
    gRPC's default (errors), which an operator may need (a client's failed
    TLS handshake is logged nowhere else). A ``GRPC_VERBOSITY`` or
    ``GRPC_TRACE`` the user set wins. gRPC reads it once, when it is imported."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command in ("serve", "bench"):  # bench starts servers, which inherit it
        return
    if "GRPC_VERBOSITY" not in environ and "GRPC_TRACE" not in environ:
        environ["GRPC_VERBOSITY"] = "NONE"


def main(argv: list[str] | None = None) -> int:
    quiet_grpc_logs(os.environ, sys.argv[1:] if argv is None else argv)  # before grpc loads
    try:
        answer = prepare_environment(os.environ)  # before anything loads torch
    except ValueError as exc:
        print(f"slipstream: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    if answer != "native" and importlib.util.find_spec("torch") is not None:
        # A client-only install has no torch and makes no CPU-dependent choice.
        from slipstream.kernels import cpu_features

        cpu_features.force(answer)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not isinstance(getattr(args, "func", None), _Unavailable):
        # As parse_args says it, with the usage of the command they follow.
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except (ValueError, ServerExtraMissing) as exc:  # bad model, flags; a light install
        parser.exit(2, f"slipstream: error: {exc}\n")
    except KeyboardInterrupt:  # Ctrl-C; chat and serve stop on it by themselves
        print("slipstream: interrupted", file=sys.stderr)
        # 130, as a shell reports a command SIGINT stopped; at once: Ctrl-C
        # may have come while a model loads in native code, and finalizing
        # the interpreter under it can abort the process (exit 134).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)

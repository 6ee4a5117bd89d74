"""``slipstream model``: create built-in models, import GGUF files, print where models live."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slipstream.service.cli import add_commands
from slipstream.service.cli.extras import require_server_extra
from slipstream.service.models.store import (
    BUILTIN_MODELS,
    create_builtin_model,
    default_import_name,
    import_gguf_model,
    resolve_model,
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "model", help="create built-in models, import GGUF files, print model paths"
    )
    actions = add_commands(parser, dest="model_command")

    init = actions.add_parser("init", help="create a built-in model (if missing), print its path")
    init.add_argument("name", nargs="?", default="tiny", choices=sorted(BUILTIN_MODELS))
    init.set_defaults(func=_init)

    path = actions.add_parser(
        "path",
        help="print a model's directory (a built-in model is created if missing)",
        description=(
            f"NAME is a built-in model ({', '.join(BUILTIN_MODELS)}), an imported model "
            "or a local checkpoint directory."
        ),
    )
    path.add_argument("name", metavar="NAME")
    path.set_defaults(func=_path)

    gguf = actions.add_parser(
        "import-gguf",
        help="convert a llama GGUF file into a model usable as --model NAME",
        description=(
            "Dequantizes FILE into a Hugging Face checkpoint under "
            "$SLIPSTREAM_HOME/models/NAME and prints its path. An existing model "
            "of that name is never replaced."
        ),
    )
    gguf.add_argument("file", type=Path, metavar="FILE")
    gguf.add_argument(
        "--name", help="the model's name (default: the file name without .gguf, lowercased)"
    )
    gguf.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="dtype the weights are saved in (default: float32, which keeps every value)",
    )
    gguf.set_defaults(func=_import_gguf)


def _init(args: argparse.Namespace) -> int:
    require_server_extra("model init")
    try:
        print(create_builtin_model(args.name))
    except ValueError as exc:  # a GGUF model whose package is not installed
        print(f"slipstream: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _path(args: argparse.Namespace) -> int:
    require_server_extra("model path")
    try:
        print(resolve_model(args.name))
    except ValueError as exc:
        print(f"slipstream: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _import_gguf(args: argparse.Namespace) -> int:
    name = args.name or default_import_name(args.file)
    try:
        # GGUFImportError is a ValueError; FileExistsError/FileNotFoundError are OSErrors.
        print(import_gguf_model(args.file, name, dtype=args.dtype))
    except (ValueError, FileExistsError, FileNotFoundError) as exc:
        print(f"slipstream: error: {exc}", file=sys.stderr)
        return 2
    return 0

"""``slipstream model``: create default models and print where they live."""

from __future__ import annotations

import argparse
import sys

from slipstream.service.cli.extras import require_server_extra
from slipstream.service.models.store import DEFAULT_MODELS, create_default_model, resolve_model


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("model", help="create default models, print their paths")
    actions = parser.add_subparsers(dest="model_command", required=True)

    init = actions.add_parser("init", help="create a default model (if missing), print its path")
    init.add_argument("name", nargs="?", default="tiny", choices=sorted(DEFAULT_MODELS))
    init.set_defaults(func=_init)

    path = actions.add_parser(
        "path",
        help="print a model's directory (a default model is created if missing)",
        description="NAME is a default model (tiny, small) or a local checkpoint directory.",
    )
    path.add_argument("name", metavar="NAME")
    path.set_defaults(func=_path)


def _init(args: argparse.Namespace) -> int:
    require_server_extra("model init")
    print(create_default_model(args.name))
    return 0


def _path(args: argparse.Namespace) -> int:
    require_server_extra("model path")
    try:
        print(resolve_model(args.name))
    except ValueError as exc:
        print(f"slipstream model path: {exc}", file=sys.stderr)
        return 2
    return 0

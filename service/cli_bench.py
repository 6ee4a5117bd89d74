"""``slipstream bench``: benchmark subcommands. Each module below exposes
``add_parser(bench_subparsers)``; modules not present are skipped."""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES = (
    "slipstream.service.bench.offline",
    "slipstream.service.bench.serve",
    "slipstream.service.bench.slo",
    "slipstream.service.bench.swap",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("bench", help="benchmarks")
    bench_subparsers = parser.add_subparsers(dest="bench_command", required=True)
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.add_parser(bench_subparsers)

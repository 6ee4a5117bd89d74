"""``slipstream bench``: benchmark subcommands. Each module below exposes
``add_parser(bench_subparsers)``."""

from __future__ import annotations

import argparse

from slipstream.service.cli import add_commands, register_subcommands

BENCH_MODULES = (
    "slipstream.service.bench.calibrate",
    "slipstream.service.bench.host",
    "slipstream.service.bench.kv_accuracy",
    "slipstream.service.bench.offline",
    "slipstream.service.bench.prefix",
    "slipstream.service.bench.serve",
    "slipstream.service.bench.slo",
    "slipstream.service.bench.soak",
    "slipstream.service.bench.spec",
    "slipstream.service.bench.step",
    "slipstream.service.bench.swap",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("bench", help="benchmarks")
    bench_subparsers = add_commands(parser, dest="bench_command")
    register_subcommands(bench_subparsers, BENCH_MODULES)

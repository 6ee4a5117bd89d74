"""``slipstream kernels build``: builds the native CPU kernels (fused paged
attention, fused elementwise ops, float32 panel projections) into
``$SLIPSTREAM_HOME/cache/extensions`` ahead of the first start, so set-up
pays the compile, not the server."""

from __future__ import annotations

import argparse

from slipstream.kernels import cpu_attention, fused_ops, linear
from slipstream.service.cli import add_commands
from slipstream.service.models.store import slipstream_home


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("kernels", help="native CPU kernels")
    actions = add_commands(parser, dest="action")
    build = actions.add_parser("build", help="build (or find cached) the native CPU kernels")
    build.set_defaults(func=_build)


def _build(args: argparse.Namespace) -> int:
    home = slipstream_home()
    # A first build compiles three C++ files (a minute or more); later ones load.
    print("native CPU kernels: building or loading from the cache", flush=True)
    results = {
        "fused attention": (cpu_attention.is_available(home), cpu_attention.failure()),
        "fused elementwise ops": (fused_ops.is_available(home), fused_ops.failure()),
        "panel projections": (linear.panels_available(home), linear.panels_failure()),
    }
    for name, (ok, why) in results.items():
        if why == linear.NO_AVX2:  # built; only not used on this CPU
            print(f"{name}: built, not used here ({why}): oneDNN's are")
            results[name] = (True, None)
        elif ok:
            print(f"{name}: ready")
        else:
            print(f"{name}: unavailable ({why}); the torch path will be used")
    print(f"cache: {home / 'cache' / 'extensions'}")
    # A missing kernel is not fatal (the server falls back), but set-up should say so.
    return 0 if all(ok for ok, _ in results.values()) else 1

"""``slipstream stats --server HOST:PORT [--json]``: the server's queues and
KV block pools (``GetServerStats``)."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from slipstream.clients.balancing import channel_target
from slipstream.clients.security import secure_channel, with_token
from slipstream.clients.wire import call_metadata
from slipstream.service.cli.arg_types import positive_finite_float
from slipstream.service.cli.connect import (
    add_connection_args,
    call_failed,
    client_tls,
    unreadable_file,
)
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("stats", help="print a server's queue and KV-cache stats")
    parser.add_argument("--server", required=True, metavar="HOST:PORT", help="the server's address")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument(
        "--timeout-s",
        type=positive_finite_float,
        default=10.0,
        help="how long to wait for the answer, in seconds (default: %(default)s)",
    )
    add_connection_args(parser)
    parser.set_defaults(func=run)


def stats_dict(stats: pb.ServerStats) -> dict[str, object]:
    """Plain integers under stable key names (dashboards read these)."""
    return {
        "waiting": stats.waiting,
        "running": stats.running,
        "swapped": stats.swapped,
        "kv_blocks_used": {
            "device": stats.kv_blocks_used.device,
            "host": stats.kv_blocks_used.host,
        },
        "kv_blocks_free": {
            "device": stats.kv_blocks_free.device,
            "host": stats.kv_blocks_free.host,
        },
        "by_priority": {
            str(priority): {
                "waiting": counts.waiting,
                "running": counts.running,
                "swapped": counts.swapped,
            }
            for priority, counts in sorted(stats.by_priority.items())
        },
        "step": stats.step,
        "draining": stats.draining,
    }


def _table(stats: dict[str, object]) -> str:
    used, free = stats["kv_blocks_used"], stats["kv_blocks_free"]
    lines = [
        f"requests   waiting {stats['waiting']}  running {stats['running']}"
        f"  swapped {stats['swapped']}",
        f"kv device  used {used['device']}  free {free['device']}",  # type: ignore[index]
        f"kv host    used {used['host']}  free {free['host']}",  # type: ignore[index]
        f"step {stats['step']}  draining {stats['draining']}",
    ]
    for priority, counts in stats["by_priority"].items():  # type: ignore[attr-defined]
        lines.append(
            f"priority {priority}: waiting {counts['waiting']}  running {counts['running']}"
            f"  swapped {counts['swapped']}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    metadata = call_metadata(with_token(None, args.token))
    try:
        with secure_channel(channel_target(args.server), client_tls(args), None) as channel:
            stub = pb_grpc.InferenceStub(channel)
            response = stub.GetServerStats(
                pb.GetServerStatsRequest(), timeout=args.timeout_s, metadata=metadata
            )
    except grpc.RpcError as exc:
        print(call_failed(args.server, exc.code().name, exc.details()), file=sys.stderr)
        return 1
    except OSError as exc:  # a --tls-* file
        print(unreadable_file(exc), file=sys.stderr)
        return 1
    stats = stats_dict(response)
    print(json.dumps(stats) if args.json else _table(stats))
    return 0

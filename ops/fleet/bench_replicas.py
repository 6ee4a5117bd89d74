"""Throughput through HAProxy with 1, 2, ... N replicas, side by side in one
run: one fleet of N is started once; for k replicas, HAProxy's admin socket
takes the others out (``disable server``) and ``slipstream bench serve
--target`` sends the same seeded burst of ``GenerateOne`` calls.

    python ops/fleet/bench_replicas.py --replicas 3 --requests 48 --json bench-results/fleet.json

The idle replicas stay up (loaded, not computing), so every run has the same
processes on the machine; only where requests go changes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet import Fleet


def bench(target: str, args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, "-m", "slipstream.service.cli", "bench", "serve"]
    command += ["--target", target, "--per-request", "--no-local", "--json", str(out)]
    command += ["--requests", str(args.requests), "--seed", str(args.seed), "--warmup", "3"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["server"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=50060)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    serve_args = ("--dtype", "float32", "--threads", str(args.threads), "--no-calibrate")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(args.replicas, args.port, args.model, Path(tmp), serve_args)
        fleet.start(timeout_s=600)
        try:
            for active in range(1, args.replicas + 1):
                for i in range(args.replicas):
                    verb = "enable" if i < active else "disable"
                    fleet._admin(f"{verb} server replicas/r{i}")
                fleet.wait_up(range(active))
                time.sleep(1.0)
                report = bench(fleet.target, args, Path(tmp) / f"bench-{active}.json")
                rows.append(
                    {
                        "replicas": active,
                        "output_tokens_per_s": report["output_tokens_per_s"],
                        "request_throughput": report["request_throughput"],
                        "ttft_p50_ms": report["ttft_ms"]["p50"],
                        "e2e_p50_ms": report["e2e_ms"]["p50"],
                        "token_counts_match": report["token_counts_match"],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        finally:
            fleet.stop()
    base = rows[0]["output_tokens_per_s"]
    for row in rows:
        row["speedup_vs_1"] = row["output_tokens_per_s"] / base
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    for row in rows:
        print(
            f"{row['replicas']} replica(s): {row['output_tokens_per_s']:8.1f} tok/s "
            f"({row['speedup_vs_1']:.2f}x), {row['request_throughput']:.2f} req/s, "
            f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, E2E p50 {row['e2e_p50_ms']:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

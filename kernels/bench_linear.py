"""Micro-benchmark: bf16 projections on the panels against oneDNN, per row count.

    python -m slipstream.kernels.bench_linear [--rows 1,2,4,8,16,32,64,128,256,512]
        [--threads 2] [--rounds 6] [--layers 30] [--json PATH]

SmolLM2-135M's projections (qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576) over ``--layers`` (30) layers of random bf16 weights, then its LM
head (576->49,152): 270 MB of weights at 30 layers, read from memory as in a
step. For each row count, oneDNN's packed weights and the bf16 panels
(``linear_cpu.cpp``) alternate ``--rounds`` times, a median of 5 passes
each; prints the median ms a pass, panels / oneDNN, the weights' read rate
(one row on the panels is near the floor) and the arithmetic rate. This is
what ``linear.max_bf16_panel_rows`` is set from; it needs AVX512-BF16 and
oneDNN's bf16 packing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from slipstream.kernels import cpu_features, linear
from slipstream.kernels.linear import Linear

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49_152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def _projections(layers: int) -> list[Linear]:
    gen = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) * 0.02).bfloat16()

    projections = [
        Linear(weight(n, k), pack=True, panels=True) for _ in range(layers) for n, k in SHAPES
    ]
    return [*projections, Linear(weight(VOCAB, HIDDEN), pack=True, panels=True)]


def _pass_ms(projections: list[Linear], xs: dict[int, torch.Tensor]) -> float:
    def once() -> None:
        for proj in projections:
            proj(xs[proj.panels.shape[1] * 2])  # type: ignore[union-attr]

    once()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layers", type=int, default=LAYERS, help="of smollm2's shape")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu = cpu_features.detect()
    if not (linear.bf16_panels_available() and cpu.can_pack_bf16):
        raise SystemExit("bf16 panels and oneDNN's bf16 packing are both needed (AVX512-BF16)")
    projections = _projections(args.layers)
    weight_bytes = sum(2 * p.out_features * p.panels.shape[1] * 2 for p in projections)  # type: ignore[union-attr]
    macs_per_row = sum(p.out_features * p.panels.shape[1] * 2 for p in projections)  # type: ignore[union-attr]
    print(
        f"cpu: {cpu.model_name} | {' '.join(cpu.flags)} | {args.threads} threads | "
        f"{weight_bytes / 1e6:.0f} MB of bf16 weights | panels serve <= "
        f"{linear.max_bf16_panel_rows()} rows here"
    )
    print(
        f"{'rows':>5} {'oneDNN ms':>10} {'panels ms':>10} {'ratio':>6} {'GB/s':>6} {'GFLOP/s':>8}"
    )
    gen = torch.Generator().manual_seed(1)
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {"onednn": [], "panels": []}
        for _ in range(args.rounds):
            for path in times:
                for proj in projections:
                    proj.max_panel_rows = rows if path == "panels" else 0
                times[path].append(_pass_ms(projections, xs))
        onednn, panels = (statistics.median(times[path]) for path in ("onednn", "panels"))
        best = min(onednn, panels)
        row = {
            "rows": rows,
            "onednn_ms": round(onednn, 3),
            "panels_ms": round(panels, 3),
            "panels_over_onednn": round(panels / onednn, 3),
            "weights_gb_s": round(weight_bytes / best / 1e6, 1),
            "gflop_s": round(2 * macs_per_row * rows / best / 1e6, 1),
        }
        rows_out.append(row)
        print(
            f"{rows:>5} {onednn:>10.2f} {panels:>10.2f} {row['panels_over_onednn']:>6.3f} "
            f"{row['weights_gb_s']:>6.1f} {row['gflop_s']:>8.1f}",
            flush=True,
        )
    if args.json is not None:
        report = {
            "benchmark": "bf16 projections, panels against oneDNN",
            "hardware": cpu.describe(),
            "parameters": {
                "threads": args.threads,
                "rounds": args.rounds,
                "layers": args.layers,
                "model": "smollm2 shape",
            },
            "rows": rows_out,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

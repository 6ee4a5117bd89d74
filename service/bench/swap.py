"""``slipstream bench swap``: what preempting a request costs, by swap and by
recompute, at 128 to 4k tokens of context.

For each context length the real runner (model ``small`` by default) times
(1) swapping the context's KV blocks out to the host pool and back in
(``kernels.block_copy``; on CPU both pools are ordinary memory), and
(2) re-prefilling the same context in budget-sized chunks (what recompute
does). It also reports what the calibrated cost model predicts for both and
the crossover the ``deadline`` policy uses: it swaps a victim when
``swap_seconds(2 * blocks) <= prefill_seconds(tokens)``.

JSON out:
``{"block_size", "kv_bytes_per_block", "rows": [{"context_tokens",
"num_blocks", "swap_bytes", "swap_out_s", "swap_in_s", "swap_s_per_block",
"recompute_s", "recompute_over_swap", "model_swap_s", "model_recompute_s"}],
"crossover_tokens"}``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from slipstream.service.bench.report import hardware, resolved_dtype
from slipstream.service.engine.config import DTYPE_CHOICES

if TYPE_CHECKING:
    from slipstream.scheduler.plan import StepPlan
    from slipstream.service.engine.runner import ModelRunner

CONTEXTS = (128, 256, 512, 1024, 2048, 4096)


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("swap", help="swap vs recompute cost per context length")
    add_arguments(parser)
    parser.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--swap-json", dest="swap_json", default="swap.json")


def main(args: argparse.Namespace) -> int:
    report = run_sweep(
        args.model,
        resolved_dtype(args.dtype),
        args.block_size,
        args.max_num_batched_tokens,
        args.repeats,
    )
    Path(args.swap_json).write_text(json.dumps(report, indent=2))
    print(format_sweep(report))
    return 0


def run_sweep(
    model: str, dtype: str, block_size: int, budget: int, repeats: int
) -> dict[str, object]:
    from slipstream.kernels.block_copy import copy_blocks
    from slipstream.service.engine.calibration import calibrate, synthetic_plan
    from slipstream.service.engine.config import EngineConfig
    from slipstream.service.engine.loader import load_parts
    from slipstream.service.engine.runner import kv_bytes_per_block

    max_blocks = -(-max(CONTEXTS) // block_size) + 1
    engine = load_parts(
        EngineConfig(
            model=model,
            dtype=dtype,
            block_size=block_size,
            num_device_blocks=max_blocks,
            num_host_blocks=max_blocks,
            max_model_len=max(CONTEXTS) + block_size,  # capped by the model's positions
            max_num_batched_tokens=budget,
            max_num_seqs=64,
            policy="fcfs",
        )
    )
    runner = engine.runner
    model_len = engine.model.config.max_position_embeddings
    cost = calibrate(runner, budget, 64)
    block_bytes = kv_bytes_per_block(engine.model, block_size)
    rows = []
    for context in CONTEXTS:
        blocks = -(-context // block_size)
        out_pairs = [(i, i) for i in range(blocks)]
        chunks = [(start, min(budget, context - start)) for start in range(0, context, budget)]
        plans = [synthetic_plan([c], block_size, max_blocks) for c in chunks]
        if context <= model_len:
            _execute_all(runner, plans)  # warm-up (and real K/V to copy)
        swap_out = _best(
            repeats, partial(copy_blocks, runner.device_pool, runner.host_pool, out_pairs)
        )
        swap_in = _best(
            repeats, partial(copy_blocks, runner.host_pool, runner.device_pool, out_pairs)
        )
        # Beyond the model's positions recompute cannot run: the cost model's figure stands in.
        measured = context <= model_len
        recompute = _best(repeats, partial(_execute_all, runner, plans)) if measured else None
        model_recompute = cost.prefill_seconds(context, budget)
        effective = recompute if recompute is not None else model_recompute
        rows.append(
            {
                "context_tokens": context,
                "num_blocks": blocks,
                "swap_bytes": blocks * block_bytes,
                "swap_out_s": swap_out,
                "swap_in_s": swap_in,
                "swap_s_per_block": (swap_out + swap_in) / (2 * blocks),
                "recompute_s": recompute,
                "recompute_measured": measured,
                "recompute_over_swap": effective / (swap_out + swap_in),
                "model_swap_s": cost.swap_seconds(2 * blocks),
                "model_recompute_s": model_recompute,
            }
        )
    crossover = next(
        (
            n
            for n in range(block_size, max(CONTEXTS) + 1, block_size)
            if cost.swap_seconds(2 * (n // block_size)) <= cost.prefill_seconds(n, budget)
        ),
        None,
    )
    return {
        "model": model,
        **hardware(dtype),
        "block_size": block_size,
        "kv_bytes_per_block": block_bytes,
        "rows": rows,
        "crossover_tokens": crossover,
        "model_swap_s_per_block": cost.coefficients.swap_s_per_block,
    }


def _execute_all(runner: ModelRunner, plans: list[StepPlan]) -> None:
    for plan in plans:
        runner.execute(plan)


def _best(repeats: int, fn: Callable[[], object]) -> float:
    """Fastest of ``repeats`` timings: the machine is shared, noise only adds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _ms(seconds: object) -> str:
    return "(n/a)" if seconds is None else f"{1e3 * float(seconds):.1f}"  # type: ignore[arg-type]


def format_sweep(report: dict[str, object]) -> str:
    rows = report["rows"]
    assert isinstance(rows, list)
    lines = [
        f"{'context':>7} {'blocks':>6} {'MiB':>6} {'swap out+in ms':>14} {'us/block':>8} "
        f"{'recompute ms':>12} {'ratio':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r['context_tokens']:>7} {r['num_blocks']:>6} {r['swap_bytes'] / 2**20:>6.2f} "
            f"{1e3 * (r['swap_out_s'] + r['swap_in_s']):>14.2f} "
            f"{1e6 * r['swap_s_per_block']:>8.1f} {_ms(r['recompute_s']):>12} "
            f"{r['recompute_over_swap']:>7.0f}"
        )
    lines.append(
        f"policy crossover (swap when cheaper than recompute): {report['crossover_tokens']} tokens"
    )
    return "\n".join(lines)

"""``slipstream bench spec``: speculative decoding by prompt lookup
(``--speculative-tokens``), each K against the same workload, in one process.

Two tasks, each at every ``--batch`` size (that many requests at once,
greedy, ``--max-tokens`` tokens each, EOS ignored), chat-templated:

- ``repeat``: "Repeat the following code exactly", over the source of a
  standard-library function (a different one per request): the output
  follows the prompt, so drafts mostly hold;
- ``free``: a short story on a topic: drafts are few and mostly rejected,
  so this is what speculation costs when it does not pay.

Each case runs ``--repeats`` times and the fastest run is reported (the
others' tokens/s are in the JSON: on a shared machine they show what the
neighbours took). Each K runs in a process of its own.

Reports per (task, batch, K): output tokens/s, mean inter-token latency
(a request's time from its first token to its last, over its tokens after
the first, averaged over requests), the tokens a request gets per decode
step (1 without drafts), draft tokens per decode and the share accepted;
and writes JSON (``{"benchmark": "spec", "hardware", "parameters", "rows"}``)
and a PNG.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.scheduler.plan import StepPlan
from slipstream.scheduler.request import FinishReason
from slipstream.service.bench.report import add_kv_memory_argument, hardware, resolved_dtype
from slipstream.service.engine.config import DTYPE_CHOICES, EngineConfig
from slipstream.service.engine.events import RequestSpec

# The code the repeat task asks for back: a standard-library function a request.
SOURCES = (
    "textwrap.dedent",
    "json.dumps",
    "shlex.split",
    "fnmatch.translate",
    "difflib.get_close_matches",
    "heapq.nlargest",
    "random.Random.shuffle",
    "statistics.median",
)
TOPICS = (
    "a lighthouse keeper",
    "a lost umbrella",
    "the first snow of winter",
    "a robot learning to paint",
    "a market at dawn",
    "a letter that arrived late",
    "two rival bakers",
    "a train that never stops",
)
MAX_SOURCE_CHARS = 1200
TASKS = ("repeat", "free")


class SpecBenchError(Exception):
    """A benchmark that cannot run as asked."""


@dataclass(frozen=True, slots=True)
class SpecOptions:
    model: str = "smollm2"
    speculative_tokens: tuple[int, ...] = (0, 4)
    batches: tuple[int, ...] = (1, 8)
    max_tokens: int = 128
    # Runs of each case, the fastest kept: on a shared machine the others
    # show what the neighbours took.
    repeats: int = 3
    dtype: str = "bfloat16"  # concrete
    requested_dtype: str = "auto"
    num_threads: int = 2
    kv_memory: str = "commit"
    json_path: str | None = None
    plot_path: str | None = None


def _source(name: str) -> str:
    module_name, _, attr = name.partition(".")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return inspect.getsource(target)[:MAX_SOURCE_CHARS]


def task_messages(task: str, index: int) -> list[tuple[str, str]]:
    """Request ``index``'s conversation in ``task``."""
    if task == "repeat":
        code = _source(SOURCES[index % len(SOURCES)])
        return [("user", f"Repeat the following code exactly, and nothing else:\n\n{code}")]
    return [("user", f"Write a short story about {TOPICS[index % len(TOPICS)]}.")]


def _prompt(tokenizer: Any, task: str, index: int) -> list[int]:
    """Chat-templated where the model has a template, else the plain text."""
    from slipstream.service.engine.chat import has_chat_template, render_chat
    from slipstream.service.engine.encoding import token_ids

    messages = task_messages(task, index)
    if has_chat_template(tokenizer):
        return render_chat(tokenizer, messages)
    return token_ids(tokenizer, messages[0][1])


class _StepCounts:
    """Decode steps, drafting ones and their draft tokens (a step listener)."""

    def __init__(self) -> None:
        self.decodes = self.drafting = self.drafts = 0

    def __call__(self, plan: StepPlan, step_s: float) -> None:
        for seq in plan.seqs:
            if seq.sample and seq.output_index > 0:
                self.decodes += 1
                self.drafting += seq.num_drafts > 0
                self.drafts += seq.num_drafts


def run_case(options: SpecOptions, model_dir: str, k: int) -> list[dict[str, object]]:
    """One engine with K draft tokens: every task at every batch size."""
    from slipstream.service.engine.engine import Engine
    from slipstream.service.engine.loader import load_parts

    config = EngineConfig(
        model=model_dir,
        dtype=options.dtype,
        num_threads=options.num_threads,
        commit_kv_memory=options.kv_memory == "commit",
        # As serve does: how many drafts pay is priced by the step-cost model.
        calibrate_cost_model=True,
        speculative_tokens=k,
    )
    parts = load_parts(config)
    counts = _StepCounts()
    engine = Engine(
        parts.scheduler(), parts.runner, parts.tokenizer, parts.info, step_listeners=[counts]
    )
    rows = []
    try:
        warmup = [RequestSpec("warmup", list(range(5, 40)), 8, ignore_eos=True)]
        engine.generate(warmup)
        for task in TASKS:
            for batch in options.batches:
                prompts = [_prompt(parts.tokenizer, task, i) for i in range(batch)]
                runs = [
                    _timed(engine, counts, prompts, options, task, k, repeat)
                    for repeat in range(options.repeats)
                ]
                best = max(runs, key=lambda run: run["output_tokens_per_s"])
                best["output_tokens_per_s_runs"] = [run["output_tokens_per_s"] for run in runs]
                rows.append(best)
    finally:
        engine.shutdown()
    return rows


def _timed(
    engine: Any,
    counts: _StepCounts,
    prompts: list[list[int]],
    options: SpecOptions,
    task: str,
    k: int,
    repeat: int,
) -> dict[str, Any]:
    tag = f"{task}-{len(prompts)}-{k}-{repeat}"
    requests = [
        RequestSpec(f"{tag}-{i}", p, options.max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    before = engine.stats()
    counts.__init__()  # type: ignore[misc]
    started = time.monotonic()
    results = engine.generate(requests)
    wall_s = time.monotonic() - started
    after = engine.stats()
    itls = []
    for result in results:
        if result.finish.reason is not FinishReason.MAX_TOKENS:
            raise SpecBenchError(f"{result.req_id} ended {result.finish.reason.name}")
        n = len(result.token_ids)
        itls.append((result.token_times[-1] - result.token_times[0]) / (n - 1))
    num_output = sum(len(r.token_ids) for r in results)
    drafts = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    decodes = max(1, counts.decodes)
    return {
        "task": task,
        "batch": len(prompts),
        "speculative_tokens": k,
        "output_tokens_per_s": num_output / wall_s,
        "itl_mean_ms": 1000 * sum(itls) / len(itls),
        "wall_s": wall_s,
        # Per request and decode step: 1 + its accepted drafts.
        "tokens_per_decode_step": (counts.decodes + accepted) / decodes,
        "drafts_per_decode_step": drafts / decodes,
        "accepted_per_drafting_step": accepted / max(1, counts.drafting),
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "decode_steps": counts.decodes,
        "load_avg_1m": os.getloadavg()[0],
    }


def run_spec(options: SpecOptions) -> dict[str, object]:
    import torch

    from slipstream.service.models.store import resolve_model

    torch.set_num_threads(options.num_threads)
    try:
        model_dir = str(resolve_model(options.model))
    except ValueError as exc:
        raise SpecBenchError(str(exc)) from exc
    rows = []
    # Each K in a process of its own, as a server of its own would run: a
    # second engine in one process finds the first one's OpenMP team and
    # its workers sleep between regions (kernels/compute_thread.py), which
    # slowed whichever K ran second by up to 3x on tiny.
    spawn = multiprocessing.get_context("spawn")
    for k in options.speculative_tokens:
        print(f"--speculative-tokens {k} ...", flush=True)
        with spawn.Pool(1) as pool:
            rows += pool.apply(run_case, (options, model_dir, k))
    report = {
        "benchmark": "spec",
        "hardware": {**hardware(options.requested_dtype), "num_threads": options.num_threads},
        "parameters": {
            "model": options.model,
            "speculative_tokens": list(options.speculative_tokens),
            "batches": list(options.batches),
            "max_tokens": options.max_tokens,
            "repeats": options.repeats,
            "tasks": {"repeat": list(SOURCES), "free": list(TOPICS)},
            "kv_memory": options.kv_memory,
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        },
        "rows": rows,
    }
    print(format_table(rows))
    if options.json_path:
        Path(options.json_path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if options.plot_path:
        plot_spec(report, options.plot_path)
    return report


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'task':<7} {'batch':>5} {'K':>3} {'out tok/s':>10} {'ITL ms':>8} "
        f"{'tok/step':>9} {'drafts/step':>11} {'accepted':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['task']:<7} {r['batch']:>5} {r['speculative_tokens']:>3} "
            f"{r['output_tokens_per_s']:>10.1f} {r['itl_mean_ms']:>8.1f} "
            f"{r['tokens_per_decode_step']:>9.2f} {r['drafts_per_decode_step']:>11.2f} "
            f"{r['acceptance_rate']:>9.0%}"
        )
    return "\n".join(lines)


def plot_spec(report: dict[str, Any], path: str) -> None:
    """PNG: output tokens/s and mean ITL per (task, batch), one bar per K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    cases = sorted({(r["task"], r["batch"]) for r in rows}, key=lambda c: (TASKS.index(c[0]), c[1]))
    ks = report["parameters"]["speculative_tokens"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        by_case = {(r["task"], r["batch"]): r for r in rows if r["speculative_tokens"] == k}
        xs = [i + j * width for i in range(len(cases))]
        axes[0].bar(xs, [by_case[c]["output_tokens_per_s"] for c in cases], width, label=f"K={k}")
        axes[1].bar(xs, [by_case[c]["itl_mean_ms"] for c in cases], width, label=f"K={k}")
    labels = [f"{task}\nbatch {batch}" for task, batch in cases]
    for ax, ylabel in zip(
        axes, ("output tokens/s (higher is better)", "mean ITL, ms (lower is better)"), strict=True
    ):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], labels)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    hw, params = report["hardware"], report["parameters"]
    cpu = hw.get("cpu", {})
    fig.suptitle(
        f"prompt-lookup speculative decoding · {params['model']} · {hw['dtype']} · "
        f"{params['max_tokens']} tokens a request · {hw['num_threads']} threads · "
        f"{cpu.get('model')} ({', '.join(cpu.get('flags', [])) or 'no listed flags'})",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "spec",
        help="speculative decoding by prompt lookup: each --speculative-tokens K, same workload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2", help="model name or path (chat template)")
    parser.add_argument(
        "--speculative-tokens", type=_int_list, default=(0, 4), help="comma-separated K values"
    )
    parser.add_argument("--batch", type=_int_list, default=(1, 8), help="comma-separated sizes")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens a request")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each case, the fastest reported"
    )
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--threads", type=int, default=2, dest="num_threads")
    add_kv_memory_argument(parser)
    parser.add_argument("--json", dest="json_path", help="write the report here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG here (needs matplotlib)")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if min(args.batch) < 1 or args.max_tokens < 2 or args.repeats < 1:
        print(
            "slipstream bench spec: --batch sizes >= 1, --max-tokens >= 2, --repeats >= 1",
            file=sys.stderr,
        )
        return 2
    options = SpecOptions(
        model=args.model,
        speculative_tokens=args.speculative_tokens,
        batches=args.batch,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        dtype=resolved_dtype(args.dtype),
        requested_dtype=args.dtype,
        num_threads=args.num_threads,
        kv_memory=args.kv_memory,
        json_path=args.json_path,
        plot_path=args.plot_path,
    )
    try:
        run_spec(options)
    except SpecBenchError as exc:
        print(f"slipstream bench spec: {exc}", file=sys.stderr)
        return 2
    return 0

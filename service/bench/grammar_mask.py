"""What structured output adds to a decode step: the same step of ``--batch``
sequences with no constrained row, then with every row constrained (the
runner's ``execute(plan, matchers)``: the masks filled on the host and
applied before sampling, then each matcher advanced by its sampled token,
as the engine's update does). Medians over ``--rounds`` rounds of
``--steps`` steps each, the three cases taking turns (a shared machine's
load drifts between them alike)::

    python -m slipstream.service.bench.grammar_mask --model tiny --batch 8 --threads 1

``--mask-only`` times the mask and the matchers' advance alone, over
random logits of the model's vocabulary (no model is loaded): what the
constraints add to a step, with none of a loaded machine's noise in the
forward around it.

Two constraints: a JSON string (most of the vocabulary allowed at each
step: the largest masks) and digits (a few tokens). A matcher whose output
is complete starts again. A greedy step without constraints picks its tokens
in the LM head without logits where the model can (the CPU's panel
linears); a constrained one needs the logits, so ``--temperature 1``
compares sampled steps, which both take with logits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from slipstream.scheduler.plan import StepPlan
from slipstream.scheduler.request import ConstraintKind, OutputConstraint, SamplingParams
from slipstream.service.engine.grammar import Grammar, GrammarCompiler, Matcher, mask_logits

CONSTRAINTS = {
    "json_string": OutputConstraint(ConstraintKind.JSON_SCHEMA, '{"type": "string"}'),
    "digits": OutputConstraint(ConstraintKind.REGEX, "[0-9]+"),
}


def _time_steps(
    runner: object, plan: StepPlan, steps: int, grammar: Grammar | None = None
) -> list[float]:
    """Milliseconds per step, each matcher (if any) advanced by its token."""
    matchers: dict[str, Matcher] | None = None
    if grammar is not None:
        matchers = {seq.req_id: grammar.start() for seq in plan.seqs}
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        if matchers is None:
            runner.execute(plan)  # type: ignore[attr-defined]
        else:
            result = runner.execute(plan, matchers)  # type: ignore[attr-defined]
            for req_id, token in result.sampled.items():
                if matchers[req_id].take(token):
                    assert grammar is not None
                    matchers[req_id] = grammar.start()  # complete: again
        times.append((time.perf_counter_ns() - start) / 1e6)
    return times


def _time_masks(grammar: Grammar, batch: int, vocab: int, steps: int) -> list[float]:
    """Milliseconds per ``mask_logits`` over random ``[batch, vocab]``
    logits plus each matcher's advance by its row's argmax."""
    matchers = {f"q{i}": grammar.start() for i in range(batch)}
    req_ids = list(matchers)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=generator)
        start = time.perf_counter_ns()
        mask_logits(logits, req_ids, matchers)
        for req_id, token in zip(req_ids, logits.argmax(dim=-1).tolist(), strict=True):
            if matchers[req_id].take(token):
                matchers[req_id] = grammar.start()
        times.append((time.perf_counter_ns() - start) / 1e6)
    return times


def run_masks(args: argparse.Namespace) -> list[tuple[str, float]]:
    from transformers import AutoTokenizer

    from slipstream.service.models.store import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id])
    rows = [("none", 0.0)]
    for name, constraint in CONSTRAINTS.items():
        grammar = compiler.compile(constraint)
        times = _time_masks(grammar, args.batch, len(tokenizer), args.steps * args.rounds)
        rows.append((name, statistics.median(times)))
    return rows


def run(args: argparse.Namespace) -> list[tuple[str, float]]:
    from slipstream.service.bench.step_timing import blocks_per_seq, decode_plan, fill_kv
    from slipstream.service.engine.config import EngineConfig
    from slipstream.service.engine.loader import load_parts

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=16,
        num_device_blocks=args.batch * blocks_per_seq(args.context, 16),
        num_host_blocks=0,
        max_model_len=args.context + 1,
        max_num_seqs=args.batch,
        policy="fcfs",
        num_threads=args.threads,
    )
    parts = load_parts(config)
    fill_kv(parts.runner)
    plan = decode_plan(args.batch, args.context, 16, sampling=SamplingParams(args.temperature))
    compiler = GrammarCompiler(parts.tokenizer, parts.info.eos_token_ids)
    cases: dict[str, Grammar | None] = {"none": None}
    cases.update({name: compiler.compile(c) for name, c in CONSTRAINTS.items()})
    times: dict[str, list[float]] = {name: [] for name in cases}
    for grammar in cases.values():
        _time_steps(parts.runner, plan, args.warmup, grammar)
    for _ in range(args.rounds):
        for name, grammar in cases.items():
            times[name] += _time_steps(parts.runner, plan, args.steps, grammar)
    return [(name, statistics.median(ms)) for name, ms in times.items()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch's (0: its default)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--mask-only", action="store_true", help="the mask alone, no model")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run_masks(args) if args.mask_only else run(args)
    base = rows[0][1]
    what = "the mask alone" if args.mask_only else f"temperature {args.temperature:g}"
    print(f"{args.model}, {args.batch} sequences, {what}")
    for name, ms in rows:
        print(f"  {name:12} {ms:8.2f} ms/step  (+{ms - base:.2f} ms)")


if __name__ == "__main__":
    main()

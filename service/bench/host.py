"""``slipstream bench host``: what the host spends per decode step outside
the model — the scheduler's ``schedule`` and ``update``, staging a step's
metadata for a GPU, and the whole engine step (planning, bookkeeping,
detokenising, publishing) with a runner that returns its tokens at once.
On a GPU this is the budget planning ahead must hide under the device's
step (docs/gpu.md); on the CPU it adds to the step.

For each batch size and policy: ``batch`` requests of ``context`` prompt
tokens decode together; the medians cover steps where all of them decode.
With ``--deadlines`` each policy is timed again with every request carrying
a deadline (an hour away, never binding) and an expected output length, as
callers with latency promises send them: the deadline policy then keeps an
estimate and a step ceiling per request.
JSON: ``{"benchmark": "host", "hardware": {...}, "parameters": {...}, "rows":
[{"batch", "policy", "deadlines", "schedule_ms", "update_ms", "stage_ms",
"engine_step_ms"}]}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from slipstream.scheduler.plan import StepPlan
from slipstream.scheduler.policy_registry import POLICY_NAMES

NUM_STEPS = 200  # timed steps per row (after WARMUP_STEPS)
WARMUP_STEPS = 20
VOCAB_SIZE = 49_152  # SmolLM2's, for staging the sampling rows


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "host", help="the host's time per decode step outside the model (schedule, update, publish)"
    )
    parser.add_argument("--batch", default="64,256", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    parser.add_argument("--policy", default="deadline,fcfs", help=f"subset of {POLICY_NAMES}")
    parser.add_argument("--model", default="tiny", help="whose tokenizer detokenises")
    parser.add_argument(
        "--deadlines", action="store_true", help="also time requests that carry deadlines"
    )
    parser.add_argument("--json", dest="json_path", help="write the report here")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICY_NAMES))
    if unknown or not batches or min(batches) < 1:
        print(f"slipstream bench host: bad --batch or --policy ({unknown})")
        return 2
    report = run_host_bench(batches, policies, args.context, args.model, args.deadlines)
    print(format_table(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


def run_host_bench(
    batches: list[int], policies: list[str], context: int, model: str, deadlines: bool = False
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from slipstream.service.bench.report import hardware
    from slipstream.service.models.store import resolve_model

    model_dir = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for policy in policies:
        for limits in (False, True) if deadlines else (False,):
            for batch in batches:
                schedule_ms, update_ms, stage_ms = time_scheduler(batch, policy, context, limits)
                step_ms = time_engine_step(batch, policy, context, tokenizer, limits)
                rows.append(
                    {
                        "batch": batch,
                        "policy": policy,
                        "deadlines": limits,
                        "schedule_ms": schedule_ms,
                        "update_ms": update_ms,
                        "stage_ms": stage_ms,
                        "engine_step_ms": step_ms,
                    }
                )
    return {
        "benchmark": "host",
        "hardware": hardware("float32"),
        "parameters": {
            "context": context,
            "steps": NUM_STEPS,
            "model": model,
            "deadlines": deadlines,
        },
        "rows": rows,
    }


def _requests(batch: int, context: int, max_new: int, deadlines: bool) -> list[Any]:
    from slipstream.service.engine.events import RequestSpec

    deadline = time.monotonic() + 3600.0 if deadlines else None
    return [
        RequestSpec(
            req_id=f"r{i}",
            prompt_token_ids=[5 + (i + j) % 1000 for j in range(context)],
            max_new_tokens=max_new,
            ignore_eos=True,
            deadline=deadline,
            expected_output_tokens=max_new if deadlines else None,
        )
        for i in range(batch)
    ]


def _scheduler(batch: int, policy: str, context: int, cost_model: Any = None) -> Any:
    from slipstream.scheduler import Scheduler, SchedulerConfig
    from slipstream.scheduler.cost_model import CostCoefficients, CostModel

    max_new = NUM_STEPS + WARMUP_STEPS + 2
    config = SchedulerConfig(
        num_device_blocks=batch * (-(-(context + max_new) // 16) + 1),
        block_size=16,
        max_model_len=context + max_new,
        max_num_seqs=batch,
        max_num_batched_tokens=batch * context,  # every prefill in one step
        num_host_blocks=0,
        policy=policy,
    )
    if cost_model is None:
        cost_model = CostModel(CostCoefficients())
    return Scheduler(config, cost_model=cost_model)


def time_scheduler(
    batch: int, policy: str, context: int, deadlines: bool = False
) -> tuple[float, float, float]:
    """Median ms of ``schedule``, of ``update`` and of staging the plan's
    metadata for a device (``staging.stage_step``, host buffers only: the
    part of a GPU step's launch the host pays for) over decode-only steps.
    Each step is reported to have taken what the cost model predicted for
    it: the refit runs, and the model stays where it started."""
    import torch

    from slipstream.scheduler.cost_model import CostCoefficients, CostModel
    from slipstream.scheduler.request import Request
    from slipstream.service.engine.staging import StagingBuffers, StagingLayout, stage_step

    cost_model = CostModel(CostCoefficients())
    scheduler = _scheduler(batch, policy, context, cost_model)
    config = scheduler.config
    max_blocks = -(-config.max_model_len // config.block_size)
    layout = StagingLayout.build(config.max_num_batched_tokens, batch, max_blocks)
    staging = StagingBuffers(layout, torch.device("cpu"), pin_memory=False)
    now = time.monotonic()
    for spec in _requests(batch, context, NUM_STEPS + WARMUP_STEPS + 2, deadlines):
        scheduler.add_request(Request.from_spec(spec, (), now))
    schedule_ms, update_ms, stage_ms = [], [], []
    for step in range(NUM_STEPS + WARMUP_STEPS + 1):
        start = time.perf_counter()
        plan = scheduler.schedule(now)
        planned = time.perf_counter()
        stage_step(plan, staging, config.block_size, VOCAB_SIZE)
        staged = time.perf_counter()
        staging.upload(len(plan.seqs))  # turns to the other host buffer, as a runner does
        step_s = cost_model.plan_seconds(plan)
        now += step_s
        sampled = {s.req_id: 7 for s in plan.seqs if s.sample}
        resumed = time.perf_counter()
        scheduler.update(plan, sampled, now, step_s)
        if step > WARMUP_STEPS:
            schedule_ms.append((planned - start) * 1e3)
            update_ms.append((time.perf_counter() - resumed) * 1e3)
            stage_ms.append((staged - planned) * 1e3)
    return statistics.median(schedule_ms), statistics.median(update_ms), statistics.median(stage_ms)


class _InstantRunner:
    """Returns a token for every sampling sequence at once: the engine's own cost."""

    def execute(self, plan: StepPlan) -> Any:
        from slipstream.service.engine.runner import StepResult

        return StepResult({s.req_id: 1000 + s.start_pos % 500 for s in plan.seqs if s.sample}, 0)

    def launch(self, plan: StepPlan) -> Any:
        from slipstream.service.engine.runner import DoneStep

        return DoneStep(self.execute(plan))


def time_engine_step(
    batch: int, policy: str, context: int, tokenizer: Any, deadlines: bool = False
) -> float:
    """Median ms of a whole engine step (plan, update, detokenise with
    ``tokenizer``, publish to a no-op callback) over the steps where all
    ``batch`` requests decode."""
    from slipstream.service.engine.engine import Engine
    from slipstream.service.engine.events import ModelInfo

    info = ModelInfo(name="", path="", architecture="llama", max_model_len=0,
                     vocab_size=len(tokenizer), block_size=16, eos_token_ids=[], dtype="",
                     attention_backend="")  # fmt: skip
    steps: list[float] = []

    def listen(plan: StepPlan, seconds: float) -> None:
        if len(plan.seqs) == batch and plan.num_tokens == batch:
            steps.append(seconds * 1e3)

    engine = Engine(_scheduler(batch, policy, context), _InstantRunner(), tokenizer, info, [listen])
    engine.start()
    try:
        for spec in _requests(batch, context, NUM_STEPS + WARMUP_STEPS + 2, deadlines):
            engine.submit(spec, lambda event: None)
        engine.wait_idle(timeout=300)
    finally:
        engine.shutdown()
    return statistics.median(steps[WARMUP_STEPS:] or steps)


def format_table(report: dict[str, Any]) -> str:
    cpu = report["hardware"]["cpu"]
    lines = [
        f"host per decode step, {cpu['model']} ({', '.join(cpu['flags'])}), "
        f"context {report['parameters']['context']}, medians of {NUM_STEPS} steps (ms)",
        f"{'policy':<9} {'deadlines':>9} {'batch':>5} {'schedule':>9} {'update':>7} "
        f"{'stage':>6} {'engine step':>12}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['policy']:<9} {'yes' if r['deadlines'] else 'no':>9} {r['batch']:>5} "
            f"{r['schedule_ms']:>9.2f} {r['update_ms']:>7.2f} {r['stage_ms']:>6.2f} "
            f"{r['engine_step_ms']:>12.2f}"
        )
    lines.append("engine step: schedule + update + detokenise + publish, no model")
    lines.append("stage: a GPU step's metadata written on the host (not part of the engine step)")
    return "\n".join(lines)

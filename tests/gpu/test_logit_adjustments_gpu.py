"""Penalties and logit bias on a CUDA GPU: the adjustment equals the CPU's,
a step that makes it still waits on its sampled ids only (nothing a request
asks is captured in a graph, nothing synchronises), and the engine planning
ahead (a decode's last token pending on the device) gives the CPU engine's
greedy tokens. Run as ``make test-gpu``."""

from __future__ import annotations

import pytest
import torch
from gpu_marks import GPU_ONLY

from slipstream.kernels.logit_adjustments import (
    AdjustedRow,
    adjust_logits_,
    adjustment_tensors,
    plan_adjustments,
)
from slipstream.scheduler.plan import ScheduledSeq, StepPlan
from slipstream.scheduler.request import FinishReason, Request, SamplingParams
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.cuda_runner import DeviceRunner, move_model_to
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_engine
from slipstream.service.engine.runner import ModelRunner
from slipstream.service.models.llama import LlamaModel

pytestmark = GPU_ONLY

BLOCK = 16
CUDA = torch.device("cuda", 0)
ASKING = [
    SamplingParams(frequency_penalty=2.0, presence_penalty=1.0),
    SamplingParams(),
    SamplingParams(repetition_penalty=1.5, logit_bias=((7, 3.0), (40, -100.0))),
    # The biased token first, then never again (its last token counted on the device).
    SamplingParams(logit_bias=((3, 100.0),), repetition_penalty=1000.0),
]
PROMPT = [4, 17, 29, 5, 8]  # holds no token 3


def test_min_tokens_ban_and_min_p_on_the_gpu_are_the_cpus():
    """min_tokens' ban in the adjustments, min-p among the sampler's filters:
    the CPU's -inf places, and a seeded draw the CPU's but where it falls
    within rounding of a boundary (at most two rows of 256 apart)."""
    from slipstream.kernels.device_sampling import plan_sampling, sample_tensors, sampling_batch
    from slipstream.kernels.sampling import sample
    from slipstream.kernels.sampling_filters import filter_min_p_

    vocab, num_rows = 49_152, 256
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(5)) * 3
    rows = [
        AdjustedRow(row, 0.0, 0.0, 1.0, (), (), (), False, (2, 7, row, vocab + 1))
        for row in range(0, num_rows, 3)
    ]
    plan = plan_adjustments(rows, num_rows, vocab)
    assert plan is not None
    last = torch.zeros(num_rows, dtype=torch.long)
    want = adjust_logits_(logits.clone(), adjustment_tensors(plan, last))
    got = adjust_logits_(logits.to(CUDA), adjustment_tensors(plan, last.to(CUDA)))
    assert torch.equal(got.cpu().isinf(), want.isinf()) and int(want.isinf().sum()) > 0
    min_ps = [(0.0, 0.05, 0.3, 1.0)[i % 4] for i in range(num_rows)]
    kept = filter_min_p_(logits.clone(), torch.tensor(min_ps)).isfinite()
    kept_gpu = filter_min_p_(logits.to(CUDA), torch.tensor(min_ps, device=CUDA)).isfinite()
    assert int((kept_gpu.cpu() != kept).sum()) <= 2
    temps = [0.5 + (i % 7) / 5 for i in range(num_rows)]
    ks = [(0, 20)[i % 2] for i in range(num_rows)]
    ps = [(1.0, 0.9, 0.5)[i % 3] for i in range(num_rows)]
    seeds, indices = list(range(num_rows)), [i % 11 for i in range(num_rows)]
    expected = sample(logits, temps, ks, ps, seeds, indices, min_ps=min_ps)
    sampling = plan_sampling(temps, ks, ps, seeds, indices, vocab, min_ps)
    picked = sample_tensors(logits.to(CUDA), sampling_batch(sampling, CUDA)).tolist()
    assert sum(a != b for a, b in zip(picked, expected, strict=True)) <= 2


def test_the_adjustment_on_the_gpu_is_the_cpus():
    vocab, num_rows = 49_152, 64
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(num_rows, vocab, generator=gen) * 4
    ids = torch.randint(0, vocab, (num_rows, 300), generator=gen).tolist()
    rows = [
        AdjustedRow(
            row, 0.5 * (row % 3), 1.0 * (row % 2), (1.0, 1.3, 0.8)[row % 3],
            tuple((t, 1.5) for t in ids[row][:40:4]), ids[row][:200], ids[row][150:290],
            row % 4 != 0,
        )
        for row in range(0, num_rows, 2)
    ]  # fmt: skip
    plan = plan_adjustments(rows, num_rows, vocab)
    assert plan is not None
    last = torch.randint(0, vocab, (num_rows,), generator=gen)
    want = adjust_logits_(logits.clone(), adjustment_tensors(plan, last))
    got = adjust_logits_(logits.to(CUDA), adjustment_tensors(plan, last.to(CUDA)))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-6)


def _steps(runner, num_steps: int) -> list[list[int]]:
    """``ASKING``'s rows over ``num_steps`` steps, each request's record kept
    as the engine keeps it (the runner reads it through ``use_requests``)."""
    requests = {f"r{i}": Request(f"r{i}", list(PROMPT), 64) for i in range(len(ASKING))}
    runner.use_requests(requests.get)
    tokens = [list(PROMPT) for _ in ASKING]
    computed = [0] * len(ASKING)
    for step in range(num_steps):
        seqs = [
            ScheduledSeq(f"r{i}", tokens[i][computed[i]:], computed[i],
                         [i * 16 + j for j in range(16)], True, step, params)
            for i, params in enumerate(ASKING)
        ]  # fmt: skip
        result = runner.execute(StepPlan(step=step, seqs=seqs))
        for i in range(len(ASKING)):
            computed[i] = len(tokens[i])
            tokens[i].append(result.sampled[f"r{i}"])
            requests[f"r{i}"].output_token_ids.append(result.sampled[f"r{i}"])
    return [t[len(PROMPT) :] for t in tokens]


def test_adjusted_steps_match_the_cpu_runner_and_wait_on_nothing_more(tiny_model_dir, monkeypatch):
    cpu_model = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    cpu = _steps(ModelRunner(cpu_model, 256, 64, BLOCK), 6)
    model = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    move_model_to(model, CUDA)
    runner = DeviceRunner(
        model, 256, 64, BLOCK, device=CUDA, max_num_seqs=16, max_num_batched_tokens=512,
        max_model_len=512, use_cuda_graphs=True,
    )  # fmt: skip
    assert _steps(runner, 6) == cpu  # eager prefill, then the decode graphs
    assert cpu[3][0] == 3 and 3 not in cpu[3][1:] and 40 not in cpu[2]
    torch.cuda.synchronize()
    waits: list[str] = []
    event_wait = torch.cuda.Event.synchronize

    def counted_event_wait(event: torch.cuda.Event) -> None:
        waits.append("event")
        event_wait(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted_event_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        _steps(runner, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert waits == ["event"] * 4


@pytest.mark.parametrize("plan_ahead", [True, False], ids=["ahead", "behind"])
def test_the_engine_on_the_gpu_adjusts_as_the_cpu_engine(tiny_model_dir, plan_ahead):
    requests = [
        RequestSpec(f"q{i}", [4 + i, *PROMPT], 24, sampling=params, ignore_eos=True)
        for i, params in enumerate(ASKING)
    ]

    def run(device: str, **options: object) -> list[list[int]]:
        config = EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            device=device,
            calibrate_cost_model=False,
            **options,
        )  # type: ignore[arg-type]
        engine = load_engine(config)
        try:
            results = engine.generate(requests)
        finally:
            engine.shutdown()
        assert all(r.finish.reason is FinishReason.MAX_TOKENS for r in results)
        return [r.token_ids for r in results]

    assert run("cuda", plan_ahead=plan_ahead) == run("cpu")

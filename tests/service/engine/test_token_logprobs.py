"""Log-probabilities of sampled tokens: the math against a float64
reference, and both runners' (the device runner's logic on the CPU) on the
``tiny`` model, greedy and sampled rows side by side."""

from __future__ import annotations

import pytest
import torch

from slipstream.scheduler.plan import ScheduledSeq, StepPlan
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine import token_logprobs
from slipstream.service.engine.cuda_runner import DeviceRunner, move_model_to
from slipstream.service.engine.runner import ModelRunner
from slipstream.service.engine.token_logprobs import LogprobRows
from slipstream.service.models.llama import LlamaModel

BLOCK = 16
CPU = torch.device("cpu")


def test_picks_against_float64_reference():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 4
    reference = torch.log_softmax(logits.double(), dim=-1)
    wanted = LogprobRows.of(
        ["a", "b", "c", "d"],
        [SamplingParams(logprobs=0), SamplingParams(), SamplingParams(logprobs=3),
         SamplingParams(logprobs=5)],
    )  # fmt: skip
    assert wanted is not None and wanted.req_ids == ["a", "c", "d"]
    taken = wanted.log_probs(logits)
    logits.mul_(0.01)  # the sampler may scale the logits in place after
    sampled = torch.tensor([7, 1, 49, 0])
    read = wanted.pick(taken, sampled).read()
    assert set(read) == {"a", "c", "d"}
    for req_id, row, num_top in (("a", 0, 0), ("c", 2, 3), ("d", 3, 5)):
        got = read[req_id]
        assert got.logprob == pytest.approx(reference[row, sampled[row]].item(), abs=1e-5)
        top = torch.topk(reference[row], num_top)
        assert got.top_token_ids == top.indices.tolist()
        assert got.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)


def test_rows_past_one_chunk_keep_their_order(monkeypatch):
    monkeypatch.setattr(token_logprobs, "ROWS_PER_CHUNK", 2)
    torch.manual_seed(1)
    logits = torch.randn(5, 30)
    reference = torch.log_softmax(logits.double(), dim=-1)
    req_ids = [f"r{i}" for i in range(5)]
    wanted = LogprobRows.of(req_ids, [SamplingParams(logprobs=2)] * 5)
    assert wanted is not None
    sampled = torch.tensor([4, 3, 2, 1, 0])
    read = wanted.pick(wanted.log_probs(logits), sampled).read()
    for row, req_id in enumerate(req_ids):
        want = reference[row, sampled[row]].item()
        assert read[req_id].logprob == pytest.approx(want, abs=1e-5)
        assert read[req_id].top_token_ids == torch.topk(reference[row], 2).indices.tolist()


def test_nobody_asking_costs_nothing():
    assert LogprobRows.of(["a"], [SamplingParams(temperature=1.0)]) is None
    seq = ScheduledSeq("a", [1], 0, [0], True, 0, SamplingParams())
    assert LogprobRows.of_plan(["a"], [seq]) is None


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    reference = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    staged = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    move_model_to(staged, CPU)
    return reference, staged


SAMPLING = {
    "greedy": SamplingParams(logprobs=4),
    "sampled": SamplingParams(temperature=0.9, top_k=20, seed=3, logprobs=0),
    "silent": SamplingParams(),
}


def _steps(runner, prompt: list[int], num_steps: int, sampling=SAMPLING):
    """Each request's (token, logprobs) per step: a prefill, then decodes."""
    tokens = {req_id: list(prompt) for req_id in sampling}
    computed = dict.fromkeys(sampling, 0)
    seen: dict[str, list] = {req_id: [] for req_id in sampling}
    for step in range(num_steps):
        seqs = [
            ScheduledSeq(req_id, tokens[req_id][computed[req_id]:], computed[req_id],
                         [i * 4 + j for j in range(4)], True, step, params)
            for i, (req_id, params) in enumerate(sampling.items())
        ]  # fmt: skip
        result = runner.execute(StepPlan(step=step, seqs=seqs))
        for req_id in sampling:
            computed[req_id] = len(tokens[req_id])
            tokens[req_id].append(result.sampled[req_id])
            seen[req_id].append((result.sampled[req_id], result.logprobs.get(req_id)))
    return seen


def test_runners_report_the_tokens_they_sample(models):
    reference_model, staged_model = models
    prompt = [3, 17, 29, 4, 8, 11]
    cpu = _steps(ModelRunner(reference_model, 32, 8, BLOCK), prompt, 4)
    device = _steps(
        DeviceRunner(
            staged_model, 32, 8, BLOCK, device=CPU, max_num_seqs=8, max_num_batched_tokens=64,
            max_model_len=128, pin_memory=False,
        ),
        prompt,
        4,
    )  # fmt: skip
    assert all(lp is None for _, lp in cpu["silent"])
    for req_id in ("greedy", "sampled"):
        for (token, lp), (device_token, device_lp) in zip(cpu[req_id], device[req_id], strict=True):
            assert token == device_token
            assert lp.logprob < 0 and lp.logprob == pytest.approx(device_lp.logprob, abs=1e-4)
            assert lp.top_logprobs == pytest.approx(device_lp.top_logprobs, abs=1e-4)
    for token, lp in cpu["greedy"]:  # greedy: its token is the most likely one
        assert len(lp.top_token_ids) == 4 and lp.top_token_ids[0] == token
        assert lp.top_logprobs[0] == lp.logprob
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert all(lp.top_token_ids == [] for _, lp in cpu["sampled"])


def test_asking_changes_no_token(models):
    """A greedy batch whose LM head picks without logits (where the model
    can) takes the logits path when a row asks: the same tokens."""
    reference_model, _ = models
    prompt = [5, 9, 2, 14]
    asked = _steps(ModelRunner(reference_model, 32, 8, BLOCK), prompt, 3)
    quiet = {
        "greedy": SamplingParams(),
        "sampled": SamplingParams(temperature=0.9, top_k=20, seed=3),
        "silent": SamplingParams(),
    }
    plain = _steps(ModelRunner(reference_model, 32, 8, BLOCK), prompt, 3, quiet)
    for req_id in SAMPLING:
        assert [t for t, _ in asked[req_id]] == [t for t, _ in plain[req_id]]

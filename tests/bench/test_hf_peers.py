"""The peers must make exactly each request's ``max_tokens`` even when the
model's own EOS comes up: a checkpoint whose EOS is its first greedy token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slipstream.service.bench.hf_peers import load_hf_model, run_hf_cb, run_hf_static
from slipstream.service.bench.workload import WorkloadRequest

PROMPT = [10, 11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def eos_first_model_dir(
    tmp_path_factory: pytest.TempPathFactory, random_llama: Callable[..., Path]
) -> str:
    probe = load_hf_model(str(random_llama(tmp_path_factory.mktemp("probe"))), "float32")
    with torch.inference_mode():
        first = int(probe(torch.tensor([PROMPT])).logits[0, -1].argmax())
    path = random_llama(tmp_path_factory.mktemp("eos-first"), eos_token_id=first)
    return str(path)


def test_the_checkpoint_really_stops_at_once_with_eos(eos_first_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(eos_first_model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8)
    assert out.shape[1] == len(PROMPT) + 1


def test_static_ignores_eos(eos_first_model_dir: str) -> None:
    workload = [WorkloadRequest(PROMPT, 8), WorkloadRequest([20, 21, 22], 3)]
    run = run_hf_static(eos_first_model_dir, workload, "float32", batch_size=2)
    assert [t.num_output_tokens for t in run.timings] == [8, 3]
    # One batch: both results come back together, after their first token.
    assert run.timings[0].latency_s == run.timings[1].latency_s
    assert all(0 < t.ttft_s < t.latency_s for t in run.timings)


def test_continuous_batching_ignores_eos(eos_first_model_dir: str) -> None:
    workload = [WorkloadRequest(PROMPT, 8), WorkloadRequest([20, 21, 22], 3)]
    run = run_hf_cb(eos_first_model_dir, workload, "float32")
    assert [t.num_output_tokens for t in run.timings] == [8, 3]
    assert run.settings["page_size"] == 64
    assert run.settings["max_batch_tokens"] == 512
    assert all(0 < t.ttft_s <= t.latency_s <= run.wall_s for t in run.timings)


def test_static_batches_run_in_workload_order(tmp_path: Path, eos_first_model_dir: str) -> None:
    workload = [WorkloadRequest(PROMPT, 2) for _ in range(3)]
    run = run_hf_static(eos_first_model_dir, workload, "float32", batch_size=2)
    first, second, third = (t.latency_s for t in run.timings)
    assert first == second < third

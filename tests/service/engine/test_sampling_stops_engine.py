"""vLLM's ``stop_token_ids``, ``min_tokens`` and ``min_p`` under the engine,
on ``tiny``: a stop id ends the request as a stop, its text left out; EOS
and stop ids are masked until ``min_tokens`` outputs are out (planning
ahead too); min-p 1 leaves a sampled row its likeliest token alone; and
the device runner's path (on the CPU) picks what the CPU runner picks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.scheduler.request import FinishReason, SamplingParams
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.cuda_runner import DeviceRunner, move_model_to
from slipstream.service.engine.engine import Engine, FinishedResult
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_parts
from slipstream.service.models.llama import LlamaModel

BLOCK = 16
MAX_LEN = 128
PROMPT = [11, 305, 42, 7, 1999, 64]


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    return load_parts(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=BLOCK,
                     max_num_batched_tokens=48, max_model_len=MAX_LEN, policy="fcfs")
    )  # fmt: skip


def run(parts, *requests: RequestSpec, plan_ahead: bool = False, runner=None):
    engine = Engine(
        parts.scheduler(), runner or parts.runner, parts.tokenizer, parts.info,
        plan_ahead=plan_ahead,
    )  # fmt: skip
    try:
        return engine.generate(list(requests))
    finally:
        engine.shutdown()


def spec(req_id: str, max_tokens: int, ignore_eos: bool = True, **sampling: object) -> RequestSpec:
    return RequestSpec(
        req_id, PROMPT, max_tokens, sampling=SamplingParams(**sampling), ignore_eos=ignore_eos
    )


@pytest.fixture(scope="module")
def greedy(parts) -> FinishedResult:
    return run(parts, spec("greedy", 12))[0]


@pytest.mark.parametrize("plan_ahead", [False, True], ids=["step", "ahead"])
def test_a_stop_token_id_ends_the_request_as_a_stop_its_text_left_out(
    parts, greedy, plan_ahead
) -> None:
    tokens = greedy.token_ids
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    [got] = run(parts, spec("stop", 12, stop_token_ids=(4095, tokens[at])), plan_ahead=plan_ahead)
    assert got.token_ids == tokens[: at + 1]
    assert got.finish.reason is FinishReason.STOP_SEQUENCE
    assert got.text == parts.tokenizer.decode(tokens[:at])


@pytest.mark.parametrize("plan_ahead", [False, True], ids=["step", "ahead"])
def test_eos_and_stop_ids_wait_for_min_tokens(parts, plan_ahead) -> None:
    """Biased to be the only choice, EOS (or a stop id) is still masked for
    the first min_tokens outputs, greedy, and taken at once after."""
    [eos] = parts.info.eos_token_ids[:1]
    stop = 77
    requests = [
        spec("eos", 10, ignore_eos=False, min_tokens=3, logit_bias=((eos, 100.0),)),
        spec("stop", 10, min_tokens=2, stop_token_ids=(stop,), logit_bias=((stop, 100.0),)),
        spec("eos-off", 10, ignore_eos=False, logit_bias=((eos, 100.0),)),
    ]
    by_eos, by_stop, at_once = run(parts, *requests, plan_ahead=plan_ahead)
    assert len(by_eos.token_ids) == 4 and by_eos.token_ids[3] == eos
    assert eos not in by_eos.token_ids[:3] and by_eos.finish.reason is FinishReason.EOS
    assert len(by_stop.token_ids) == 3 and by_stop.token_ids[2] == stop
    assert stop not in by_stop.token_ids[:2]
    assert by_stop.finish.reason is FinishReason.STOP_SEQUENCE
    assert at_once.token_ids == [eos]


def test_a_stop_sequence_within_min_tokens_does_not_end_the_request(parts, greedy) -> None:
    """vLLM's: the first min_tokens tokens' text cannot end it."""
    stop = parts.tokenizer.decode(greedy.token_ids[:2])
    assert stop and greedy.text.count(stop) == 1
    requests = [spec("stops", 12), spec("goes-on", 12, min_tokens=2)]
    requests = [dataclasses.replace(r, stop_sequences=(stop,)) for r in requests]
    stopped, went_on = run(parts, *requests)
    assert stopped.finish.reason is FinishReason.STOP_SEQUENCE and stopped.text == ""
    assert went_on.finish.reason is FinishReason.MAX_TOKENS and went_on.text == greedy.text


def test_min_p_one_leaves_a_sampled_row_its_likeliest_token(parts, greedy) -> None:
    sampled, narrowed = run(
        parts,
        spec("sampled", 12, temperature=1.5, seed=7),
        spec("min-p", 12, temperature=1.5, seed=7, min_p=1.0),
    )
    assert sampled.token_ids != greedy.token_ids  # tiny's flat distributions: it wanders
    assert narrowed.token_ids == greedy.token_ids


def test_the_device_runners_path_samples_as_the_cpu_runner(parts, tiny_model_dir) -> None:
    """min-p staged with the step's metadata, min_tokens' mask in its
    adjustments: the same tokens as the CPU runner's."""
    model = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    move_model_to(model, torch.device("cpu"))
    device = DeviceRunner(
        model, 8, 16, BLOCK, device=torch.device("cpu"), max_num_seqs=4,
        max_num_batched_tokens=48, max_model_len=MAX_LEN, pin_memory=False,
    )  # fmt: skip
    [eos] = parts.info.eos_token_ids[:1]
    requests = [
        spec("min-p", 3, temperature=1.5, seed=3, min_p=0.9),
        spec("plain", 3, temperature=1.5, seed=3),
        spec("eos", 3, ignore_eos=False, min_tokens=2, logit_bias=((eos, 100.0),)),
    ]
    cpu = [(r.token_ids, r.finish.reason) for r in run(parts, *requests)]
    got = [(r.token_ids, r.finish.reason) for r in run(parts, *requests, runner=device)]
    assert got == cpu
    assert cpu[0] != cpu[1]  # min-p narrowed what the seed drew
    assert cpu[2] == ([*cpu[2][0][:2], eos], FinishReason.EOS) and eos not in cpu[2][0][:2]

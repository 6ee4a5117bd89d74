"""Penalties and logit bias under the engine, on ``tiny``: through
preemptions (recomputed or swapped), planning ahead (a decode's last token
pending) and the device runner's path (on the CPU, its pending tokens on
the "device"), each request gets the tokens it gets with room to spare,
seeded sampling included; and a greedy row the LM head would pick without
logits sees its bias."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from slipstream.scheduler.plan import PENDING_TOKEN, ScheduledSeq
from slipstream.scheduler.request import FinishReason, Request, SamplingParams
from slipstream.scheduler.scheduler import Scheduler
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.cuda_runner import DeviceRunner, move_model_to
from slipstream.service.engine.engine import Engine
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_engine, load_parts
from slipstream.service.engine.request_tokens import RequestTokens
from slipstream.service.models.llama import LlamaModel

BLOCK = 16
MAX_LEN = 256
SHORT = (6, 2, 5, 3, 7, 1, 4)  # prompt lengths
FAVOURED, FAVOURED_TOKEN = 5, 3  # ADJUSTED's request that biases a token no prompt holds
ADJUSTED = [
    SamplingParams(frequency_penalty=2.0),
    SamplingParams(presence_penalty=0.5, repetition_penalty=1.5),
    SamplingParams(logit_bias=((7, 5.0), (300, -100.0), (1200, 3.0))),
    SamplingParams(temperature=0.8, seed=11, frequency_penalty=1.0, logit_bias=((9, 4.0),)),
    SamplingParams(temperature=1.2, top_p=0.9, seed=5, repetition_penalty=0.7),
    # Its first token is the biased one; from the second on that token is
    # generated, the latest input alone at first (pending, planning ahead).
    SamplingParams(logit_bias=((FAVOURED_TOKEN, 100.0),), repetition_penalty=100.0),
    SamplingParams(),  # asks for nothing, beside those that do
]


def _requests(
    vocab: int, num_tokens: int, prompt_lens: tuple[int, ...] = (40, 5, 33, 20, 61, 9, 12),
    plain: bool = False,
) -> list[RequestSpec]:  # fmt: skip
    rng = random.Random(5)
    return [
        RequestSpec(
            req_id=f"q{i}",
            prompt_token_ids=[rng.randrange(FAVOURED_TOKEN + 1, vocab) for _ in range(n)],
            max_new_tokens=num_tokens + i,
            ignore_eos=True,
            sampling=_without_adjustments(sampling) if plain else sampling,
        )
        for i, (n, sampling) in enumerate(zip(prompt_lens, ADJUSTED, strict=True))
    ]


def _without_adjustments(sampling: SamplingParams) -> SamplingParams:
    return dataclasses.replace(sampling, presence_penalty=0.0, frequency_penalty=0.0,
                               repetition_penalty=1.0, logit_bias=())  # fmt: skip


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    return load_parts(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=BLOCK,
                     max_num_batched_tokens=48, max_model_len=MAX_LEN, policy="fcfs")
    )  # fmt: skip


def _tight(parts, num_host_blocks: int) -> Scheduler:
    """Too few blocks for the requests growing together: they must preempt."""
    config = parts.scheduler_config
    fields = {name: getattr(config, name) for name in config.__dataclass_fields__}
    fields.update(num_device_blocks=8, num_host_blocks=num_host_blocks, max_num_seqs=4)
    return Scheduler(type(config)(**fields))


def _run(parts, runner, scheduler, plan_ahead: bool, requests) -> dict[str, list[int]]:
    engine = Engine(scheduler, runner, parts.tokenizer, parts.info, plan_ahead=plan_ahead)
    try:
        results = engine.generate(requests)
    finally:
        engine.shutdown()
    assert all(r.finish.reason is FinishReason.MAX_TOKENS for r in results)
    return {r.req_id: r.token_ids for r in results}


@pytest.fixture(scope="module")
def expected(parts) -> dict[str, list[int]]:
    requests = _requests(parts.info.vocab_size, 20)
    roomy = _run(parts, parts.runner, parts.scheduler(), False, requests)
    plain = _run(parts, parts.runner, parts.scheduler(), False,
                 _requests(parts.info.vocab_size, 20, plain=True))  # fmt: skip
    # Each adjustment changes its request's answer (the last asks for none).
    assert [roomy[f"q{i}"] != plain[f"q{i}"] for i in range(len(ADJUSTED))] == [True] * 6 + [False]
    _check_favoured(roomy)
    return roomy


def _check_favoured(tokens: dict[str, list[int]]) -> None:
    """The biased token first, then never again: its repetition penalty
    counted it from the step after, while it was only the latest input."""
    favoured = tokens[f"q{FAVOURED}"]
    assert favoured[0] == FAVOURED_TOKEN and FAVOURED_TOKEN not in favoured[1:]


@pytest.mark.parametrize(
    ("num_host_blocks", "plan_ahead"),
    [(0, False), (0, True), (16, True)],
    ids=["recompute", "recompute-ahead", "swap-ahead"],
)
def test_preempted_requests_are_adjusted_as_unpreempted(
    parts, expected, num_host_blocks, plan_ahead
):
    scheduler = _tight(parts, num_host_blocks)
    got = _run(parts, parts.runner, scheduler, plan_ahead, _requests(parts.info.vocab_size, 20))
    assert got == expected
    assert scheduler.num_swap_preemptions + scheduler.num_recompute_preemptions > 0


def test_the_device_runner_adjusts_as_the_cpu_runner(tiny_model_dir, parts):
    """Its sampled rows' last tokens are read on the device, where a pending
    one was put: planning ahead, the CPU runner's tokens."""
    model = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    move_model_to(model, torch.device("cpu"))
    runner = DeviceRunner(
        model, 8, 16, BLOCK, device=torch.device("cpu"), max_num_seqs=4,
        max_num_batched_tokens=48, max_model_len=MAX_LEN, pin_memory=False,
    )  # fmt: skip
    # Short prompts: the Triton interpreter's prefill is most of the time.
    requests = _requests(parts.info.vocab_size, 3, SHORT)
    cpu = _run(parts, parts.runner, parts.scheduler(), False, requests)
    got = _run(parts, runner, _tight(parts, 16), True, requests)
    assert got == cpu
    _check_favoured(got)


def test_a_rows_generated_tokens_are_its_settled_outputs_and_its_last_input():
    """Planned ahead, output k - 1 is not settled yet (the scheduler holds
    a pending token in its place): it is the row's last input, which the
    device may hold alone, so the host's share stops before it whether or
    not it has landed, and the arrays kept from step to step follow."""
    request = Request("r", [5, 6, 7], 10)
    tokens = RequestTokens({"r": request}.get)
    ask = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)

    def plan(output_index: int, view: RequestTokens = tokens):
        seq = ScheduledSeq("r", [0], 3 + output_index - 1, [0], True, output_index, ask)
        other = ScheduledSeq("o", [0], 3, [0], True, 0, SamplingParams())
        got = view.plan([other, seq], 32)
        assert got is not None and got.rows == [1] and got.seen[got.num_generated :].tolist() == [
            32 + 5, 32 + 6, 32 + 7,
        ]  # fmt: skip
        return got.seen[: got.num_generated].tolist(), got.last_slots

    request.output_token_ids = [9, 8, PENDING_TOKEN]  # output 2 in flight
    assert plan(3) == ([32 + 9, 32 + 8], [0])
    request.output_token_ids[2] = 9  # landed
    assert plan(3) == plan(3, RequestTokens({"r": request}.get)) == ([32 + 9, 32 + 8], [0])
    request.output_token_ids.append(PENDING_TOKEN)
    assert plan(4) == ([32 + 9, 32 + 8, 32 + 9], [0])
    assert plan(0) == ([], [])  # the first output: its last input is the prompt's


def test_a_greedy_row_the_lm_head_would_pick_sees_its_bias(tiny_model_dir):
    """bf16 panels pick greedy tokens without logits where every row is
    greedy (``picks_greedy``); a biased row must not take that path."""
    engine = load_engine(
        EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", calibrate_cost_model=False)
    )
    try:
        prompt = engine.tokenizer.encode("The capital of France is")
        plain = RequestSpec("plain", prompt, 3, ignore_eos=True)
        [first] = engine.generate([plain])[0].token_ids[:1]
        ban = SamplingParams(logit_bias=((first, -100.0),))
        biased = engine.generate([RequestSpec("biased", prompt, 3, ban, ignore_eos=True)])
    finally:
        engine.shutdown()
    assert biased[0].token_ids[0] != first

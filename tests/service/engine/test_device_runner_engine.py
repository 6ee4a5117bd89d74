"""The device runner under the real scheduler, on the CPU (Triton under its
interpreter): mixed prefill chunks and decodes, swaps through the host pool
and planning ahead give ``ModelRunner``'s greedy tokens on ``tiny``."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream.scheduler.request import FinishReason
from slipstream.scheduler.scheduler import Scheduler
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.cuda_runner import DeviceRunner, move_model_to
from slipstream.service.engine.engine import Engine
from slipstream.service.engine.events import RequestSpec
from slipstream.service.engine.loader import load_parts
from slipstream.service.models.llama import LlamaModel

BLOCK = 16
MAX_LEN = 256


def _requests(vocab: int) -> list[RequestSpec]:
    rng = random.Random(3)
    return [
        RequestSpec(
            req_id=f"q{i}",
            prompt_token_ids=[rng.randrange(4, vocab) for _ in range(n)],
            max_new_tokens=m,
            ignore_eos=True,
        )
        for i, (n, m) in enumerate([(70, 12), (5, 20), (40, 16), (1, 9), (33, 14)])
    ]


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    return load_parts(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=BLOCK,
                     max_num_batched_tokens=48, max_model_len=MAX_LEN, policy="fcfs")
    )  # fmt: skip


def _run(parts, runner, scheduler: Scheduler, plan_ahead: bool) -> dict[str, list[int]]:
    engine = Engine(scheduler, runner, parts.tokenizer, parts.info, plan_ahead=plan_ahead)
    requests = _requests(parts.info.vocab_size)
    try:
        results = engine.generate(requests)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert all(r.finish.reason is FinishReason.MAX_TOKENS for r in results)
    assert stats.device_blocks.used == 0 and stats.host_blocks.used == 0
    return {r.req_id: r.token_ids for r in results}


@pytest.mark.parametrize(
    ("plan_ahead", "prefill_graph_tokens"),
    [
        pytest.param(False, 0, id="behind"),
        pytest.param(True, 0, id="ahead"),
        # ~60 s: the interpreter runs the padded tokens' kernels too
        pytest.param(True, 16, id="ahead-whole-steps", marks=pytest.mark.slow),
    ],
)
def test_device_runner_engine_matches_model_runner_through_swaps(
    tiny_model_dir, parts, plan_ahead, prefill_graph_tokens
):
    """``prefill_graph_tokens`` 16: steps of up to 16 tokens (decodes, and
    a short prompt beside them, their tokens pending) run padded through
    what a GPU captures as one graph a step (eagerly here); longer ones
    eagerly, as a GPU runs them."""
    expected = _run(parts, parts.runner, parts.scheduler(), plan_ahead=False)
    model = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    move_model_to(model, torch.device("cpu"))
    num_device_blocks = 8  # the longest request needs 6: growing together, they must preempt
    runner = DeviceRunner(
        model, num_device_blocks, 16, BLOCK, device=torch.device("cpu"), max_num_seqs=4,
        max_num_batched_tokens=48, max_model_len=MAX_LEN, pin_memory=False,
        prefill_graph_tokens=prefill_graph_tokens,
    )  # fmt: skip
    config = parts.scheduler_config
    tight = Scheduler(
        type(config)(**{**_fields(config), "num_device_blocks": num_device_blocks,
                        "num_host_blocks": 16, "max_num_seqs": 4, "policy": "priority"}),
    )  # fmt: skip
    got = _run(parts, runner, tight, plan_ahead)
    assert got == expected
    assert tight.num_swap_preemptions + tight.num_recompute_preemptions > 0


def _fields(config: object) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}  # type: ignore[attr-defined]

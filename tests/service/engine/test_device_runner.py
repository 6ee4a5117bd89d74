"""The device runner's logic on the CPU: staged metadata, the staged Triton
attention (under the interpreter), the tensor sampler and the swapper give
``ModelRunner``'s tokens and block contents on the ``tiny`` model."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.block_copy import reference_copy_blocks
from slipstream.scheduler.plan import PENDING_TOKEN, ScheduledSeq, StepPlan
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine.cuda_runner import DeviceRunner, move_model_to
from slipstream.service.engine.layer_graphs import layer_graph_bytes, token_buckets
from slipstream.service.engine.runner import ModelRunner
from slipstream.service.engine.swap import BlockSwapper, allocate_host_pool
from slipstream.service.models.llama import LlamaModel

BLOCK = 16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    reference = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    staged = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    move_model_to(staged, CPU)
    return reference, staged


def _runner(model: LlamaModel, prefill_graph_tokens: int = 0) -> DeviceRunner:
    return DeviceRunner(
        model, 32, 8, BLOCK, device=CPU, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=128, use_cuda_graphs=True, pin_memory=False,
        prefill_graph_tokens=prefill_graph_tokens,
    )  # fmt: skip


SAMPLING = [
    SamplingParams(),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5),
    SamplingParams(temperature=1.2, seed=9),
]


def _generate(runner, prompts: list[list[int]], num_steps: int) -> list[list[int]]:
    """Prefills every prompt in one step, then decodes them together."""
    tokens = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    blocks = [[i * 4 + j for j in range(4)] for i in range(len(prompts))]
    computed = [0] * len(prompts)
    for step in range(num_steps):
        seqs = [
            ScheduledSeq(f"r{i}", tokens[i][computed[i] :], computed[i], blocks[i], True,
                         len(outputs[i]), SAMPLING[i % len(SAMPLING)])
            for i in range(len(prompts))
        ]  # fmt: skip
        result = runner.execute(StepPlan(step=step, seqs=seqs))
        for i in range(len(prompts)):
            computed[i] = len(tokens[i])
            token = result.sampled[f"r{i}"]
            tokens[i].append(token)
            outputs[i].append(token)
    return outputs


def test_same_tokens_as_model_runner(models):
    reference_model, staged_model = models
    prompts = [[3, 17, 29, 4, 8], [7] * 20, [11, 12]]
    expected = _generate(ModelRunner(reference_model, 32, 8, BLOCK), prompts, 4)
    runner = _runner(staged_model)
    assert not runner.graph_stats.enabled
    assert runner.graph_stats.disabled_reason == "not a CUDA device"
    assert runner.info()["device"]["type"] == "cpu"
    assert staged_model.triton_elementwise  # the stages between projections in Triton
    assert _generate(runner, prompts, 4) == expected
    eager_ops = DeviceRunner(
        staged_model, 32, 8, BLOCK, device=CPU, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=128, fused_elementwise=False, pin_memory=False,
    )  # fmt: skip
    assert not staged_model.triton_elementwise
    assert _generate(eager_ops, prompts, 4) == expected


def test_token_buckets():
    assert token_buckets(64) == [16, 32, 64]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    with pytest.raises(ValueError):
        token_buckets(0)


@pytest.mark.parametrize("whole_max_context", [1024, 0], ids=["whole-step", "pieces"])
def test_steps_through_layer_pieces_give_the_model_runners_tokens(
    models, monkeypatch, whole_max_context
):
    """Steps with a prefill (and, with no decode graphs here, decodes) run
    padded to a token bucket through what a GPU captures as graphs, eagerly
    here: the whole step with one varlen attention a layer, or (decodes
    past ``whole_max_context``) the per-layer pieces around the decode and
    prefill kernels. The same tokens, and the padding tokens write no KV
    (the blocks no sequence holds stay zero)."""
    reference_model, staged_model = models
    prompts = [[3, 17, 29, 4, 8], [7] * 20, [11, 12]]  # 27 tokens: bucket 32, decodes: 16
    expected = _generate(ModelRunner(reference_model, 32, 8, BLOCK), prompts, 4)
    runner = DeviceRunner(
        staged_model, 32, 8, BLOCK, device=CPU, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=128, prefill_graph_tokens=32, pin_memory=False,
    )  # fmt: skip
    graphs = runner._layer_graphs
    assert graphs is not None and graphs.sizes == [16, 32]
    assert runner.info()["layer_graphs"]["disabled_reason"] == "not captured"
    runner.whole_step_max_context = whole_max_context
    assert graphs.whole_max_context == whole_max_context
    calls = {"whole": 0, "pieces": 0}
    for name, kind in (("_whole_step", "whole"), ("_pieces", "pieces")):
        original = getattr(graphs, name)

        def counted(*args, _original=original, _kind=kind):
            calls[_kind] += 1
            return _original(*args)

        monkeypatch.setattr(graphs, name, counted)
    tails = []  # the eager tail: the pieces' only; a whole step holds its own
    sampled_logits = staged_model.sampled_logits
    monkeypatch.setattr(
        staged_model, "sampled_logits", lambda *a: tails.append(1) or sampled_logits(*a)
    )
    assert _generate(runner, prompts, 4) == expected
    # The prefill step (no decodes: whole either way), then three steps of 3 decodes.
    assert calls == ({"whole": 4, "pieces": 0} if whole_max_context else {"whole": 1, "pieces": 3})
    assert len(tails) == calls["pieces"]
    for k_cache, v_cache in runner.device_pool:
        assert not k_cache[12:].any() and not v_cache[12:].any()  # blocks 0-11 are the prompts'
    longer = [[5] * 25, [6] * 15]  # 40 tokens: above the largest bucket, eager
    assert _generate(runner, longer, 2) == _generate(
        ModelRunner(reference_model, 32, 8, BLOCK), longer, 2
    )


def test_layer_graph_memory_bound_covers_what_the_pieces_keep(models):
    """``layer_graph_bytes`` (set aside before the KV pool is sized) is
    twice the buffers (the whole steps' logits among them) and every
    bucket's held q outputs that a capture keeps (the other half: the
    allocator's segments around them on a GPU), and not much more."""
    _, staged = models
    runner = DeviceRunner(
        staged, 32, 8, BLOCK, device=CPU, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=128, prefill_graph_tokens=64, pin_memory=False,
    )  # fmt: skip
    graphs = runner._layer_graphs
    assert graphs is not None
    kept = graphs._x.nbytes + graphs._attn.nbytes + graphs._logits.nbytes
    assert graphs._logits.shape == (8, staged.config.vocab_size)  # max_num_seqs rows
    for size in graphs.sizes:
        runner._prepare_layer_graphs(size)
        for i in range(len(staged.layers) + 1):
            q = graphs._piece(i, size)
            kept += 0 if q is None else q.untyped_storage().nbytes()
    assert 2 * kept <= layer_graph_bytes(staged, 64, 8) < 4 * kept
    assert layer_graph_bytes(staged, 0, 8) == 0


@pytest.mark.parametrize("prefill_graph_tokens", [0, 32], ids=["eager", "layer-pieces"])
def test_launching_ahead_with_pending_tokens(models, prefill_graph_tokens):
    """Step N+1 launched before step N's ids are read, its decodes' tokens
    pending: taken on the device from step N's samples, the same tokens (also
    with the steps padded by tokens for the per-layer pieces)."""
    reference_model, staged_model = models
    prompts = [[3, 17, 29, 4, 8], [7] * 20, [11, 12]]
    expected = _generate(ModelRunner(reference_model, 32, 8, BLOCK), prompts, 4)
    runner = _runner(staged_model, prefill_graph_tokens)
    blocks = [[i * 4 + j for j in range(4)] for i in range(len(prompts))]
    positions = [len(p) for p in prompts]
    handles = []
    for step in range(4):
        seqs = [
            ScheduledSeq(f"r{i}", list(p) if step == 0 else [PENDING_TOKEN],
                         0 if step == 0 else positions[i] + step - 1, blocks[i], True, step,
                         SAMPLING[i % len(SAMPLING)])
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        handles.append(runner.launch(StepPlan(step=step, seqs=seqs)))
    got = [[h.result().sampled[f"r{i}"] for h in handles] for i in range(len(prompts))]
    assert got == expected


def test_step_without_sampling_and_empty_plan(models):
    runner = _runner(models[1])
    seq = ScheduledSeq("a", [1, 2, 3], 0, [0], False, 0, SamplingParams())
    assert runner.execute(StepPlan(step=0, seqs=[seq])).sampled == {}
    assert runner.execute(StepPlan(step=1)).num_tokens == 0


def test_compiling_the_attention_kernels_leaves_the_runner_as_it_was(models):
    """The start-up launches of the prefill kernel and of each decode split
    count (made on CUDA; here under the interpreter) write nothing a step
    reads: tokens stay the model runner's."""
    reference, staged = models
    runner = DeviceRunner(
        staged, 32, 8, BLOCK, device=CPU, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=1024, use_cuda_graphs=False, pin_memory=False,
    )  # fmt: skip
    runner._compile_attention_kernels()  # split counts 1, 2 and 4 at 1,024 tokens
    prompts = [[3, 17, 29, 4], [5, 6, 7, 8, 9, 10], [11]]
    expected = _generate(ModelRunner(reference, 32, 8, BLOCK), prompts, 4)
    assert _generate(runner, prompts, 4) == expected


def test_fused_elementwise_kernels_that_fail_leave_the_eager_ops(models, monkeypatch):
    """Made at start-up on a GPU: a kernel that does not compile or run there
    falls back to the eager torch ops, said in ``info()``."""
    from slipstream.kernels import triton_elementwise

    _, staged = models
    runner = _runner(staged)
    runner._probe_fused_elementwise()  # under the interpreter here: they run
    assert runner.info()["fused_elementwise"] and not runner.info()["fused_elementwise_error"]

    def broken(gate_up):
        raise RuntimeError("PTX compile failed\nmore detail")

    monkeypatch.setattr(triton_elementwise, "silu_and_mul", broken)
    runner._probe_fused_elementwise()
    assert not staged.triton_elementwise
    assert runner.info()["fused_elementwise_error"] == "RuntimeError: PTX compile failed"


def test_model_must_be_on_the_device(tiny_model_dir):
    model = LlamaModel(tiny_model_dir, torch.float32, attention_backend="torch")
    with pytest.raises(ValueError, match="triton"):
        _runner(model)


def _filled_pools(num_device: int, num_host: int):
    device_pool = allocate_host_pool(2, num_device, 4, 2, 8, torch.float32, False)
    host_pool = allocate_host_pool(2, num_host, 4, 2, 8, torch.float32, False)
    generator = torch.Generator().manual_seed(0)
    for layer in device_pool + host_pool:
        for cache in layer:
            cache.copy_(torch.randn(cache.shape, generator=generator))
    return device_pool, host_pool


def _clone(pool):
    return [tuple(c.clone() for c in layer) for layer in pool]


def test_swapper_matches_reference_copies():
    device_pool, host_pool = _filled_pools(6, 5)
    want_device, want_host = _clone(device_pool), _clone(host_pool)
    swapper = BlockSwapper(device_pool, host_pool, CPU)
    swapper.swap_out([(1, 3), (4, 0)])
    reference_copy_blocks(want_device, want_host, [(1, 3), (4, 0)])
    swapper.swap_in([(2, 1), (3, 5)])
    reference_copy_blocks(want_host, want_device, [(2, 1), (3, 5)])
    swapper.copy([(0, 2), (2, 0)])
    reference_copy_blocks(want_device, want_device, [(0, 2), (2, 0)])
    swapper.land()
    for got, want in ((device_pool, want_device), (host_pool, want_host)):
        for got_layer, want_layer in zip(got, want, strict=True):
            for g, w in zip(got_layer, want_layer, strict=True):
                assert torch.equal(g, w)

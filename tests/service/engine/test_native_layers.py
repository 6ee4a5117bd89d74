"""The fused forward's layer loop as one native call (``fused_ops.decoder_layers_``)
against the same loop run from Python: the same kernels in the same order,
so the logits are identical, bit for bit, whatever each projection runs on
(fp32 panels, oneDNN's packed weights, a plain linear, with or without a
bias) and whatever the cache holds (fp32, bf16, int8 rows)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from slipstream.kernels import cpu_attention, fused_ops, linear
from slipstream.kernels.cpu_features import detect
from slipstream.kernels.kv_layout import fill_normal_
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine.calibration import synthetic_plan
from slipstream.service.engine.runner import ModelRunner
from slipstream.service.models.llama import LlamaModel

BLOCK = 16
NUM_BLOCKS = 96
# Decodes at several contexts, then a step mixing prefill chunks (one from
# position 0, one after a cached prefix) with a decode.
PLANS = [[(40, 1), (7, 1), (63, 1)], [(0, 33), (50, 1), (20, 17)]]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    home = Path(os.environ["SLIPSTREAM_HOME"])
    for available in (fused_ops.is_available, cpu_attention.is_available, linear.panels_available):
        assert available(home), "a native kernel library did not build"


def _logits_both_ways(model: LlamaModel, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The step's logits with the native loop and with the Python loop, each
    from the same cache contents."""
    runner = ModelRunner(model, NUM_BLOCKS, 0, BLOCK)
    plan = synthetic_plan(shapes, BLOCK, NUM_BLOCKS)
    kept: list[torch.Tensor] = []
    logits = model._logits

    def keep(x: torch.Tensor) -> torch.Tensor:
        out = logits(x)
        kept.append(out.clone())
        return out

    model._logits = keep  # type: ignore[method-assign]
    model.lm_head.has_argmax = False  # the greedy steps' logits, not their tokens
    for native in (True, False):
        model.native_layers = native
        _fill_pool(runner)  # the same prefix contents for both
        runner.execute(plan)
    del model._logits
    return kept


def _fill_pool(runner: ModelRunner) -> None:
    """The same random K/V in every layer's cache, each time it is called."""
    generator = torch.Generator()
    for k_cache, v_cache in runner.device_pool:
        generator.manual_seed(1)
        fill_normal_(k_cache, generator)
        fill_normal_(v_cache, generator)


def _model(tiny_model_dir: Path, dtype: torch.dtype, **options: bool) -> LlamaModel:
    return LlamaModel(tiny_model_dir, dtype, "cpu", fused=True, **options)


def _bf16_panels_model(tiny_model_dir: Path) -> LlamaModel:
    """A bf16 model with its projections on panels (oneDNN packing where the
    CPU allows); skips where the CPU runs no bf16 panels."""
    if not linear.bf16_panels_available():
        pytest.skip("bf16 panels need AVX512-BF16 (this CPU, as reported, has none)")
    return _model(
        tiny_model_dir, torch.bfloat16, panel_linears=True, pack_weights=detect().can_pack_bf16
    )


@pytest.mark.parametrize("shapes", PLANS, ids=["decodes", "mixed"])
@pytest.mark.parametrize(
    ("dtype", "options"),
    [
        (torch.float32, {"panel_linears": True}),
        (torch.float32, {"pack_weights": True}),
        (torch.float32, {}),
        (torch.bfloat16, {}),
        # AVX512-BF16: panels for calls of up to 4 rows (decodes), oneDNN above.
        (torch.bfloat16, {"panel_linears": True, "pack_weights": True}),
    ],
    ids=["fp32-panels", "fp32-packed", "fp32-plain", "bf16-plain", "bf16-panels-packed"],
)
def test_native_loop_gives_the_python_loops_logits(tiny_model_dir, shapes, dtype, options) -> None:
    name = "fp32" if dtype == torch.float32 else "bf16"
    if options.get("pack_weights") and not getattr(detect(), f"can_pack_{name}"):
        pytest.skip(f"oneDNN cannot pack {name} weights on this CPU (as reported)")
    model = _model(tiny_model_dir, dtype, **options)
    assert model.native_layers  # the default where every op is a CPU kernel
    native, python = _logits_both_ways(model, shapes)
    assert torch.equal(native, python)


def test_a_bf16_model_on_panels_samples_float32_logits(tiny_model_dir) -> None:
    """Its LM head writes the float32 sums of the final normed rows, unrounded
    (rounded to bf16, logits 1/8 apart near 20 tie, and greedy decoding breaks
    the tie by token id); without panels oneDNN's bf16 logits are re-scored
    near each row's maximum, and both argmaxes are the float64 sums'."""
    model = _bf16_panels_model(tiny_model_dir)
    rows = torch.randn(300, model.config.hidden_size).bfloat16()  # past a projection's cut
    logits = model._logits(rows)
    assert logits.dtype == torch.float32 and logits.shape == (300, model.config.vocab_size)
    plain = _model(tiny_model_dir, torch.bfloat16)
    want = rows.double() @ plain.lm_head.weight.double().T
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-4)
    assert not torch.equal(logits, logits.bfloat16().float())  # not bf16 values
    # without panels: oneDNN's bf16 sums widened, each row's near-maximum re-scored
    widened = plain._logits(rows)
    assert widened.dtype == torch.float32
    assert torch.equal(widened.argmax(dim=-1), want.argmax(dim=-1))
    assert torch.equal(logits.argmax(dim=-1), want.argmax(dim=-1))


@pytest.mark.parametrize("shapes", PLANS, ids=["decodes", "mixed"])
def test_a_bf16_greedy_step_takes_its_tokens_from_the_lm_head(tiny_model_dir, shapes) -> None:
    """Without logits: the tokens the float32 logits' argmax picks."""
    model = _bf16_panels_model(tiny_model_dir)
    assert model.picks_greedy
    runner = ModelRunner(model, NUM_BLOCKS, 0, BLOCK)
    plan = synthetic_plan(shapes, BLOCK, NUM_BLOCKS)
    sampled = []
    for picks in (True, False):
        model.lm_head.has_argmax = picks
        _fill_pool(runner)
        sampled.append(runner.execute(plan).sampled)
    assert sampled[0] == sampled[1] and len(sampled[0]) == len(shapes)


def test_a_greedy_row_asking_for_logprobs_gets_them_and_the_same_token(tiny_model_dir) -> None:
    """One row asking for log-probabilities takes the step off the LM head's
    argmax onto logits: the same tokens, each the most likely of its row."""
    model = _bf16_panels_model(tiny_model_dir)
    runner = ModelRunner(model, NUM_BLOCKS, 0, BLOCK)
    plan = synthetic_plan(PLANS[1], BLOCK, NUM_BLOCKS)
    _fill_pool(runner)
    plain = runner.execute(plan)
    asking = plan.seqs[1]._replace(sampling=SamplingParams(logprobs=2))
    _fill_pool(runner)
    result = runner.execute(dataclasses.replace(plan, seqs=[plan.seqs[0], asking, plan.seqs[2]]))
    assert result.sampled == plain.sampled and set(result.logprobs) == {asking.req_id}
    got = result.logprobs[asking.req_id]
    assert got.top_token_ids[0] == result.sampled[asking.req_id]
    assert got.logprob == got.top_logprobs[0] < 0


def test_a_bias_and_an_int8_cache_take_the_same_path(tiny_model_dir) -> None:
    model = LlamaModel(tiny_model_dir, torch.float32, "cpu", fused=True, panel_linears=True,
                       kv_dtype=torch.int8)  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    for layer in model.layers:
        layer.qkv.bias = torch.randn(layer.qkv.out_features, generator=generator)
    native, python = _logits_both_ways(model, PLANS[1])
    assert torch.equal(native, python)
    # The bias is applied: without it the logits differ.
    for layer in model.layers:
        layer.qkv.bias = None
    model._native_weights = None
    assert not torch.equal(_logits_both_ways(model, PLANS[1])[0], native)


def test_the_native_loop_is_off_where_an_op_is_not_a_cpu_kernel(tiny_model_dir) -> None:
    assert not LlamaModel(tiny_model_dir, torch.float32, "torch", fused=True).native_layers
    assert not LlamaModel(tiny_model_dir, torch.float32, "cpu", fused=False).native_layers


def test_a_bad_step_is_the_same_value_error(tiny_model_dir) -> None:
    """The per-step check raises what the per-layer attention wrapper raises."""
    model = _model(tiny_model_dir, torch.float32, panel_linears=True)
    runner = ModelRunner(model, NUM_BLOCKS, 0, BLOCK)
    plan = synthetic_plan(PLANS[0], BLOCK, NUM_BLOCKS)
    model.native_layers = True
    meta_block_size = runner.block_size
    try:
        runner.block_size = BLOCK * 2  # metadata built for another block size
        with pytest.raises(ValueError, match="block size"):
            runner.execute(plan)
    finally:
        runner.block_size = meta_block_size

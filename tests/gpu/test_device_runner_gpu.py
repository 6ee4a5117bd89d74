"""The device runner on a CUDA GPU: graphs on = off, swaps bit-exact, the
staged Triton attention against the reference.

These run the Triton kernels compiled, never under the interpreter that
tests/conftest.py turns on for the CPU (``TRITON_INTERPRET=1``, read when
triton is first imported): run them as ``TRITON_INTERPRET=0 pytest -m gpu
tests/gpu``. Where torch sees no CUDA device, or the interpreter is on, they
are skipped.
"""

from __future__ import annotations

import pytest
import torch
from gpu_marks import GPU_ONLY

from slipstream.kernels.attention import reference_paged_attention
from slipstream.kernels.kv_layout import allocate_kv_cache
from slipstream.scheduler.plan import ScheduledSeq, StepPlan
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine.cuda_runner import DeviceRunner, move_model_to
from slipstream.service.engine.staged_attention import staged_metadata, staged_paged_attention
from slipstream.service.engine.staging import StagingBuffers, StagingLayout, stage_step
from slipstream.service.models.llama import LlamaModel

pytestmark = GPU_ONLY

BLOCK = 16
CUDA = torch.device("cuda", 0)


def _runner(
    model_dir, use_cuda_graphs: bool, dtype=torch.float32, prefill_graph_tokens: int = 0
) -> DeviceRunner:
    model = LlamaModel(model_dir, dtype, attention_backend="triton")
    move_model_to(model, CUDA)
    return DeviceRunner(
        model, 256, 64, BLOCK, device=CUDA, max_num_seqs=16, max_num_batched_tokens=512,
        max_model_len=512, use_cuda_graphs=use_cuda_graphs,
        prefill_graph_tokens=prefill_graph_tokens,
    )  # fmt: skip


def _greedy(
    runner: DeviceRunner, prompts: list[list[int]], num_steps: int, drop_rows: bool = True
) -> list[list[int]]:
    """Greedy tokens over ``num_steps`` steps; with ``drop_rows`` the last
    one or two rows sit out every second and third step and rejoin."""
    tokens = [list(p) for p in prompts]
    blocks = [[i * 16 + j for j in range(16)] for i in range(len(prompts))]
    computed = [0] * len(prompts)
    for step in range(num_steps):
        dropped = step % 3 if drop_rows and step else 0
        live = range(len(prompts) - dropped)
        seqs = [
            ScheduledSeq(f"r{i}", tokens[i][computed[i] :], computed[i], blocks[i], True,
                         len(tokens[i]) - len(prompts[i]), SamplingParams())
            for i in live
        ]  # fmt: skip
        result = runner.execute(StepPlan(step=step, seqs=seqs))
        for i in live:
            computed[i] = len(tokens[i])
            tokens[i].append(result.sampled[f"r{i}"])
    return [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)]


def test_greedy_tokens_with_and_without_graphs(tiny_model_dir):
    prompts = [[3 + i, 17, 29 + i, 4] * (1 + i) for i in range(11)]
    graphed = _runner(tiny_model_dir, use_cuda_graphs=True)
    assert graphed.info()["fused_elementwise"], graphed.fused_elementwise_error
    stats = graphed.graph_stats
    assert stats.enabled, stats.disabled_reason
    assert stats.batch_sizes == [1, 2, 4, 8, 16] and stats.capture_seconds > 0
    with_graphs = _greedy(graphed, prompts, 12)
    eager = _greedy(_runner(tiny_model_dir, use_cuda_graphs=False), prompts, 12)
    assert with_graphs == eager


def test_greedy_tokens_with_layer_graphs_equal_eager(tiny_model_dir):
    """Steps with a prefill replaying a graph per layer around eager attention
    give the eager steps' tokens: prompts of 4-44 tokens, first together
    (bucket 256), then decodes (decode graphs) as rows drop out and rejoin."""
    prompts = [[3 + i, 17, 29 + i, 4] * (1 + i) for i in range(11)]
    pieces = _runner(tiny_model_dir, use_cuda_graphs=True, prefill_graph_tokens=256)
    stats = pieces.info()["layer_graphs"]
    assert stats["enabled"], stats["disabled_reason"]
    assert stats["batch_sizes"] == [16, 32, 64, 128, 256]
    eager = _greedy(_runner(tiny_model_dir, use_cuda_graphs=False), prompts, 12)
    assert _greedy(pieces, prompts, 12) == eager
    # one prompt at a time: steps of 8-44 tokens, each at its own bucket
    for prompt in prompts[1::3]:
        assert _greedy(pieces, [prompt], 4, drop_rows=False) == [eager[prompts.index(prompt)][:4]]


def test_a_bf16_models_logits_are_float32_sums_with_and_without_graphs(tiny_model_dir):
    """The LM head of a bf16 model writes float32 on the GPU (cuBLAS's mm
    with ``out_dtype``): within float32 rounding of the float64 sums, not
    rounded to bf16 (where two tokens 1/8 apart near 20 tie); graphed
    steps, which replay that call, give the eager steps' greedy tokens."""
    runner = _runner(tiny_model_dir, use_cuda_graphs=True, dtype=torch.bfloat16)
    head = runner.model.lm_head
    assert head.float_mm
    model, ops = runner.model, runner.model.fused_elementwise_ops()
    h = torch.randn(64, head.weight.shape[1], device=CUDA).bfloat16()
    logits = model.sampled_logits(h, torch.arange(64, device=CUDA), ops)
    assert logits.dtype == torch.float32
    normed = ops.rms_norm(h.clone(), model.norm, model.config.rms_norm_eps)
    want = normed.double() @ head.weight.double().t()
    torch.testing.assert_close(logits.double(), want, rtol=1e-4, atol=1e-3)
    assert not torch.equal(logits, logits.bfloat16().float())
    prompts = [[3 + i, 17, 29 + i, 4] * (1 + i) for i in range(11)]
    eager = _runner(tiny_model_dir, use_cuda_graphs=False, dtype=torch.bfloat16)
    assert _greedy(runner, prompts, 12) == _greedy(eager, prompts, 12)


def test_swap_out_and_in_is_bit_exact(tiny_model_dir):
    runner = _runner(tiny_model_dir, use_cuda_graphs=False, dtype=torch.bfloat16)
    seq = ScheduledSeq("a", list(range(5, 45)), 0, [3, 7, 9], True, 0, SamplingParams())
    runner.execute(StepPlan(step=0, seqs=[seq]))
    before = [tuple(c[[3, 7, 9]].clone() for c in layer) for layer in runner.device_pool]
    runner.execute(StepPlan(step=1, swap_out=[(3, 10), (7, 0), (9, 5)]))
    runner.execute(StepPlan(step=2, swap_in=[(10, 20), (0, 21), (5, 22)]))
    torch.cuda.synchronize()
    runner.land_swaps()
    for layer, host_layer, want in zip(runner.device_pool, runner.host_pool, before, strict=True):
        for cache, host, blocks in zip(layer, host_layer, want, strict=True):
            assert torch.equal(cache[[20, 21, 22]], blocks)
            assert torch.equal(host[[10, 0, 5]], blocks.cpu())
    assert runner.host_pool[0][0].is_pinned()


def test_staged_triton_attention_matches_reference():
    generator = torch.Generator().manual_seed(0)
    num_blocks, kv_heads, heads, head_dim = 40, 2, 6, 64
    k_cache = allocate_kv_cache(num_blocks, BLOCK, kv_heads, head_dim, torch.float32, CUDA)
    v_cache = allocate_kv_cache(num_blocks, BLOCK, kv_heads, head_dim, torch.float32, CUDA)
    k_cache.copy_(torch.randn(k_cache.shape, generator=generator))
    v_cache.copy_(torch.randn(v_cache.shape, generator=generator))
    plan = StepPlan(
        step=0,
        seqs=[
            ScheduledSeq("d", [1], 70, [5, 6, 7, 8, 9], True, 0, SamplingParams()),
            ScheduledSeq("p", [1] * 20, 30, [1, 2, 3, 4], True, 0, SamplingParams()),
            ScheduledSeq("f", [1] * 33, 0, [10, 11, 12], True, 0, SamplingParams()),
        ],
    )
    buffers = StagingBuffers(StagingLayout.build(128, 8, 8), CUDA, pin_memory=True)
    step = stage_step(plan, buffers, BLOCK, vocab_size=10)
    buffers.upload(step.num_rows)
    meta = staged_metadata(step, buffers.device_views, BLOCK)
    q = torch.randn(step.num_tokens, heads, head_dim, generator=generator).to(CUDA)
    got = staged_paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    want = reference_paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(),
                                     _cpu_meta(meta), head_dim**-0.5)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_varlen_attention_on_staged_views_matches_reference(dtype, tolerance):
    """The whole-step attention compiled: decodes and chunks of one step in
    one launch over the staging views, with a graph's bound of programs
    (a 128-token, 8-row step) and group 3 (blocks of 5 tokens)."""
    from slipstream.kernels.triton_paged_varlen import paged_varlen, varlen_programs

    generator = torch.Generator().manual_seed(1)
    num_blocks, kv_heads, heads, head_dim = 40, 2, 6, 64
    caches = [allocate_kv_cache(num_blocks, BLOCK, kv_heads, head_dim, dtype, CUDA)
              for _ in range(2)]  # fmt: skip
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    plan = StepPlan(
        step=0,
        seqs=[
            ScheduledSeq("d", [1], 70, [5, 6, 7, 8, 9], True, 0, SamplingParams()),
            ScheduledSeq("p", [1] * 20, 30, [1, 2, 3, 4], True, 0, SamplingParams()),
            ScheduledSeq("e", [1], 3, [13], True, 0, SamplingParams()),
            ScheduledSeq("f", [1] * 33, 0, [10, 11, 12], True, 0, SamplingParams()),
        ],
    )
    buffers = StagingBuffers(StagingLayout.build(128, 8, 8), CUDA, pin_memory=True)
    step = stage_step(plan, buffers, BLOCK, vocab_size=10, pad_tokens_to=128)
    buffers.upload(step.num_rows)
    views = buffers.device_views
    q = torch.randn(128, heads, head_dim, generator=generator).to(dtype).to(CUDA)
    out = torch.full_like(q, float("nan"))
    paged_varlen(
        q, *caches, views["block_tables"], views["seq_lens_i32"], views["query_start_loc"],
        views["num_rows"], varlen_programs(128, 8, heads // kv_heads), head_dim**-0.5, out,
    )  # fmt: skip
    meta = staged_metadata(step, views, BLOCK)
    n = step.num_tokens
    k_cache, v_cache = (cache.float().cpu() for cache in caches)
    want = reference_paged_attention(q[:n].float().cpu(), k_cache, v_cache, _cpu_meta(meta),
                                     head_dim**-0.5)  # fmt: skip
    torch.testing.assert_close(out[:n].float().cpu(), want, atol=tolerance, rtol=tolerance)
    assert out[n:].isnan().all()  # padding tokens own no row


def test_mixed_steps_whole_step_graphs_equal_pieces_and_eager(tiny_model_dir):
    """Steps holding decodes and a new prompt's prefill: through the
    whole-step graphs (one varlen attention a layer), through the per-layer
    pieces (decode contexts past the cap) and eagerly, the same greedy
    tokens (fp32)."""
    prompts = [[3 + i, 17, 29 + i, 4] * (1 + i) for i in range(8)]

    def staggered(runner: DeviceRunner) -> list[list[int]]:
        """Prompt s joins at step s while the earlier ones decode."""
        tokens = [list(p) for p in prompts]
        computed = [0] * len(prompts)
        for step in range(len(prompts) + 3):
            live = range(min(step + 1, len(prompts)))
            seqs = [
                ScheduledSeq(f"r{i}", tokens[i][computed[i] :], computed[i],
                             [i * 16 + j for j in range(16)], True,
                             len(tokens[i]) - len(prompts[i]), SamplingParams())
                for i in live
            ]  # fmt: skip
            result = runner.execute(StepPlan(step=step, seqs=seqs))
            for i in live:
                computed[i] = len(tokens[i])
                tokens[i].append(result.sampled[f"r{i}"])
        return [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)]

    eager = staggered(_runner(tiny_model_dir, use_cuda_graphs=False))
    whole = _runner(tiny_model_dir, use_cuda_graphs=True, prefill_graph_tokens=256)
    assert whole.info()["layer_graphs"]["enabled"]
    assert staggered(whole) == eager
    pieces = _runner(tiny_model_dir, use_cuda_graphs=True, prefill_graph_tokens=256)
    pieces.whole_step_max_context = 0
    assert pieces.whole_step_max_context == 0
    assert staggered(pieces) == eager


def _cpu_meta(meta):
    from slipstream.kernels.attention import build_attention_metadata

    tables = meta.block_tables.cpu().tolist()
    return build_attention_metadata(meta.query_lens, meta.seq_lens, tables, meta.block_size,
                                    torch.device("cpu"), torch.float32)  # fmt: skip


def test_a_step_waits_on_its_sampled_ids_only(tiny_model_dir, monkeypatch):
    """Once warm, a step synchronises once: its ``result()`` waits on the
    event behind its sampled ids. Under torch's sync debug mode "error" any
    implicit synchronisation in a step (``.item()``, a copy from pageable
    memory, ``nonzero``) raises; the explicit waits are counted. The steps
    cover each path: eager (past the largest prefill bucket), the decode
    graphs, the whole-step graphs, the per-layer pieces, a swap out and in
    (which lands the swap-out first: one more wait, by design)."""
    runner = _runner(tiny_model_dir, use_cuda_graphs=True, prefill_graph_tokens=64)
    prompts = [[3 + i, 17, 29 + i, 4] * (1 + i) for i in range(11)]

    def every_path() -> None:
        runner.whole_step_max_context = 1024
        _greedy(runner, prompts, 5)  # 264 prompt tokens: eager, then decode graphs
        for prompt in prompts[::4]:  # one prompt a step: whole-step graph, decode graph
            _greedy(runner, [prompt], 2, drop_rows=False)
        runner.whole_step_max_context = 0  # the same through the pieces
        for prompt in prompts[1::4]:
            _greedy(runner, [prompt], 2, drop_rows=False)
        runner.execute(StepPlan(step=0, swap_out=[(3, 10), (7, 0)]))
        runner.execute(StepPlan(step=1, swap_in=[(10, 40), (0, 41)]))

    every_path()  # warm: first uses may allocate, compile, initialise
    torch.cuda.synchronize()
    waits: list[str] = []
    event_wait, device_wait = torch.cuda.Event.synchronize, torch.cuda.synchronize

    def counted_event_wait(event: torch.cuda.Event) -> None:
        waits.append("event")
        event_wait(event)

    def counted_device_wait(*args, **kwargs) -> None:
        waits.append("device")
        device_wait(*args, **kwargs)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted_event_wait)
    monkeypatch.setattr(torch.cuda, "synchronize", counted_device_wait)
    steps: list[StepPlan] = []
    execute = runner.execute

    def counted_execute(plan: StepPlan):
        steps.append(plan)
        return execute(plan)

    monkeypatch.setattr(runner, "execute", counted_execute)
    torch.cuda.set_sync_debug_mode("error")
    try:
        every_path()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # one wait a step with sequences, and the swap-in's for the swap-out it lands
    assert waits == ["event"] * (sum(1 for plan in steps if plan.seqs) + 1)


@pytest.mark.parametrize("vocab", [257, 49_152], ids=["unchunked", "smollm2-vocabulary"])
def test_seeded_rows_on_the_gpu_pick_the_cpu_samplers_tokens(vocab):
    """The same logits and seeds: the device sampler on CUDA picks what the
    CPU sampler picks, but where a draw falls within rounding of a boundary
    between two tokens (the GPU's exp and sums round differently): at most
    two rows of 256 apart."""
    from slipstream.kernels.device_sampling import plan_sampling, sample_tensors, sampling_batch
    from slipstream.kernels.sampling import sample

    rows = 256
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 3
    temps = [0.5 + (i % 7) / 5 for i in range(rows)]
    ks = [(0, 20, 300)[i % 3] for i in range(rows)]
    ps = [(1.0, 0.9, 0.5, 0.95)[i % 4] for i in range(rows)]
    seeds = list(range(rows))
    indices = [i % 11 for i in range(rows)]
    expected = sample(logits, temps, ks, ps, seeds, indices)
    plan = plan_sampling(temps, ks, ps, seeds, indices, vocab)
    got = sample_tensors(logits.to(CUDA), sampling_batch(plan, CUDA)).tolist()
    assert sum(a != b for a, b in zip(got, expected, strict=True)) <= 2


def test_logprobs_on_the_gpu_match_the_cpu_runners_and_wait_on_nothing_more(
    tiny_model_dir, monkeypatch
):
    """Rows asking for log-probabilities beside rows that do not: the CPU
    runner's tokens and log-probabilities, and still one wait a step (the
    row indices go up pinned, the picks come down behind the sampled ids)."""
    from slipstream.service.engine.runner import ModelRunner

    asking = [SamplingParams(logprobs=5), SamplingParams(), SamplingParams(logprobs=0)]
    prompt = [3, 17, 29, 4, 8]

    def steps(runner, num_steps: int):
        tokens = [list(prompt) for _ in asking]
        computed = [0] * len(asking)
        seen = []
        for step in range(num_steps):
            seqs = [
                ScheduledSeq(f"r{i}", tokens[i][computed[i]:], computed[i],
                             [i * 16 + j for j in range(16)], True, step, params)
                for i, params in enumerate(asking)
            ]  # fmt: skip
            result = runner.execute(StepPlan(step=step, seqs=seqs))
            for i in range(len(asking)):
                computed[i] = len(tokens[i])
                tokens[i].append(result.sampled[f"r{i}"])
            seen.append(result)
        return seen

    cpu_model = LlamaModel(tiny_model_dir, torch.float32, attention_backend="triton")
    cpu = steps(ModelRunner(cpu_model, 256, 64, BLOCK), 4)
    runner = _runner(tiny_model_dir, use_cuda_graphs=True)
    gpu = steps(runner, 4)  # eager prefill, then the decode graphs
    for want, got in zip(cpu, gpu, strict=True):
        assert got.sampled == want.sampled and set(got.logprobs) == {"r0", "r2"}
        for req_id in ("r0", "r2"):
            assert got.logprobs[req_id].logprob == pytest.approx(
                want.logprobs[req_id].logprob, abs=1e-3
            )
            assert got.logprobs[req_id].top_token_ids == want.logprobs[req_id].top_token_ids
    torch.cuda.synchronize()
    waits: list[str] = []
    event_wait = torch.cuda.Event.synchronize

    def counted_event_wait(event: torch.cuda.Event) -> None:
        waits.append("event")
        event_wait(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted_event_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps(runner, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert waits == ["event"] * 3

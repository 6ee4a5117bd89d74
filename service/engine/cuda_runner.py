"""The device runner: ``ModelRunner``'s contract (``execute(plan) -> StepResult``,
``device_pool``, ``host_pool``) for a model whose weights and device KV pool
live on a CUDA GPU, with the host off the critical path.

One step, in stream order (the compute stream unless said)::

    swaps            copy stream, events (swap.py)
    staging upload   one non-blocking copy of the step's metadata (staging.py)
    forward          decode-only: replay of the padded batch's CUDA graph;
                     with a prefill, up to prefill_graph_tokens tokens: one
                     graph of the whole step (decodes' contexts up to 4096),
                     or a graph per layer around eager attention (layer_graphs.py);
                     else eager, through the Triton kernels
    sampling         on the device (kernels/device_sampling.py), eager;
                     where a request asks, its penalties and logit bias
                     first (kernels/logit_adjustments.py, two small uploads)
                     and its log-probabilities around it, queued to the
                     host behind the ids (token_logprobs.py)
    sampled ids      one device-to-host copy; ``launch`` returns here, and
                     the step's only wait is its handle's ``result()``

The same code runs on the CPU (``device=cpu``, no pinning, no graphs, the
Triton kernels under their interpreter), which is how its logic is tested
against ``ModelRunner``. The CUDA-only parts (streams, events, pinned memory,
graph capture) are tested by ``tests/gpu`` on a GPU (``make test-gpu``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from slipstream.kernels.device_sampling import SamplingBatch, sample_tensors
from slipstream.kernels.kv_layout import allocate_kv_cache
from slipstream.kernels.linear import Linear
from slipstream.kernels.logit_adjustments import LogitAdjustments, adjustment_tensors
from slipstream.kernels.triton_paged_decode import paged_decode, possible_num_splits
from slipstream.kernels.triton_paged_prefill import paged_prefill
from slipstream.scheduler.plan import ScheduledSeq, StepPlan
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine.cuda_graphs import (
    DecodeGraphs,
    GraphStats,
    bucket_for,
    graph_batch_sizes,
    is_out_of_memory,
)
from slipstream.service.engine.device import describe_device
from slipstream.service.engine.events import PoolStats, StepOutOfMemory
from slipstream.service.engine.grammar import Matcher, mask_logits
from slipstream.service.engine.layer_graphs import LayerGraphs
from slipstream.service.engine.request_tokens import RequestLookup, RequestTokens
from slipstream.service.engine.runner import DoneStep, KVPool, StepResult
from slipstream.service.engine.staged_attention import staged_metadata, staged_paged_attention
from slipstream.service.engine.staging import (
    StagedStep,
    StagingBuffers,
    StagingLayout,
    is_decode_only,
    resolve_pending_tokens,
    stage_padding,
    stage_step,
)
from slipstream.service.engine.swap import BlockSwapper, allocate_host_pool
from slipstream.service.engine.token_logprobs import LogprobRows, PickedLogprobs
from slipstream.service.models.llama import LlamaModel

log = logging.getLogger(__name__)


def move_model_to(model: LlamaModel, device: torch.device) -> None:
    """Moves ``model``'s weights and RoPE tables to ``device`` in place (a tied
    LM head stays tied). The model must hold plain weights: no oneDNN packing,
    no panel layout, no fused CPU ops."""
    if model.fused or model.pack_weights or model.panel_linears:
        raise ValueError("a device model needs plain weights: build it with pack_weights=False, "
                         "panel_linears=False, fused=False")  # fmt: skip

    def linear(layer: Linear, float_out: bool = False) -> Linear:
        bias = None if layer.bias is None else layer.bias.to(device)
        return Linear(layer.weight.to(device), bias, float_out=float_out)

    old_embed = model.embed
    model.embed = old_embed.to(device)
    model.layers = [
        dataclasses.replace(
            layer,
            input_norm=layer.input_norm.to(device),
            qkv=linear(layer.qkv),
            o_proj=linear(layer.o_proj),
            post_norm=layer.post_norm.to(device),
            gate_up=linear(layer.gate_up),
            down=linear(layer.down),
        )
        for layer in model.layers
    ]
    model.norm = model.norm.to(device)
    tied = model.lm_head.weight is old_embed
    # float32 logits from 16-bit weights where cuBLAS writes them (LlamaModel._logits)
    lm_head = model.lm_head
    model.lm_head = Linear(model.embed, float_out=True) if tied else linear(lm_head, True)
    model.rope_cos = model.rope_cos.to(device)
    model.rope_signed_sin = model.rope_signed_sin.to(device)


class LaunchedStep:
    """A step queued on the device; ``result()`` waits for its sampled ids
    (the step's one synchronisation) and reads them, once."""

    def __init__(
        self,
        done: torch.cuda.Event | None,
        sampled: torch.Tensor | None,
        req_ids: list[str],
        num_tokens: int,
        logprobs: PickedLogprobs | None = None,
    ) -> None:
        self._done = done
        self._sampled = sampled
        self._req_ids = req_ids
        self._num_tokens = num_tokens
        self._logprobs = logprobs
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        if self._result is None:
            if self._done is not None:
                self._done.synchronize()
            ids = [] if self._sampled is None else self._sampled.tolist()
            self._result = StepResult(
                dict(zip(self._req_ids, ids, strict=True)),
                self._num_tokens,
                {} if self._logprobs is None else self._logprobs.read(),
            )
        return self._result


class DeviceRunner:
    """Executes ``StepPlan``s on ``device`` for a model already there (``move_model_to``)
    and built with ``attention_backend="triton"``.

    ``max_num_seqs`` / ``max_num_batched_tokens`` / ``max_model_len`` bound a
    step as the scheduler does; they size the staging buffers. ``pin_memory``
    (default: on CUDA) pins the host pool and staging. ``use_cuda_graphs``
    captures decode graphs at construction (CUDA only; ``graph_stats`` says
    what was captured, or why not). ``fused_elementwise`` runs the stages
    between projections as one Triton kernel each (else eager torch ops).
    ``prefill_graph_tokens`` > 0: steps that are not a captured decode, of
    up to that many tokens, run padded through ``LayerGraphs`` (captured
    with the decode graphs on CUDA; eager pieces elsewhere, for tests).
    ``seed`` seeds the device generator of unseeded sampling rows.
    """

    def __init__(
        self,
        model: LlamaModel,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        *,
        device: torch.device,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        use_cuda_graphs: bool = True,
        fused_elementwise: bool = True,
        prefill_graph_tokens: int = 0,
        pin_memory: bool | None = None,
        seed: int = 0,
    ) -> None:
        if model.embed.device != device:
            raise ValueError(f"the model is on {model.embed.device}, not {device}: move_model_to")
        if model.attention_backend != "triton":
            raise ValueError("a device runner needs a model built with attention_backend='triton'")
        self.model = model
        self.device = device
        self.block_size = block_size
        self._is_cuda = device.type == "cuda"
        pin = self._is_cuda if pin_memory is None else pin_memory
        cfg = model.config
        self.device_pool: KVPool = [
            tuple(  # type: ignore[misc]
                allocate_kv_cache(num_device_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                  model.dtype, device)
                for _ in range(2)
            )
            for _ in range(cfg.num_layers)
        ]  # fmt: skip
        self.host_pool: KVPool = allocate_host_pool(
            cfg.num_layers, num_host_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            model.dtype, pin,
        )  # fmt: skip
        self._swapper = BlockSwapper(self.device_pool, self.host_pool, device)
        max_blocks = -(-max_model_len // block_size)
        layout = StagingLayout.build(max_num_batched_tokens, max_num_seqs, max_blocks)
        self._staging = StagingBuffers(layout, device, pin)
        self._max_context = max_blocks * block_size
        # Two, used in turn: a step's ids land in one while the host may still
        # read the previous step's out of the other.
        self._sampled_host = [
            torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._parity = 0
        # The latest launch's sampled ids on the device and their rows by request.
        self._previous_ids = torch.zeros(1, dtype=torch.int64, device=device)
        self._previous_rows: dict[str, int] = {}
        self._one_back: LaunchedStep | None = None
        self._two_back: LaunchedStep | None = None
        self._pin = pin
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._tokens = RequestTokens()  # what penalties are over
        # LlamaModel takes its attention callable from the backend name; the
        # staged one reads the staging views instead of building tensors per step.
        model._paged_attention = staged_paged_attention
        model.triton_elementwise = fused_elementwise  # one Triton kernel per elementwise stage
        self.fused_elementwise_error = ""
        if fused_elementwise and self._is_cuda:
            self._probe_fused_elementwise()
        self._graph_rows = torch.arange(max_num_seqs, dtype=torch.int64, device=device)
        self._capture_steps: dict[int, StagedStep] = {}
        self._graphs: DecodeGraphs | None = None
        self.graph_stats = GraphStats(enabled=False, disabled_reason="turned off")
        if use_cuda_graphs and not self._is_cuda:
            self.graph_stats = GraphStats(enabled=False, disabled_reason="not a CUDA device")
        if self._is_cuda:
            self._compile_attention_kernels()
        if use_cuda_graphs and self._is_cuda:
            self._capture(min(max_num_seqs, max_num_batched_tokens))
        self._layer_graphs: LayerGraphs | None = None
        self.layer_graph_stats = GraphStats(enabled=False, disabled_reason="turned off")
        if prefill_graph_tokens > 0 and (use_cuda_graphs or not self._is_cuda):
            self._layer_graphs = LayerGraphs(
                model, self.device_pool, self._staging.device_views,
                min(prefill_graph_tokens, max_num_batched_tokens), max_num_seqs,
            )  # fmt: skip
            if self._is_cuda:
                with torch.inference_mode():
                    self.layer_graph_stats = self._layer_graphs.capture(self._prepare_layer_graphs)
                if not self.layer_graph_stats.enabled:
                    self._layer_graphs = None  # padded eager pieces would only cost more
            else:
                self.layer_graph_stats = self._layer_graphs.stats

    def use_requests(self, requests: RequestLookup) -> None:
        """Where the sampler's penalties read each request's tokens (the engine's records)."""
        self._tokens.use(requests)

    def info(self) -> dict[str, Any]:
        """For the start-up log and ``GetModelInfo``."""
        return {
            "device": describe_device(self.device),
            "cuda_graphs": self.graph_stats.as_dict(),
            "layer_graphs": self.layer_graph_stats.as_dict(),
            "pinned_host_memory": self._pin,
            "fused_elementwise": self.model.triton_elementwise,
            "fused_elementwise_error": self.fused_elementwise_error,
        }

    @property
    def whole_step_max_context(self) -> int:
        """The longest decode context a step with a prefill replays its
        whole-step graph with; past it, the per-layer pieces (0: the pieces
        whenever it decodes). 0 without layer graphs."""
        return 0 if self._layer_graphs is None else self._layer_graphs.whole_max_context

    @whole_step_max_context.setter
    def whole_step_max_context(self, tokens: int) -> None:
        if self._layer_graphs is not None:
            self._layer_graphs.whole_max_context = tokens

    def memory(self) -> PoolStats | None:
        """The GPU's memory in bytes, used (by this process and any other) and
        free, as the driver reports it: for the metrics scrape (None off CUDA)."""
        if not self._is_cuda:
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return PoolStats(int(total - free), int(free))

    def execute(self, plan: StepPlan, matchers: dict[str, Matcher] | None = None) -> StepResult:
        """Runs ``plan`` and waits for it; raises ``StepOutOfMemory`` when the
        device runs out."""
        return self.launch(plan, matchers).result()

    @torch.inference_mode()
    def launch(
        self, plan: StepPlan, matchers: dict[str, Matcher] | None = None
    ) -> DoneStep | LaunchedStep:
        """Queues ``plan`` on the device and returns without waiting; the
        handle's ``result()`` waits for its sampled ids. A ``PENDING_TOKEN`` of
        the plan is the step launched before it's sample for that request,
        taken on the device: planning and launching step N+1 need nothing
        from step N but its place in the queue. ``matchers``: of the
        constrained sampled rows, by req_id (grammar.py); their masks are
        filled on the host while the forward runs and applied before
        sampling (the engine launches no step of theirs ahead of the
        previous one's results). Raises ``StepOutOfMemory``."""
        try:
            self._swapper.swap_out(plan.swap_out)
            self._swapper.swap_in(plan.swap_in)
            self._swapper.copy(plan.copies)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            req_ids = [s.req_id for s in plan.seqs] + list(plan.preempted_req_ids)
            raise self._out_of_memory(exc, req_ids) from exc
        if not plan.seqs:
            return DoneStep(StepResult({}, 0))
        try:
            return self._forward(plan, matchers)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            raise self._out_of_memory(exc, [s.req_id for s in plan.seqs]) from exc

    def land_swaps(self) -> None:
        """Completes pending swap-outs into the host pool (before reading it directly)."""
        self._swapper.land()

    def _out_of_memory(self, exc: BaseException, req_ids: list[str]) -> StepOutOfMemory:
        if self._is_cuda:
            torch.cuda.empty_cache()
        return StepOutOfMemory(req_ids, str(exc).splitlines()[0] if str(exc) else "")

    def _forward(self, plan: StepPlan, matchers: dict[str, Matcher] | None) -> LaunchedStep:
        # Staging and sampled-id buffers come in pairs: the step two launches
        # back must have landed before its buffers are reused (the engine has
        # always read it by now; this keeps any caller right).
        if self._two_back is not None:
            self._two_back.result()
        bucket = None
        if self._graphs is not None and is_decode_only(plan):
            bucket = bucket_for(len(plan.seqs), self._graphs.sizes)
        token_bucket = None
        if bucket is None and self._layer_graphs is not None:
            token_bucket = self._layer_graphs.bucket(plan.num_tokens)
        vocab = self.model.config.vocab_size
        staged = stage_step(
            plan, self._staging, self.block_size, vocab, pad_to=bucket,
            previous_rows=self._previous_rows, pad_tokens_to=token_bucket,
        )  # fmt: skip
        self._staging.upload(staged.num_rows)
        views = self._staging.device_views
        resolve_pending_tokens(views, self._previous_ids, staged.num_pending)
        num_sampled = len(staged.sampled_req_ids)
        if bucket is not None and self._graphs is not None:
            logits = self._graphs.replay(bucket)
            logits = logits.index_select(0, views["sample_indices"][:num_sampled])
        else:
            meta = staged_metadata(staged, views, self.block_size)
            sample_indices = views["sample_indices"][:num_sampled]
            if token_bucket is not None and self._layer_graphs is not None:
                logits = self._layer_graphs.forward(token_bucket, meta, sample_indices)
            else:
                tokens = staged.num_tokens
                logits = self.model.forward(
                    views["token_ids"][:tokens], views["positions"][:tokens], self.device_pool,
                    meta, sample_indices,
                )  # fmt: skip
        if not num_sampled:
            self._previous_rows = {}
            return self._launched(LaunchedStep(self._record_done(), None, [], plan.num_tokens))
        wanted = LogprobRows.of_plan(staged.sampled_req_ids, plan.seqs)
        taken = None if wanted is None else wanted.log_probs(logits)  # before sampling scales
        if matchers is not None:  # after the log-probabilities: the model's, unmasked
            mask_logits(logits, staged.sampled_req_ids, matchers)
        batch = self._sampling_batch(staged, views)
        adjustments = self._adjustments(plan, views, num_sampled)
        ids = sample_tensors(logits, batch, self._generator, adjustments=adjustments)
        picked = None if wanted is None or taken is None else wanted.pick(taken, ids)
        self._previous_ids = ids  # the next plan's pending tokens, on the device
        self._previous_rows = {req_id: row for row, req_id in enumerate(staged.sampled_req_ids)}
        host = self._sampled_host[self._parity][:num_sampled]
        self._parity ^= 1  # the step after this one copies into the other buffer
        host.copy_(ids, non_blocking=True)
        step = LaunchedStep(
            self._record_done(), host, staged.sampled_req_ids, plan.num_tokens, picked
        )
        return self._launched(step)

    def _launched(self, step: LaunchedStep) -> LaunchedStep:
        self._two_back, self._one_back = self._one_back, step
        return step

    def _sampling_batch(self, staged: StagedStep, views: dict[str, torch.Tensor]) -> SamplingBatch:
        plan = staged.sampling
        rows, unseeded, seeded = len(plan.rows), len(plan.unseeded), len(plan.seeded)
        return SamplingBatch(
            plan=plan,
            rows=views["sample_rows"][:rows],
            temperatures=views["temperatures"][:rows],
            top_ks=views["top_ks"][:rows],
            top_ps=views["top_ps"][:rows],
            unseeded=views["unseeded"][:unseeded],
            seeded=views["seeded"][:seeded],
            seeded_uniforms=views["seeded_uniforms"][:seeded] if seeded else None,
            min_ps=views["min_ps"][:rows] if plan.min_ps else None,
        )

    def _adjustments(
        self, plan: StepPlan, views: dict[str, torch.Tensor], num_sampled: int
    ) -> LogitAdjustments | None:
        """The step's penalties and logit biases, None where no request asks.
        Eager, after any graph replay: nothing a request asks is captured.
        Each sampled row's last input token is read on the device, where a
        pending one was put (``resolve_pending_tokens``)."""
        sampled = [s for s in plan.seqs if s.sample]  # stage_step's order
        adjusting = self._tokens.plan(sampled, self.model.config.vocab_size)
        if adjusting is None:
            return None
        last_tokens = views["token_ids"].index_select(0, views["sample_indices"][:num_sampled])
        return adjustment_tensors(adjusting, last_tokens)

    def _record_done(self) -> torch.cuda.Event | None:
        """An event after the work queued so far (None off CUDA: it has run)."""
        if not self._is_cuda:
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def _probe_fused_elementwise(self) -> None:
        """Runs each fused elementwise kernel once on this GPU. One that does
        not compile or run here leaves the model on the eager torch ops, said
        in the log and ``info()``, rather than failing every step."""
        from slipstream.kernels import triton_elementwise as ops

        cfg, dtype, device = self.model.config, self.model.dtype, self.device
        try:
            x = torch.ones(1, cfg.hidden_size, dtype=dtype, device=device)
            ops.add_rms_norm_(x, x.clone(), self.model.norm, cfg.rms_norm_eps)
            ops.rms_norm(x, self.model.norm, cfg.rms_norm_eps)
            ops.silu_and_mul(torch.ones(1, 2 * cfg.intermediate_size, dtype=dtype, device=device))
            heads = cfg.num_heads + cfg.num_kv_heads
            qk = torch.ones(1, heads, cfg.head_dim, dtype=dtype, device=device)
            positions = torch.zeros(1, dtype=torch.int64, device=device)
            ops.rotary_neox_(qk, self.model.rope_cos, self.model.rope_signed_sin, positions)
            if self._is_cuda:
                torch.cuda.synchronize(device)
        except Exception as exc:  # a compiler's or driver's error, whatever its type
            self.model.triton_elementwise = False
            self.fused_elementwise_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log.warning("fused elementwise kernels unavailable, eager torch ops instead: %s",
                        self.fused_elementwise_error)  # fmt: skip

    def _compile_attention_kernels(self) -> None:
        """Launches the decode kernel once with each split count a step may
        pick (``possible_num_splits`` of the longest context), and the prefill
        kernel once, so that Triton compiles every variant at start-up: a
        variant first met while serving costs its step a compile, about a
        second on a GPU machine's host (the prefill kernel serves the steps
        above ``prefill_graph_tokens``, often the first ones). Nothing is
        written but a scratch output."""
        cfg = self.model.config
        chunk = ScheduledSeq("compile", [0, 0], 0, [0], False, 0, SamplingParams())
        step = stage_step(StepPlan(step=-1, seqs=[chunk]), self._staging, self.block_size, 1)
        self._staging.upload(step.num_rows)
        meta = staged_metadata(step, self._staging.device_views, self.block_size)
        # q as the model hands it over: the query heads of a [tokens, q+k heads, dim] tensor
        qk = torch.zeros(2, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim,
                         dtype=self.model.dtype, device=self.device)  # fmt: skip
        q = qk[:, : cfg.num_heads]
        out = torch.empty(q.shape, dtype=q.dtype, device=self.device)
        k_cache, v_cache = self.device_pool[0]
        prefill_ids = meta.triton.prefill_seq_ids
        assert prefill_ids is not None  # the two-token chunk
        paged_prefill(
            q, k_cache, v_cache, meta.block_tables, meta.triton.seq_lens, meta.query_start_loc,
            prefill_ids, 2, self.model.scale, out,
        )  # fmt: skip
        # the chunk's row as a decode of the longest context, each split count
        ids = prefill_ids[:1]
        for splits in possible_num_splits(self._max_context):
            paged_decode(
                q, k_cache, v_cache, meta.block_tables, meta.triton.seq_lens, ids, ids,
                self._max_context, self.model.scale, out, num_splits=splits,
            )  # fmt: skip
        if self._is_cuda:
            torch.cuda.synchronize(self.device)

    def _capture(self, max_batch: int) -> None:
        self._graphs = DecodeGraphs(graph_batch_sizes(max_batch))
        with torch.inference_mode():
            stats = self._graphs.capture(self.device, self._prepare_graph, self._graph_body)
        self.graph_stats = stats
        if not stats.enabled:
            self._graphs = None

    def _prepare_layer_graphs(self, num_tokens: int) -> None:
        stage_step(StepPlan(step=-1), self._staging, 1, 1, pad_tokens_to=num_tokens)
        self._staging.upload(0)

    def _prepare_graph(self, size: int) -> None:
        self._capture_steps[size] = stage_padding(self._staging, size)
        self._staging.upload(size)

    def _graph_body(self, size: int) -> torch.Tensor:
        """A decode step of ``size`` rows over the staged inputs: logits ``[size, vocab]``.
        Captured with the longest context, which fixes the decode kernel's splits."""
        step = self._capture_steps[size]
        views = self._staging.device_views
        meta = staged_metadata(step, views, self.block_size, max_decode_len=self._max_context)
        return self.model.forward(
            views["token_ids"][:size], views["positions"][:size], self.device_pool, meta,
            self._graph_rows[:size],
        )  # fmt: skip

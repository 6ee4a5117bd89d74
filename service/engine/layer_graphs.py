"""CUDA graphs for steps with a prefill: the whole step as one graph, or the
forward cut at each layer's attention.

A decode-only step replays one graph of the whole forward (``cuda_graphs.py``).
A step with a prefill chunk cannot with the decode and prefill kernels: their
launch grids follow the chunks' lengths, which only the host knows, step by
step. Everything else in a layer depends on the number of tokens alone, and
``triton_paged_varlen`` attends a whole ragged step in one launch whose grid
depends on the padded token count alone, so each padded token count
(``token_buckets``) gets one graph of the whole step, attention included.
That kernel walks a long decode context in one program a KV head (no split),
so a step whose decodes reach past ``WHOLE_STEP_MAX_CONTEXT`` tokens takes
the other way: the forward cut at the attention into ``L + 1`` pieces, each
captured once per padded token count and replayed around the decode and
prefill kernels launched eagerly::

    piece 0      embed -> x; RMSNorm; qkv; RoPE; KV write            (layer 0)
    attention 0  eager: the decode and prefill kernels -> attn
    piece i      o_proj; add+RMSNorm; MLP; add+RMSNorm   (layer i-1),
                 qkv; RoPE; KV write                                 (layer i)
    ...
    piece L      o_proj; add+RMSNorm; MLP; add                  (last layer)
    tail         eager: the final norm of the sampled rows, the LM head
                 (a whole step holds it in its graph)

An eager step is ~10 launches a layer, each costing the host more than the
GPU takes to run it; through the pieces it is one graph and the attention's
one to four (with decodes: their kernel, its split reduction, buffers) and
the tail's; as a whole step, one graph for the step, tail included: it
gathers a fixed ``sampled_rows_for(T)`` rows (the staged sample indices,
padded with token 0) and the step's logits are the first rows of its
output. The LM head then runs over up to ``max_num_seqs`` rows where the
step samples a few (on an H200, microseconds of GPU time a step) instead of
the tail's launches (~0.37 ms of host time a step on that machine's host).

A step of n tokens runs at the smallest bucket ``T >= n``: tokens ``n .. T``
are padding (token 0, position 0, slot -1: the KV write skips them, no
attention reads them as queries, and a projection's or a norm's output row
depends on its own input row only). What crosses a piece boundary lives at
a fixed address: the residual stream ``x`` and the attention output in
buffers of the largest bucket, each piece's q in its captured output, held
as long as the graphs. Pieces are captured in the order they replay, into
one memory pool, so a piece's scratch may reuse an earlier piece's, never
something a later piece still reads; each bucket's whole-step graph after
its pieces, into the same pool (its q lives within it).

Without graphs (off CUDA, or a capture that failed) the same bodies run
eagerly at the padded size: how the padding and the buffers are tested on
the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from slipstream.kernels.backend import triton_attention_for_step
from slipstream.kernels.triton_kv_write import write_kv_slots
from slipstream.kernels.triton_paged_varlen import paged_varlen, varlen_programs
from slipstream.service.engine.config import WHOLE_STEP_MAX_CONTEXT
from slipstream.service.engine.cuda_graphs import GraphStats, bucket_for, capture_sizes
from slipstream.service.engine.staged_attention import StagedAttentionMetadata
from slipstream.service.engine.staging import sampled_rows_for
from slipstream.service.models.llama import LlamaModel

log = logging.getLogger(__name__)

KVPool = list[tuple[torch.Tensor, torch.Tensor]]


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """``smallest``, doubling while below ``max_tokens``, then ``max_tokens``:
    a step pads to at most twice its tokens (or to ``smallest``)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    sizes = []
    size = smallest
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


def layer_graph_bytes(model: LlamaModel, max_tokens: int, max_seqs: int) -> int:
    """A bound on the memory ``LayerGraphs`` of ``max_tokens`` takes: twice
    what it keeps, i.e. the three fixed buffers (the residual stream, the
    attention output, the whole steps' float32 logits), every bucket's held
    qkv outputs (the buckets double, so their tokens sum to under twice the
    largest) and the largest piece's scratch (normed input, gate/up and its
    product; a whole-step graph's also a layer's qkv and its tail's gathered
    rows and LM head output). Twice, for the caching allocator's segments
    around them: on an H200 (smollm2-shape, bf16, 512 tokens) the pieces'
    captures took 107 MB of graph pool for the 66 MB counted here once
    (before the logits buffer). 0 for ``max_tokens`` 0."""
    if max_tokens <= 0:
        return 0
    cfg = model.config
    element = model.embed.element_size()
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    buffers = max_tokens * (cfg.hidden_size + cfg.num_heads * cfg.head_dim)
    held = 2 * max_tokens * cfg.num_layers * qkv
    rows = sampled_rows_for(max_tokens, max_seqs)
    scratch = max_tokens * (2 * cfg.hidden_size + 3 * cfg.intermediate_size + qkv)
    scratch += rows * (cfg.hidden_size + cfg.vocab_size)
    return 2 * ((buffers + held + scratch) * element + rows * cfg.vocab_size * 4)


class LayerGraphs:
    """The pieces of ``model``'s fused forward over the staged device views
    ``views`` (token ids, positions, slot mapping: regions that never move),
    for steps of up to ``max_tokens`` tokens; ``capture()`` records them as
    CUDA graphs, ``forward()`` runs a step through them."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: KVPool,
        views: dict[str, torch.Tensor],
        max_tokens: int,
        max_seqs: int,
    ) -> None:
        cfg, device = model.config, model.embed.device
        self.model = model
        self.sizes = token_buckets(max_tokens)
        self.whole_max_context = WHOLE_STEP_MAX_CONTEXT
        self._max_seqs = max_seqs
        self._group = cfg.num_heads // cfg.num_kv_heads
        self.stats = GraphStats(enabled=False, disabled_reason="not captured")
        self._kv = kv_caches
        self._views = views
        self._x = torch.zeros(max_tokens, cfg.hidden_size, dtype=model.dtype, device=device)
        self._attn = torch.zeros(
            max_tokens, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=device
        )
        # Every bucket's whole step writes its logits here: one buffer, not one a graph.
        rows = sampled_rows_for(max_tokens, max_seqs)
        self._logits = torch.zeros(rows, cfg.vocab_size, dtype=torch.float32, device=device)
        # Per bucket, per piece: the graph and the q it leaves (None: the last
        # piece), then the whole step's graph (None: its logits are ``_logits``).
        self._graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, torch.Tensor | None]]] = {}

    def bucket(self, num_tokens: int) -> int | None:
        """The padded size a step of ``num_tokens`` runs at; None above the largest."""
        return bucket_for(num_tokens, self.sizes)

    def forward(
        self, size: int, meta: StagedAttentionMetadata, sample_indices: torch.Tensor
    ) -> torch.Tensor:
        """A step staged with its tokens padded to ``size`` (a bucket): the
        logits of ``sample_indices``, as ``LlamaModel.forward`` gives them.
        One graph when its decodes' contexts allow, else the pieces."""
        model = self.model
        graphs = self._graphs.get(size)
        if meta.triton.max_decode_len <= self.whole_max_context:
            if graphs is not None:
                graphs[-1][0].replay()
            else:
                self._whole_step(size)
            return self._logits[: sample_indices.shape[0]]  # the staged rows, then the padding's
        self._pieces(size, meta, graphs)
        return model.sampled_logits(self._x[:size], sample_indices, model.fused_elementwise_ops())

    def _pieces(
        self,
        size: int,
        meta: StagedAttentionMetadata,
        graphs: list[tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] | None,
    ) -> None:
        model = self.model
        num_tokens = meta.num_tokens
        for i in range(len(model.layers) + 1):
            if graphs is not None:
                graph, q = graphs[i]
                graph.replay()
            else:
                q = self._piece(i, size)
            if q is not None:
                k_cache, v_cache = self._kv[i]
                # The inputs are checked at the first layer: the others differ in buffers only.
                triton_attention_for_step(
                    q[:num_tokens], k_cache, v_cache, meta, meta.triton, model.scale,
                    out=self._attn[:num_tokens], check=i == 0,
                )  # fmt: skip

    def _whole_step(self, size: int) -> None:
        """Every piece at ``size`` tokens with each layer's attention in one
        varlen launch over the staged views, then the tail over the first
        ``sampled_rows_for(size)`` staged sample indices (padded with token
        0) into ``_logits``: the body of a whole-step graph."""
        model, views = self.model, self._views
        ops = model.fused_elementwise_ops()
        programs = varlen_programs(size, min(size, self._max_seqs), self._group)
        for i in range(len(model.layers) + 1):
            q = self._piece(i, size)
            if q is not None:
                k_cache, v_cache = self._kv[i]
                paged_varlen(
                    q, k_cache, v_cache, views["block_tables"], views["seq_lens_i32"],
                    views["query_start_loc"], views["num_rows"], programs, model.scale,
                    out=self._attn[:size], check=i == 0,
                )  # fmt: skip
        rows = sampled_rows_for(size, self._max_seqs)
        h = self._x[:size][views["sample_indices"][:rows]]
        # LlamaModel.sampled_logits' norm and LM head (float32 where Linear.float_mm)
        h = ops.rms_norm(h, model.norm, model.config.rms_norm_eps)
        self._logits[:rows].copy_(model.lm_head(h))

    def _piece(self, i: int, size: int) -> torch.Tensor | None:
        """Piece ``i`` at ``size`` tokens; returns layer i's q (None: the last piece)."""
        model, views = self.model, self._views
        ops = model.fused_elementwise_ops()
        x = self._x[:size]
        if i == 0:
            x.copy_(F.embedding(views["token_ids"][:size], model.embed))
            h = ops.rms_norm(x, model.layers[0].input_norm, model.config.rms_norm_eps)
        else:
            h = model.after_attention(i - 1, x, self._attn[:size], ops)
        if i == len(model.layers):
            return None
        q, k, v = model.attention_inputs(i, h, views["positions"][:size], ops)
        k_cache, v_cache = self._kv[i]
        write_kv_slots(k_cache, v_cache, k, v, views["slot_mapping"][:size])
        return q

    def capture(self, prepare: Callable[[int], None]) -> GraphStats:
        """Captures every piece, then the whole step, at every bucket, largest
        first; ``prepare(T)`` stages and uploads a step of T padding tokens.
        On any failure drops them all and says why in the stats (such steps
        then run eagerly)."""
        pieces = range(len(self.model.layers) + 1)

        def bodies(size: int) -> list[Callable[[], torch.Tensor | None]]:
            whole = partial(self._whole_step, size)
            return [*(partial(self._piece, i, size) for i in pieces), whole]

        try:
            captured, self.stats = capture_sizes(
                self.sizes, self.model.embed.device, prepare, bodies
            )
        except Exception as exc:  # an allocator's, a driver's or a capture's error
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self.stats = GraphStats(enabled=False, disabled_reason=f"capture failed: {reason}")
        if not self.stats.enabled:  # outside the except: its traceback no longer holds the graphs
            torch.cuda.empty_cache()
            log.warning("layer graph capture failed; steps with a prefill run eagerly: %s",
                        self.stats.disabled_reason)  # fmt: skip
            return self.stats
        self._graphs = captured
        return self.stats
